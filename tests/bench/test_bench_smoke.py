"""``megatron-prt bench`` runs end to end in its tiny --smoke mode, both sections (no timings
are checked: this machine is shared and timing is the benchmark's job, not a test's)."""

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_prt.bench.flags import add_flags, command_line, finish
from megatron_prt.cli.main import main as cli

pytest.importorskip("matplotlib")

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    assert cli(["bench", "--smoke", "--microbatches", "1,2", "--out", str(out)]) == 0
    return out


def _rows(out: Path, name: str, m: str) -> dict:
    data = json.loads((out / f"{name}.json").read_text())
    assert sorted(data["rows"]) == ["1", "2"]
    return {row["key"]: row for row in data["rows"][m]}


@pytest.mark.parametrize("name", ["vs_torch_pipelining", "megatron_bert"])
def test_writes_report_chart_and_data(smoke_run, name):
    report = (smoke_run / f"{name}.md").read_text()
    assert (smoke_run / f"{name}.png").read_bytes()[:4] == b"\x89PNG"
    assert "megatron-prt bench --microbatches 1,2 --out " in report
    assert "--smoke" in report and "Machine: " in report
    assert report.count("## m = ") == 2


def test_layer_stack_report_has_every_configuration(smoke_run):
    from megatron_prt.bench.layer_stack import all_configs

    report = (smoke_run / "vs_torch_pipelining.md").read_text()
    for cfg in all_configs():
        assert report.count(f"| {cfg.label} |") >= 2, cfg.label  # one row per m


def test_bert_report_has_every_configuration(smoke_run):
    from megatron_prt.bench.bert import labels

    report = (smoke_run / "megatron_bert.md").read_text()
    for label in labels():
        assert report.count(f"| {label} |") == 2, label
    rows = _rows(smoke_run, "megatron_bert", "2")
    for label in labels():
        row = rows[label]
        assert row["sim_s"] > 0 and len(row["samples_s"]) == 1
        assert len(row["peak_bytes"]) == 2 and min(row["peak_bytes"]) > 0
        assert row["wire_class"] == "ShmTransport"
    assert rows["PRT 1F1B (R=1)"]["vs_1f1b"] == 1.0


@pytest.mark.parametrize("m", ["1", "2"])
def test_bert_rows_train_the_same_model(smoke_run, m):
    """Every variant loads the same weights by global name and sees the same data: the
    losses agree to float32 rounding (only the stage split differs)."""
    rows = _rows(smoke_run, "megatron_bert", m).values()
    losses = [row["mean_loss"] for row in rows if "na" not in row]
    assert len(losses) >= 4
    assert max(losses) - min(losses) <= 1e-5 * abs(max(losses))


@pytest.mark.parametrize(
    "name, key",
    [
        ("vs_torch_pipelining", "PRT wave/bi R=2 [gloo]"),
        ("vs_torch_pipelining", "PRT wave/bi R=2 [shm]"),
        ("megatron_bert", "PRT wave/bi R=2"),
    ],
)
def test_bi_predictions_include_the_calibrated_replica_sum(smoke_run, name, key):
    data = json.loads((smoke_run / f"{name}.json").read_text())
    cals = data["replica"].values() if name == "vs_torch_pipelining" else [data["replica"]]
    for cal in cals:  # two timed points, the larger one reproduced by the fit
        (small, large), (_, seconds) = cal["bytes"], cal["seconds"]
        assert 0 < small < large
        fitted = large * (cal["wire_s_per_byte"] + cal["add_s_per_byte"]) + cal["latency_s"]
        assert fitted == pytest.approx(seconds, rel=1e-6)
    row = {r["key"]: r for r in data["rows"]["2"]}[key]
    assert row["sim_replica_s"] > 0
    sums = row["sim_replica_s"] + row.get("sim_tied_s", 0.0)  # tied: BERT's embedding
    assert row["sim_s"] == pytest.approx(row["sim_no_sum_s"] + sums)
    for other in data["rows"]["2"]:  # uni rows: nothing to sum
        assert "sim_replica_s" not in other or "bi" in other["label"]


def test_bert_same_plan_same_memory_as_simulated(smoke_run):
    """1F1B's measured peak per rank is what the simulator predicts from profiled bytes."""
    row = _rows(smoke_run, "megatron_bert", "2")["PRT 1F1B (R=1)"]
    for measured, simulated in zip(row["peak_bytes"], row["sim_peak_bytes"], strict=True):
        assert measured == pytest.approx(simulated, rel=0.1)


def test_refusals_are_reported_not_raised(smoke_run):
    rows = _rows(smoke_run, "vs_torch_pipelining", "1")
    assert rows["torch Schedule1F1B (1/rank) [gloo]"]["na"].startswith("n/a: ")
    assert rows["PRT wave/bi R=2 [shm]"]["na"].startswith("n/a: ")
    assert "median_s" in rows["torch ScheduleZBVZeroBubble (2/rank) [gloo]"]
    assert _rows(smoke_run, "megatron_bert", "1")["PRT wave/bi R=2"]["na"].startswith("n/a: ")


def test_same_schedule_same_memory_on_both_runtimes(smoke_run):
    """The meter hooked into torch's PipelineStage counts what PipelineRuntime counts: the
    same 1F1B order holds the same bytes, except the stage outputs torch keeps after
    sending them (its ``fwd_cache``), which PipelineRuntime frees once sent: on rank 0, one
    (mb_size x hidden) float32 output per micro-batch in flight (both, at m = 2). GELU saves
    its input, not its output, so nothing else holds them."""
    data = json.loads((smoke_run / "vs_torch_pipelining.json").read_text())
    rows = {row["key"]: row for row in data["rows"]["2"]}
    prt = rows["PRT 1F1B (R=1) [gloo]"]["peak_bytes"]
    theirs = rows["torch Schedule1F1B (1/rank) [gloo]"]["peak_bytes"]
    output_bytes = data["args"]["mb_size"] * data["args"]["hidden"] * 4
    assert theirs == [prt[0] + 2 * output_bytes, prt[1]]
    assert prt == rows["PRT 1F1B (R=1) [shm]"]["peak_bytes"]
    assert min(prt) > 0


def test_split_backward_rows_run_and_are_simulated_with_profiled_i_and_w(smoke_run):
    """megatron-prt's zb rows ran split plans (I and W), simulated under the split profile;
    torch's zero-bubble schedules are converted with their split; the target compares
    split-backward rows with torch's best."""
    data = json.loads((smoke_run / "vs_torch_pipelining.json").read_text())
    split = data["split_layer"]
    assert 0 < split["wgrad"] < split["bwd"]
    rows = {row["key"]: row for row in data["rows"]["2"]}
    for wire in ("gloo", "shm"):
        for label in ("PRT zb (R=1)", "PRT zb loop R=2", "PRT zb loop R=4", "PRT zb wave R=2"):
            row = rows[f"{label} [{wire}]"]
            assert row["split"] and row["split_backward"], row["key"]
            assert row["sim_s"] > 0 and min(row["peak_bytes"]) > 0
        assert not rows[f"PRT loop R=2 [{wire}]"]["split_backward"]
        # planned under 1F1B's peak with the profiled bytes: measured, it holds no more
        ours = rows[f"PRT zb (R=1) [{wire}]"]
        assert max(ours["peak_bytes"]) <= max(rows[f"PRT 1F1B (R=1) [{wire}]"]["peak_bytes"])
        assert len(ours["sim_peak_bytes"]) == 2 and min(ours["sim_peak_bytes"]) > 0
    assert 0 < data["layer"]["act"] <= data["layer"]["wact"] and data["head"]["wact"] == 0
    assert "## Side by side" in (smoke_run / "vs_torch_pipelining.md").read_text()
    assert rows["torch ScheduleInterleavedZeroBubble (2/rank) [gloo]"]["split_backward"]
    assert not rows["torch Schedule1F1B (1/rank) [gloo]"]["split_backward"]
    goals = {(t["m"], t["prt_rows"], t["prt_wires"]): t["goal"] for t in data["torch_target"]}
    assert goals[(2, "split backward", "gloo")] == 1.10
    assert goals[(2, "any", "gloo")] == 1.0


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_flags(parser)
    return parser.parse_args(argv)


def test_default_microbatches_cover_m_below_at_and_above_p():
    args = finish(_args())
    assert args.ranks == 2 and args.microbatches == [1, 2, 8]  # m < P, m = P, m = 4P


def test_benchmarks_write_under_out_unless_asked():
    """docs/benchmarks/ holds committed reports: only an explicit --out rewrites them."""
    from megatron_prt.bench import paper_scale, partition_memory
    from megatron_prt.bench.paper_scale import jobs
    from megatron_prt.bench.partition_memory import cases

    assert _args().out == "out/bench"
    assert jobs.DEFAULT_OUT == "out/bench/paper_scale.md"
    assert cases.DEFAULT_OUT == "out/bench/partition_memory.md"
    assert partition_memory.parse_args([]).out == cases.DEFAULT_OUT
    assert paper_scale.parse_args(["--out", "docs/benchmarks/x.md"]).out == "docs/benchmarks/x.md"


def test_md_table_renders_and_checks_row_lengths():
    from megatron_prt.bench.report import md_table

    assert md_table(["a", "b"], "lr", [(1, "x")]) == ["| a | b |", "|---|---:|", "| 1 | x |"]
    with pytest.raises(ValueError, match="row 0 has 1 cells"):
        md_table(["a", "b"], "lr", [(1,)])


def test_command_line_names_the_flags_that_differ():
    args = _args("--reps", "5", "--model", "bert", "--no-keep-freed-memory")
    assert command_line("megatron-prt bench", args) == (
        "megatron-prt bench --model bert --reps 5 --no-keep-freed-memory"
    )
    assert command_line("megatron-prt bench", _args()) == "megatron-prt bench"


def test_bad_flags_fail_before_any_rank_starts(capsys):
    assert cli(["bench", "--microbatches", "1,x"]) == 2
    assert "--microbatches" in capsys.readouterr().err


def test_old_script_is_the_layer_stack_section():
    help_text = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "vs_torch_pipelining.py"), "--help"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    assert "--microbatches" in help_text and "--bert-layers" in help_text
    other = subprocess.run(  # was taken: the BERT section ran under this name
        [sys.executable, str(ROOT / "benchmarks" / "vs_torch_pipelining.py"), "--model", "bert"],
        capture_output=True,
        text=True,
    )
    assert other.returncode == 2 and "--model is fixed to layers" in other.stderr


def test_replica_sum_fit_separates_latency_from_bandwidth():
    from megatron_prt.runtime.replica_timing import fit_replica_sum

    # 2 ms + 1 ns per byte, of which 0.25 ns the add: two exact points give it back
    line = [(n, 2e-3 + 1e-9 * n) for n in (1e4, 1e7)]
    latency, wire, add = fit_replica_sum(*line, add_s_per_byte=0.25e-9)
    assert (latency, wire, add) == pytest.approx((2e-3, 0.75e-9, 0.25e-9))
    # noise: the small size slower than the line allows -> no negative latency, and the
    # large size's time is still what the fit predicts
    latency, wire, add = fit_replica_sum((1e4, 5e-3), (1e5, 1e-3), add_s_per_byte=1.0)
    assert latency >= 0 and wire >= 0 and add >= 0
    assert latency + 1e5 * (wire + add) == pytest.approx(1e-3)


def test_smoke_keeps_the_flags_given_and_bad_counts_are_refused():
    """--smoke overwrote flags given beside it (``--smoke --reps 9 --hidden 256`` ran 1
    repetition at width 32 while the report quoted the command as given), and counts such
    as ``--warmup -5`` or ``--layers 0`` ran (no warm-up; "-5 warm-up steps" in the report)."""
    args = finish(_args("--smoke", "--reps", "9", "--hidden", "256"))
    assert (args.reps, args.hidden, args.warmup, args.mb_size) == (9, 256, 1, 2)
    for flag, value in (("--warmup", "-5"), ("--layers", "0"), ("--burst", "0"), ("--ranks", "1")):
        with pytest.raises(SystemExit):
            _args(flag, value)
    assert _args("--warmup", "0").warmup == 0
