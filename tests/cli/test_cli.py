import json
import subprocess
import sys

import pytest

from megatron_prt.core import Placement, build_plan
from megatron_prt.sim.cost import CostModel
from megatron_prt.sim.simulate import simulate


def test_plan_json_has_the_documented_keys(run_cli):
    code, out, _ = run_cli(
        "plan",
        "--pp",
        4,
        "--reuse",
        2,
        "-m",
        5,
        "--placement",
        "wave",
        "--direction",
        "bi",
        "--format",
        "json",
    )
    assert code == 0
    data = json.loads(out)
    for key in ("num_stages", "num_microbatches", "stage_to_rank", "pipelines", "ranks", "config"):
        assert key in data
    assert data["num_stages"] == 16 and len(data["ranks"]) == 4
    assert data["config"] == {
        "pp": 4,
        "reuse": 2,
        "placement": "wave",
        "direction": "bi",
        "microbatches": 5,
        "schedule": "prt",
    }


def test_plan_text_and_files(run_cli, tmp_path):
    code, out, _ = run_cli("plan", "--pp", 2, "--reuse", 2, "-m", 4)
    assert code == 0 and "bubble 11.1%" in out and "timeline:" in out
    for fmt in ("csv", "chrome", "png"):
        path = tmp_path / f"p.{fmt}"
        code, _, _ = run_cli("plan", "--pp", 2, "-m", 3, "--format", fmt, "-o", path)
        assert code == 0 and path.stat().st_size > 0


def test_simulate_json(run_cli):
    code, out, _ = run_cli(
        "simulate", "--pp", 4, "-m", 8, "--reuse", 2, "--fwd-time", 4, "--bwd-time", 8, "--json"
    )
    data = json.loads(out)
    assert code == 0 and data["bubble_fraction"] == pytest.approx(3 / 19)
    assert data["makespan"] == pytest.approx((16 + 3) * 12 / 8)
    assert set(data["per_rank"][0]) >= {"busy", "idle", "peak_inflight", "peak_activation_bytes"}


def test_simulate_costs_file(run_cli, tmp_path):
    costs = tmp_path / "c.json"
    costs.write_text(json.dumps({"fwd_time": 2.0, "bwd_time": 4.0, "p2p_latency": 0.25}))
    code, out, _ = run_cli("simulate", "--pp", 2, "-m", 1, "--costs", costs, "--json")
    assert code == 0
    assert json.loads(out)["makespan"] == pytest.approx(6.0 + 2 * 0.25)


def test_compare_table(run_cli):
    code, out, _ = run_cli("compare", "--pp", 8, "-m", 8, "--reuse", 4)
    assert code == 0
    rows = {line.split("  ")[0].strip(): line for line in out.splitlines()}
    assert "1.000x" in rows["1F1B"] and "1.538x" in rows["PRT loop/uni R=4"]
    code, out, _ = run_cli("compare", "--pp", 4, "-m", 6, "--reuse", 2)
    assert "n/a" in out  # megatron-core's interleaved refuses m=6 on 4 ranks; PRT runs


@pytest.mark.parametrize(
    "argv, match",
    [
        (["plan", "--pp", "0", "-m", "2"], "argument --pp: must be an integer >= 1, got '0'"),
        (["plan", "--pp", "2", "--reuse", "0", "-m", "2"], "argument --reuse: must be"),
        (["plan", "--pp", "2", "-m", "0"], "argument --microbatches/-m: must be"),
        (["plan", "--pp", "2", "-m", "1", "--direction", "bi"], "bi needs >= 2 micro-batches"),
        (["plan", "--pp", "2", "-m", "2", "--placement", "zig"], "invalid choice: 'zig'"),
        (["simulate", "--pp", "2", "-m", "2", "--schedule", "x"], "invalid choice: 'x'"),
        (["plan", "--pp", "2", "-m", "2", "--format", "png"], "--format png needs -o FILE"),
        (
            ["plan", "--pp", "2", "-m", "2", "--split-backward", "--mem-cap", "foo"],
            "--mem-cap: must be 1f1b, zb-h2 or bytes > 0 (2.5e9, 24GiB, 512MiB), got 'foo'",
        ),
    ],
)
def test_bad_flags_exit_nonzero_with_one_line(argv, match):
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_prt", *argv], capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert proc.stdout == "" and len(proc.stderr.strip().splitlines()) == 1
    assert match in proc.stderr


def test_partition_and_profile_are_subcommands(run_cli, tmp_path):
    import json

    costs = tmp_path / "c.json"
    layer = {"fwd": 1.0, "bwd": 2.0, "act": 3.0, "param": 1.0}
    costs.write_text(json.dumps({"layers": [layer] * 6, "head": {**layer, "act": 9.0}}))
    code, out, err = run_cli("partition", "--pp", 2, "--reuse", 2, "--microbatches", 4,
                             "--costs", costs)  # fmt: skip
    assert code == 0, err
    assert "uniform" in out and "balanced" in out
    code, _, err = run_cli("profile", "--num-layers", 0)
    assert code == 2 and err.count("\n") == 1


# -- the bi replica-gradient sum -----------------------------------------------------------
def test_simulate_adds_the_replica_sync_to_bi(run_cli):
    flags = ("simulate", "--pp", 2, "-m", 2, "--direction", "bi", "--fwd-time", 2, "--bwd-time", 4)
    _, out, _ = run_cli(*flags, "--json")
    base = json.loads(out)
    code, out, _ = run_cli(*flags, "--replica-sync-time", 0.5, "--json")
    data = json.loads(out)
    assert code == 0 and base["makespan"] == pytest.approx(6.0)  # both ranks end at 6
    assert data["makespan"] == pytest.approx(6.5) and data["replica_sync_time"] == 0.5
    assert [r["replica_sync"] for r in data["per_rank"]] == [0.5, 0.5]
    _, text, _ = run_cli(*flags, "--replica-sync-time", 0.5)
    assert "replica sync    0.5 added to the makespan" in text and "replica_wait" in text
    _, uni, _ = run_cli("simulate", "--pp", 2, "-m", 2, "--replica-sync-time", 0.5)
    assert "replica" not in uni and "makespan        4.5" in uni


def test_simulate_adds_the_tied_embedding_sum(run_cli, tmp_path):
    costs = tmp_path / "tied.json"
    costs.write_text(json.dumps({"fwd_time": 2, "bwd_time": 4, "tied_grad_bytes": 16}))
    flags = ("simulate", "--pp", 2, "-m", 2, "--costs", costs, "--replica-sync-time", 0.5)
    code, out, err = run_cli(*flags, "--json")
    assert code == 0, err
    data = json.loads(out)  # 1F1B ends at 9 (test_sim_tied.py); the pair's latency 0.5
    assert data["makespan"] == pytest.approx(9.5) and data["tied_sync_time"] == 0.5
    _, text, _ = run_cli(*flags)
    assert "tied emb sum    0.5 added to the makespan" in text
    _, wave, _ = run_cli(*flags, "--reuse", 2, "--placement", "wave")
    assert "tied emb sum" not in wave  # both copies on rank 0: a free add


def test_compare_lists_each_split_backward_layout_once(run_cli):
    """At R = 2 ZB-V is ZB wave/uni R=2: the table showed the same plan twice."""
    for reuse in (2, 3):
        code, out, _ = run_cli("compare", "--pp", 4, "-m", 8, "--reuse", reuse, "--split-backward")
        rows = [line.split("  ")[0] for line in out.splitlines() if line.startswith("ZB ")]
        assert code == 0 and len(rows) == len(set(rows)) == (5 if reuse == 2 else 6), rows
        assert ("ZB wave/uni R=2 (ZB-V)" in rows) and (f"ZB wave/uni R={reuse}" in rows) == (
            reuse != 2
        ), rows


def test_compare_shows_the_replica_sync_column_when_it_costs(run_cli):
    _, free, _ = run_cli("compare", "--pp", 4, "-m", 8, "--reuse", 2)
    code, paid, _ = run_cli("compare", "--pp", 4, "-m", 8, "--reuse", 2, "--replica-sync-time", 1)
    assert code == 0 and "replica sync" not in free and "replica sync" in paid
    rows = {line.split("  ")[0].strip(): line.split() for line in paid.splitlines()}
    free_rows = {line.split("  ")[0].strip(): line.split() for line in free.splitlines()}
    bi, uni = "PRT loop/bi R=2", "PRT loop/uni R=2"
    # label (3 words), makespan, bubble, vs 1F1B, replica sync, ...
    assert rows[uni][6] == "-" and rows[uni][3] == free_rows[uni][3]  # makespan unchanged
    assert float(rows[bi][6]) > 0 and float(rows[bi][3]) > float(free_rows[bi][3])


# -- which plan is predicted ---------------------------------------------------------------
UNEQUAL = {"layers": [{"fwd": 3.0, "bwd": 6.0}] + [{"fwd": 1.0, "bwd": 2.0}] * 3}


@pytest.mark.parametrize(
    "flags, costs",
    [
        (["--pp", 2, "--reuse", 2, "-m", 3], {**UNEQUAL, "p2p_latency": 0.3}),
        (["--pp", 2, "--reuse", 2, "-m", 5, "--direction", "bi"], UNEQUAL),
    ],
)
def test_simulate_predicts_the_plan_the_runtime_runs(run_cli, tmp_path, flags, costs):
    """The runtime's callers (the megatron integration, the examples) build
    ``build_plan(placement, m, schedule)``; ``--plan-from-costs`` plans for the costs."""
    from megatron_prt.core import Placement, Plan, build_plan
    from megatron_prt.sim.cost import CostModel

    path = tmp_path / "c.json"
    path.write_text(json.dumps(costs))
    args = ["plan", *flags, "--costs", path, "--format", "json"]
    placement = Placement(2, 2, "loop", "bi" if "bi" in flags else "uni")
    m = flags[flags.index("-m") + 1]
    runtime_plan = build_plan(placement, m, "prt")
    cost_plan = build_plan(placement, m, "prt", CostModel.from_dict(costs).stage_times(placement))
    assert runtime_plan.ranks != cost_plan.ranks  # the case tells the two apart
    _, out, _ = run_cli(*args)
    assert Plan.from_json(out) == runtime_plan
    _, out, _ = run_cli(*args, "--plan-from-costs")
    assert Plan.from_json(out) == cost_plan
    _, out, _ = run_cli("simulate", *flags, "--costs", path, "--json")
    cost = CostModel.from_dict(costs)
    assert json.loads(out)["makespan"] == pytest.approx(simulate(runtime_plan, cost).makespan)


def test_the_megatron_integration_plans_for_equal_stages():
    """``megatron_prt.megatron.schedule`` calls ``build_plan(placement, m, schedule=...)``
    without stage times: the plan ``simulate`` predicts by default."""
    import ast
    import pathlib

    import megatron_prt

    source = pathlib.Path(megatron_prt.__file__).parent / "megatron" / "schedule.py"
    calls = [
        node
        for node in ast.walk(ast.parse(source.read_text()))
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "build_plan"
    ]
    assert calls, "the megatron integration no longer calls build_plan"
    for call in calls:
        assert len(call.args) <= 2 and {k.arg for k in call.keywords} <= {"schedule"}


@pytest.mark.parametrize(
    "argv, message",
    [
        (["compare", "--pp", "2", "--microbatches", "0"], "argument --microbatches/-m: must be"),
        (["compare", "--pp", "2", "-m", "-1"], "got '-1'"),
        (["compare", "--pp", "-2", "-m", "4"], "argument --pp: must be an integer >= 1"),
        (["compare", "--pp", "2", "-m", "4", "--reuse", "0"], "argument --reuse: must be"),
        (["simulate", "--pp", "2", "-m", "4", "--fwd-time", "0"], "argument --fwd-time: must be"),
        (["simulate", "--pp", "2", "-m", "4", "--bwd-time", "-1"], "argument --bwd-time: must"),
        (["simulate", "--pp", "2", "-m", "4", "--replica-sync-time", "-1"], "--replica-sync-time"),
        (["partition", "--pp", "0", "-m", "4", "--costs", "x.json"], "argument --pp: must be"),
        (["profile", "--num-layers", "0"], "argument --num-layers: must be an integer >= 1"),
        (["profile", "--reps", "0"], "argument --reps: must be an integer >= 1"),
        (["profile", "--threads", "-1"], "argument --threads: must be an integer >= 1"),
    ],
)
def test_numeric_flags_are_checked_by_argparse_naming_the_flag(argv, message, capsys):
    from megatron_prt.cli import main

    with pytest.raises(SystemExit) as caught:
        main(argv)
    err = capsys.readouterr().err
    assert caught.value.code == 2 and message in err and "Traceback" not in err


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "No such file or directory"),
        ("{not json", "not JSON"),
        ('{"fwd_time": "3"}', "key fwd_time must be a number, got '3'"),
        ('{"layers": [{"fwd": 1, "bwd": 2}], "stage_layers": "2"}', "key stage_layers must"),
        ('{"layers": [{"bwd": 2}]}', "cost layers[0] has keys ['bwd']; it needs fwd and bwd"),
        ('{"fwd": 1}', "unknown cost keys ['fwd']"),
        ("[1, 2]", "expected a JSON object of cost keys, got list"),
        # an infinite time crashed (OverflowError); only a bandwidth may be infinite
        (
            '{"layers": [{"fwd": 1, "bwd": 2, "split_bwd": Infinity}, {"fwd": 1, "bwd": 2}]}',
            "key layers[0].split_bwd must be a finite number (or null), got inf",
        ),
        # memory given beside layers that give none was not read: over-budget plans passed
        (
            '{"layers": [{"fwd": 1, "bwd": 2}, {"fwd": 1, "bwd": 2}], "activation_bytes": 8e9}',
            "cost layers give no act, so activation_bytes would price them at 0 bytes",
        ),
        (
            '{"layers": [{"fwd": 1, "bwd": 2}, {"fwd": 1, "bwd": 2}], '
            '"head": {"fwd": 1, "bwd": 1, "act": 1e6, "param": 1e6}}',
            "cost layers give no act, so head.act would price them at 0 bytes",
        ),
    ],
)
def test_a_bad_cost_file_is_one_error_naming_file_and_key(run_cli, tmp_path, content, message):
    path = tmp_path / "costs.json"
    if content is not None:
        path.write_text(content)
    code, out, err = run_cli("simulate", "--pp", 2, "-m", 4, "--costs", path)
    assert code == 2 and out == ""
    assert err.startswith(f"megatron-prt: error: --costs {path}: ") and message in err, err
    assert len(err.strip().splitlines()) == 1


def test_cost_model_load_names_the_file_and_the_key(tmp_path):
    from megatron_prt.core.placement import ConfigError
    from megatron_prt.sim.cost import CostModel

    path = tmp_path / "costs.json"
    path.write_text('{"layers": [{"fwd": 1, "bwd": 2, "act": null}]}')
    with pytest.raises(ConfigError, match=rf"^{path}: key layers\[0\]\.act must be a number"):
        CostModel.load(str(path))


def test_partition_refuses_the_stages_the_training_flags_refuse(run_cli, tmp_path):
    """Was: a split with empty stages that --pipeline-reuse-stage-layers' sibling, the
    uniform/balanced training split, refuses with the same rule."""
    from megatron_prt.core.placement import ConfigError, Placement
    from megatron_prt.megatron.config import ReuseConfig

    path = tmp_path / "costs.json"
    path.write_text(json.dumps({"layers": [{"fwd": 1, "bwd": 2}] * 3}))
    code, _, err = run_cli("partition", "--pp", 2, "--reuse", 2, "-m", 4, "--costs", path)
    assert code == 2
    assert f"--costs {path}: layer count 3 cannot fill D = R*P = 4 stages" in err
    with pytest.raises(ConfigError, match="--num-layers 3 cannot fill D = R\\*P = 4 stages"):
        ReuseConfig(Placement(2, 2), num_layers=3)
    code, _, _ = run_cli("partition", "--pp", 2, "--reuse", 2, "-m", 4, "--costs", path, "--pp", 1)
    assert code == 0  # 3 layers fill D = 2


@pytest.mark.parametrize("command", ["plan", "simulate", "compare", "partition", "profile",
                                     "tune", "bench"])  # fmt: skip
def test_every_subcommand_prints_its_help(command):
    """Was: ``partition --help`` raised argparse's ValueError (a bare % in a help text)."""
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_prt", command, "--help"], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("usage:") and proc.stderr == ""


def test_plan_simulate_and_compare_refuse_stages_the_layers_cannot_fill(run_cli, tmp_path):
    """Was: an 8-layer cost file priced R*P = 16 stages with empty ones, a layout the
    training flags, the runtime and ``tune`` refuse; now the same rule as theirs."""
    path = tmp_path / "costs.json"
    path.write_text(json.dumps({"layers": [{"fwd": 1, "bwd": 2}] * 8}))
    refusal = f"--costs {path}: layer count 8 cannot fill D = R*P = 16 stages"
    shape = ("--pp", 4, "-m", 8, "--reuse", 4, "--costs", path)
    for command in ("plan", "simulate"):
        code, out, err = run_cli(command, *shape)
        assert (code, out) == (2, "") and refusal in err and "lower --reuse or --pp" in err
    code, out, err = run_cli("compare", *shape)
    assert code == 0, err
    rows = {line.split("  ")[0].strip(): line for line in out.splitlines()}
    assert refusal in rows["PRT wave/uni R=4"] and "n/a" in rows["PRT wave/uni R=4"]
    assert "1.000x" in rows["1F1B"] and "x " in rows["Chimera-style bi R=1"]  # R = 1 fits
    assert "n/a" in rows["torch interleaved R=4"]  # the peers' rows follow the same rule
    code, _, err = run_cli("compare", "--pp", 16, "-m", 16, "--costs", path)
    assert code == 2 and "layer count 8 cannot fill D = R*P = 16 stages" in err
    split = tmp_path / "split.json"  # a file's own split may leave a stage empty: priced
    split.write_text(json.dumps({"layers": [{"fwd": 1, "bwd": 2}] * 8,
                                 "stage_layers": [0] + [1] * 8 + [0] * 7}))  # fmt: skip
    code, _, err = run_cli("simulate", *shape[:-1], split)
    assert code == 0, err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--mem-cap", "zb-h2"], "--mem-cap caps split-backward plans, not --schedule prt"),
        (["--schedule", "interleaved"], "--schedule interleaved with R = 1 is 1F1B"),
    ],
)
def test_flags_that_would_change_nothing_are_refused(run_cli, argv, message):
    """Was: a plain prt plan without a word for --mem-cap, and 1F1B for interleaved R = 1."""
    for command in ("plan", "simulate"):
        code, out, err = run_cli(command, "--pp", 2, "-m", 4, *argv)
        assert (code, out) == (2, "") and message in err


def test_chrome_trace_to_a_file_says_where(run_cli, tmp_path):
    out_file = tmp_path / "t.json"
    code, out, _ = run_cli("plan", "--pp", 2, "-m", 4, "--format", "chrome", "-o", out_file)
    assert code == 0 and out == f"wrote {out_file}\n"
    assert json.loads(out_file.read_text())


def test_chrome_trace_of_profiled_costs_is_in_their_seconds(run_cli, tmp_path):
    """Profiled costs are seconds; the trace took every unit for a millisecond, so a 5 ms
    forward showed as 5 us (the runtime's measured traces were right)."""
    from pathlib import Path

    costs = Path(__file__).parents[2] / "docs/benchmarks/costs/bert-base-h200-bf16.json"
    out_file = tmp_path / "t.json"
    argv = ("plan", "--pp", 4, "-m", 4, "--costs", costs, "--format", "chrome", "-o", out_file)
    assert run_cli(*argv)[0] == 0
    spans = [e for e in json.loads(out_file.read_text())["traceEvents"] if e["ph"] == "X"]
    simulated = simulate(build_plan(Placement(4), 4), CostModel.load(str(costs))).makespan
    assert max(e["ts"] + e["dur"] for e in spans) == pytest.approx(simulated * 1e6)


def test_simulate_bi_columns_sit_under_their_headers(run_cli):
    code, out, _ = run_cli("simulate", "--pp", 2, "-m", 4, "--direction", "bi",
                           "--replica-sync-time", 0.5)  # fmt: skip
    assert code == 0
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("rank  busy"))
    for column in ("param_bytes", "replica_wait", "replica_sync"):
        start = lines[header].index(column)
        assert lines[header + 1][start] != " " and lines[header + 1][start - 1] == " ", column


@pytest.mark.parametrize("command", ["plan", "tune", "profile"])
def test_every_writing_command_takes_output(command):
    """profile spelled its -o as --out while tune and plan say --output."""
    from megatron_prt.cli.main import build_parser

    extra = {"plan": ["--pp", "2", "-m", "4"],
             "tune": ["--costs", "c.json", "--pp", "2", "-m", "4"],
             "profile": ["--num-layers", "1", "--hidden-size", "8", "--num-attention-heads",
                         "1", "--seq-length", "8", "--micro-batch-size", "1",
                         "--vocab-size", "8"]}  # fmt: skip
    args = build_parser().parse_args([command, *extra.get(command, []), "--output", "f.json"])
    assert "f.json" in vars(args).values()


def test_wgrad_fraction_leaves_whole_backward_predictions_alone(run_cli):
    """W times chose the tick length, so a plan without I/W moved with --wgrad-fraction
    (0.134049 -> 0.1340499 here)."""
    from pathlib import Path

    costs = Path(__file__).parents[2] / "docs/benchmarks/costs/bert-base-h200-bf16.json"
    argv = ("simulate", "--costs", costs, "--pp", 4, "-m", 8, "--reuse", 3)
    argv += ("--placement", "wave", "--json")
    spans = []
    for extra in ((), ("--wgrad-fraction", 0.31), ("--wgrad-fraction", 0.07)):
        code, text, err = run_cli(*argv, *extra)
        assert code == 0, err
        spans.append(json.loads(text)["makespan"])
    assert spans[0] == spans[1] == spans[2]


def test_png_without_matplotlib_is_one_line(run_cli, tmp_path, monkeypatch):
    """A plain install (no matplotlib) printed two tracebacks for --format png."""
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    out = tmp_path / "p.png"
    code, _, err = run_cli("plan", "--pp", 2, "--reuse", 2, "-m", 4, "--format", "png", "-o", out)
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "pip install 'megatron-prt[plot]', or use --format chrome" in err


@pytest.mark.parametrize("placement", ["loop", "wave"])
def test_split_backward_simulates_the_plan_the_runtime_runs(run_cli, tmp_path, placement):
    """A cost file whose stages keep unequal bytes (a head) sized the CLI's zero-bubble plan
    with them, while the runtime and megatron run build_plan's: simulate priced another
    plan (wave: 60 for the runtime's 50, peaks 2048/2048 B for 3072/3584)."""
    from megatron_prt.core import Placement, build_plan
    from megatron_prt.sim.cost import CostModel

    layer = {"fwd": 1, "bwd": 2, "act": 256, "wact": 512, "param": 0}
    costs = {"layers": [layer] * 8, "head": {"fwd": 0, "bwd": 0, "act": 512, "wact": 0}}
    path = tmp_path / "costs.json"
    path.write_text(json.dumps({**costs, "message_bytes": 256}))
    flags = ["--pp", 2, "--reuse", 2, "--placement", placement, "-m", 4, "--split-backward"]
    code, out, err = run_cli("simulate", *flags, "--costs", path, "--json")
    assert code == 0, err
    runs = simulate(build_plan(Placement(2, 2, placement), 4, "zb"), CostModel.load(str(path)))
    said = json.loads(out)
    assert said["makespan"] == pytest.approx(runs.makespan)
    peaks = [rank["peak_activation_bytes"] for rank in said["per_rank"]]
    assert peaks == [rank.peak_activation_bytes for rank in runs.per_rank]


def test_compare_with_per_layer_costs_says_the_files_totals(run_cli, tmp_path):
    """With a per-layer cost file the header printed the flags' defaults (fwd=1 bwd=2) and the
    peaks were raw bytes under a header that said units of one micro-batch (2048.000 for
    0.8 of a micro-batch)."""
    layer = {"fwd": 1, "bwd": 2, "act": 256, "param": 0}
    path = tmp_path / "costs.json"
    path.write_text(json.dumps({"layers": [layer] * 8, "head": {"fwd": 0, "bwd": 0, "act": 512}}))
    code, out, err = run_cli("compare", "--pp", 2, "-m", 4, "--reuse", 2, "--costs", path)
    assert code == 0, err
    assert out.startswith("P=2 m=4 fwd=8 bwd=16 ")
    one_f_one_b = next(line for line in out.splitlines() if line.startswith("1F1B"))
    assert one_f_one_b.split()[4:] == ["0.800", "1.33", "0.80", "0.60"]  # of 2,560 B


def test_times_of_a_profiled_cost_file_are_said_in_seconds(run_cli, tmp_path):
    """tune and simulate printed a profile's times without a unit, while the flags' own
    times are in any unit: `--p2p-time 0.05` meant as ms was 50 ms a hop."""
    layers = [{"fwd": 0.001, "bwd": 0.002, "act": 1e6, "param": 1e6}] * 4
    for model, unit in (({"model": "gpt"}, " s"), (None, "")):
        costs = tmp_path / "c.json"
        costs.write_text(json.dumps({"layers": layers, "model": model}))
        code, out, _ = run_cli("simulate", "--pp", 2, "-m", 4, "--costs", costs)
        makespan = next(line for line in out.splitlines() if line.startswith("makespan"))
        assert code == 0 and makespan.endswith(" s") == bool(unit), makespan
        code, out, _ = run_cli("tune", "--pp", 2, "-m", 4, "--costs", costs, "--no-split-backward")
        assert code == 0 and ("time s" in out) == bool(unit), out


def test_flags_that_would_be_ignored_are_refused(run_cli, tmp_path):
    """Each ran and was ignored: --wgrad-fraction beside a cost file whose every layer gives
    its own wgrad, --plan-from-costs for a schedule whose order takes no times, --mem-cap
    1f1b turning --schedule zb-h2 into a plan labelled zb."""
    layer = {"fwd": 1.0, "bwd": 2.0, "wgrad": 0.8, "act": 10.0}
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"layers": [layer] * 4}))
    base = ("simulate", "--pp", 2, "-m", 4, "--costs", costs)
    code, _, err = run_cli(*base, "--split-backward", "--wgrad-fraction", 0.1)
    assert code == 2 and "--wgrad-fraction with --costs" in err, err
    code, _, err = run_cli(*base, "--schedule", "1f1b", "--plan-from-costs")
    assert code == 2 and "--plan-from-costs with --schedule 1f1b" in err, err
    code, _, err = run_cli(*base, "--schedule", "zb-h2", "--mem-cap", "1f1b")
    assert code == 2 and "--schedule zb-h2 is zb under --mem-cap zb-h2" in err, err
    code, _, err = run_cli(*base, "--split-backward", "--mem-cap", 1)
    assert code == 2 and "raise the cap (--mem-cap" in err and "micro-batches" not in err, err
    # what stays accepted: the same flags where they price something (a --mem-cap plan for
    # equal stages takes the fraction; a lowering orders messages by the costs' times)
    for extra in (
        ("--split-backward",),
        ("--plan-from-costs",),
        ("--schedule", "zb-h2"),
        ("--schedule", "zb", "--mem-cap", "zb-h2", "--wgrad-fraction", 0.1),
    ):
        code, _, err = run_cli(*base, *extra)
        assert code == 0, err
    lowered = ("plan", "--pp", 2, "-m", 4, "--costs", costs, "--schedule", "1f1b", "--lowered")
    code, _, err = run_cli(*lowered, "--plan-from-costs")
    assert code == 0, err


def test_mem_cap_takes_bytes_as_every_byte_flag_does():
    """``--mem-cap 1GiB`` was refused ("must be ... a number of bytes"), while ``--budget``
    and ``--memory-budget`` take units; the two spellings give the same cap."""
    from megatron_prt.cli.main import mem_cap

    assert mem_cap("1GiB") == mem_cap(str(2**30)) == 2**30
    assert mem_cap("zb-h2") == "zb-h2"
