"""benchmarks/paper_scale.py: its FLOP/byte calculators agree with published model sizes,
and its --quick mode runs end to end with the rows the report promises (no timing is
checked: the numbers are simulator predictions, the benchmark's business, not a test's)."""

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "paper_scale.py"


def _load_bench():
    spec = importlib.util.spec_from_file_location("paper_scale", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while being built
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench():
    return _load_bench()


@pytest.fixture(scope="module")
def quick_report(bench, tmp_path_factory):
    out = tmp_path_factory.mktemp("paper_scale") / "paper_scale.md"
    assert bench.main(["--quick", "--jobs", "1", "--out", str(out)]) == 0
    return out.read_text()


@pytest.mark.parametrize(
    ("depth", "params", "gmacs"),
    # torchvision's published figures for resnet50/101/152 (IMAGENET1K weights tables)
    [(50, 25_557_032, 4.09), (101, 44_549_160, 7.80), (152, 60_192_808, 11.51)],
)
def test_resnet_calculator_matches_torchvision(bench, depth, params, gmacs):
    model = bench.resnet(depth, efficiency=1.0, batch=1)
    assert model.params == params
    macs = sum(u.fwd_flops for u in model.units) / 2
    assert macs / 1e9 == pytest.approx(gmacs, abs=0.01)
    assert len(model.layers) == sum(bench.RESNET_BLOCKS[depth])


def test_bert_calculator_matches_bert_base(bench):
    """bert-base-uncased's encoder + embeddings + pooler hold 109,482,240 parameters."""
    model = bench.bert("BERT-base", bench.BERT_BASE, efficiency=1.0)
    classifier_only = bench.BERT_BASE.hidden * bench.BERT_BASE.classes + bench.BERT_BASE.classes
    assert model.params - classifier_only == 109_482_240


def test_bert_layer_formulas(bench):
    """Narayanan et al.'s FLOPs and Korthikanti et al.'s activation bytes, by hand."""
    c = bench.BertShape(layers=1, hidden=64, heads=4, seq=32, batch=2)
    assert bench.bert_layer_flops(c) == 24 * 2 * 32 * 64**2 + 4 * 2 * 32**2 * 64
    assert bench.bert_layer_act_bytes(c) == 32 * 2 * 64 * (34 + 5 * 4 * 32 / 64)


def test_efficiencies_are_fractions_of_peak(bench):
    for calibration in (bench.bert_calibration(), bench.resnet_calibration()):
        assert 0.05 < calibration.efficiency < 0.6


def test_cut_messages_follow_the_partition(bench):
    """A cut sends the output of the last unit before it; an empty stage passes it on."""
    model = bench.models()["ResNet-50"]
    cuts = bench.cut_bytes(model, (0, 3, 0, 13))
    assert cuts == [
        model.embedding.out_bytes,
        model.layers[2].out_bytes,
        model.layers[2].out_bytes,
    ]
    assert model.layers[2].out_bytes == 8 * model.layers[-1].out_bytes  # 256x56² vs 2048x7²


def test_closed_form_reuse_inverts_the_uni_formula(bench):
    m, p, r = 8, 8, 4
    gain = ((m + p - 1) / m) / ((r * m + p - 1) / (r * m)) - 1
    assert bench.closed_form_reuse(gain, m, p) == pytest.approx(r)
    assert bench.closed_form_reuse(10.0, m, p) == float("inf")


def test_crossings_interpolate_in_log_m(bench):
    gains = {2: 0.0, 8: 0.5, 32: 0.1}
    low, high = bench.crossings(gains, 0.25)
    assert 2 < low < 8 < high < 32
    assert bench.matching_m(gains, 0.9).startswith("never (largest +50.0%, at m = 8)")


def test_quick_report_has_every_row(bench, quick_report):
    assert "--quick --jobs 1" in quick_report
    for name in bench.models():
        for direction in ("uni", "bi"):
            assert f"| {name} | {direction} | " in quick_report  # paper comparison
        assert f"| {name} | 8 | 1F1B | " in quick_report
        assert f"| {name} | 8 | Chimera-style bi R=1 | " in quick_report
        assert quick_report.count(f"| {name} | 8 | PRT R=") == 2  # best uni, best bi
    for family in ("BERT", "ResNet"):
        assert f"| uniform stages (vs {family}) | uni | " in quick_report
    for paper in ("+54.78%", "+30.38%", "+76.59%", "+26.45%"):
        assert paper in quick_report
    assert "## Summary" in quick_report and "## Assumptions" in quick_report


def test_quick_closed_form_row_matches_theory(quick_report):
    """At m = P = 8, R = 4, equal stages and free communication PRT loop/uni meets
    docs/theory.md: T = (Rm + P - 1)(f + b) against 1F1B's (m + P - 1)(f + b)."""
    expected = (15 / 8) / (39 / 32) - 1
    prefix = "| uniform stages (vs BERT) | uni"
    row = next(line for line in quick_report.splitlines() if line.startswith(prefix))
    assert f"{expected:+.1%}" in row


# -- the H200 section: committed profiles, per-layer costs in ms, the replica-gradient sum --------
@pytest.mark.parametrize("name", ["BERT-base (H200)", "BERT-large (H200)"])
def test_h200_profiles_load_in_ms_with_fp32_grads(bench, name):
    import json

    profile = bench.PROFILES[name]
    raw = json.loads((bench.REPO / profile.path).read_text())
    cost = bench.profiled(name)
    assert len(cost.layers) == profile.shape.layers == len(raw["layers"])
    for part, data in [*zip(cost.layers, raw["layers"], strict=True), (cost.head, raw["head"])]:
        assert part.fwd == pytest.approx(1e3 * data["fwd"])  # seconds -> ms
        assert part.bwd == pytest.approx(1e3 * data["bwd"])
        assert part.grad == pytest.approx(part.param * 4 / 18)  # fp32 main_grad of 18 B/param
    # the profile's param is 18 bytes per parameter: bf16 weight + fp32 grad, master, 2 moments
    assert bench.state_bytes_per_param(name) == pytest.approx(18)


def test_missing_h200_profile_fails_clearly(bench, monkeypatch, tmp_path):
    monkeypatch.setattr(bench, "REPO", tmp_path)
    bench.profiled.cache_clear()
    try:
        with pytest.raises(FileNotFoundError, match="megatron-prt profile --model bert"):
            bench.profiled("BERT-base (H200)")
    finally:
        monkeypatch.undo()
        bench.profiled.cache_clear()


def test_bi_job_gives_the_replica_sum_with_and_without(bench):
    """A bi job that pays the sum also reports the same plans without it; uni has no sum."""
    chimera = next(v for v in bench.baselines() if v.direction == "bi")
    job = bench.Job("BERT-base (H200)", "pcie5", 8, chimera, True)
    (paid_job, paid), (free_job, free) = bench.run_job(job)
    assert paid_job == job and free_job.replica_sum is False
    assert paid.replica_ms > 0 and free.replica_ms == 0
    assert paid.ms == pytest.approx(free.ms + paid.replica_ms, rel=0.05)
    uni = bench.Job("BERT-base (H200)", "pcie5", 8, bench.baselines()[0], True)
    assert [j for j, _ in bench.run_job(uni)] == [uni]


def test_quick_report_has_every_h200_row(bench, quick_report):
    assert "## BERT with per-layer costs profiled on an H200" in quick_report
    even_rows = quick_report.split("### Balanced splits")[0]
    for name, profile in bench.PROFILES.items():
        assert profile.path in quick_report
        assert f"| {name} | 8 | 1F1B | " in even_rows
        assert f"| {name} | 8 | Chimera-style bi R=1 | " in even_rows
        assert even_rows.count(f"| {name} | 8 | PRT R=") == 2  # best uni, best bi
        assert f"| {name} | nvlink4 | 8 | " in quick_report  # with/without the replica sum
        for direction in ("uni", "bi"):  # beside the V100 FLOP model and the paper
            target = bench.PAPER_GAINS[("BERT", direction)]
            assert quick_report.count(f"| {profile.v100} | {direction} | {target:+.2%} | ") == 2


# -- balanced splits: the partitioner's fastest split for 1F1B and PRT uni (H200 section) ---------
@pytest.fixture(scope="module")
def balanced(bench):
    """--quick's settings; the outcomes of the H200 jobs that get a balanced split, on the
    even and on the balanced split."""
    s = bench.settings_of(bench.parse_args(["--quick"]))
    variants = bench.balanced_variants(s.reuses)
    jobs = [j for j in bench.h200_jobs(s) if j.variant in variants]
    return s, bench.keep_faster_split(bench.Results(bench.run_all(jobs, 1)))


def _balanced_jobs(bench, s):
    for name in s.h200_names:
        for m in s.microbatches:
            for v in bench.balanced_variants(s.reuses):
                yield bench.Job(name, bench.H200_MAIN_LINK, m, v, True, "balanced")


def test_balanced_rows_exist_for_1f1b_and_every_prt_uni_variant(bench, balanced):
    s, results = balanced
    variants = bench.balanced_variants(s.reuses)
    assert variants[0].schedule == "1f1b"
    assert {v.direction for v in variants} == {"uni"}
    assert len(variants) == 1 + len(s.reuses) * len(bench.PLACEMENTS)
    for job in _balanced_jobs(bench, s):
        assert job in results


def test_balanced_stage_layers_cover_every_layer(bench, balanced):
    s, results = balanced
    for job in _balanced_jobs(bench, s):
        layers = results[job].stage_layers
        assert len(layers) == job.variant.placement.depth
        assert sum(layers) == len(bench.profiled(job.model).layers)
        assert min(layers) >= 0
        assert results[job].search  # how the split was found is reported


def test_balanced_split_is_never_slower_than_the_even_one(bench, balanced):
    """The partitioner searches a superset of the even split (and a row keeps the even
    split if its cost-aware plan beats the pick): a balanced row is never slower."""
    from dataclasses import replace

    s, results = balanced
    for job in _balanced_jobs(bench, s):
        even = results[replace(job, partition="even")]
        assert results[job].ms <= even.ms * (1 + 1e-9)
        assert even.stage_layers == bench.uniform_layers(
            len(bench.profiled(job.model).layers), job.variant.placement.depth
        )


def test_keep_faster_split_falls_back_to_the_even_split(bench):
    """A balanced outcome slower than the even one is replaced by it, and says so."""
    from dataclasses import replace

    v = bench.baselines()[0]
    even_job = bench.Job("BERT-base (H200)", "nvlink4", 8, v, True)
    bal_job = replace(even_job, partition="balanced")
    even = bench.Outcome(even_job, 10.0, 0.1, 1.0, 1.0, 0.0, 0, "textbook", 10.0, 0.0, (2, 1))
    slow = replace(even, job=bal_job, ms=11.0, stage_layers=(1, 2), search="exact")
    kept = bench.keep_faster_split(bench.Results({even_job: even, bal_job: slow}))
    assert kept[bal_job].ms == 10.0 and kept[bal_job].stage_layers == (2, 1)
    assert kept[bal_job].job == bal_job and kept[bal_job].search.startswith("even split kept")
    fast = replace(slow, ms=9.0)
    assert bench.keep_faster_split(bench.Results({even_job: even, bal_job: fast}))[bal_job] == fast


def test_even_rows_ignore_the_balanced_ones(bench, balanced):
    """compare() on the default (even) split sees no balanced outcome, and vice versa."""
    s, results = balanced
    name, m = s.h200_names[0], s.microbatches[0]
    for split in ("even", "balanced"):
        c = results.compare(name, bench.H200_MAIN_LINK, m, "uni", True, split)
        assert {o.job.partition for o in (c.baseline, c.best, *c.candidates)} == {split}


def test_quick_report_has_the_balanced_section(bench, quick_report):
    section = quick_report.split("### Balanced splits")[1].split("### ")[0]
    assert "budget_bytes=" in section
    for name in bench.PROFILES:
        assert f"| {name} | 8 | 1F1B | " in section
        assert section.count(f"| {name} | 8 | PRT R=") == 4  # R in {2, 4} x loop, wave
        assert f"| {name} | 8 | " in section.split("| model | m | schedule |")[0]  # gains
