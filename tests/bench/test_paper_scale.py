"""The analytic cost source (megatron_prt.sim.analytic): its FLOP/byte calculators agree
with published model sizes; the paper_scale benchmark (megatron_prt.bench.paper_scale, run
by benchmarks/paper_scale.py): its --quick mode runs end to end with the rows the report
promises (no timing is checked: the numbers are simulator predictions, the benchmark's
business, not a test's)."""

import dataclasses
from dataclasses import replace

import pytest

from megatron_prt.bench import paper_scale
from megatron_prt.bench.paper_scale import jobs, profiles, prose, zb
from megatron_prt.bench.paper_scale.split import TORCH
from megatron_prt.core import Placement
from megatron_prt.runtime import peers
from megatron_prt.sim import analytic
from megatron_prt.tune import partition


def _quick(tmp_path_factory, *flags: str) -> str:
    out = tmp_path_factory.mktemp("paper_scale") / "paper_scale.md"
    assert paper_scale.main(["--quick", "--jobs", "1", *flags, "--out", str(out)]) == 0
    return out.read_text()


@pytest.fixture(scope="module")
def quick_report(tmp_path_factory):
    """Every row but the tuned ones: the tuner's paper-scale searches are most of the quick
    report's time (about 85%); the tuned-row rule is checked at a small scale in
    tests/tune/test_tune_rows.py, and on the whole report by the slow test below."""
    return _quick(tmp_path_factory, "--no-tune")


@pytest.fixture(scope="module")
def tuned_quick_report(tmp_path_factory):
    return _quick(tmp_path_factory)


@pytest.mark.parametrize(
    ("depth", "params", "gmacs"),
    # torchvision's published figures for resnet50/101/152 (IMAGENET1K weights tables)
    [(50, 25_557_032, 4.09), (101, 44_549_160, 7.80), (152, 60_192_808, 11.51)],
)
def test_resnet_calculator_matches_torchvision(depth, params, gmacs):
    model = analytic.resnet(depth, efficiency=1.0, batch=1)
    assert model.params == params
    macs = sum(u.fwd_flops for u in model.units) / 2
    assert macs / 1e9 == pytest.approx(gmacs, abs=0.01)
    assert len(model.layers) == sum(analytic.RESNET_BLOCKS[depth])


def test_bert_calculator_matches_bert_base():
    """bert-base-uncased's encoder + embeddings + pooler hold 109,482,240 parameters."""
    model = analytic.bert("BERT-base", analytic.BERT_BASE, efficiency=1.0)
    classifier_only = (
        analytic.BERT_BASE.hidden * analytic.BERT_BASE.classes + analytic.BERT_BASE.classes
    )
    assert model.params - classifier_only == 109_482_240


def test_bert_layer_formulas():
    """Narayanan et al.'s FLOPs and Korthikanti et al.'s activation bytes, by hand."""
    c = analytic.BertShape(layers=1, hidden=64, heads=4, seq=32, batch=2)
    assert analytic.bert_layer_flops(c) == 24 * 2 * 32 * 64**2 + 4 * 2 * 32**2 * 64
    assert analytic.bert_layer_act_bytes(c) == 32 * 2 * 64 * (34 + 5 * 4 * 32 / 64)


def test_efficiencies_are_fractions_of_peak():
    for calibration in (analytic.bert_calibration(), analytic.resnet_calibration()):
        assert 0.05 < calibration.efficiency < 0.6


def test_cut_messages_follow_the_partition():
    """A cut sends the output of the last unit before it; an empty stage passes it on; the
    simulator prices each cut on its own message."""
    model = analytic.models()["ResNet-50"]
    cost = analytic.cost_model(model, Placement(4, 1), analytic.LINKS["pcie"])
    cost = replace(cost, stage_layers=(0, 3, 0, 13))
    cuts = cost.cut_message_bytes(cost.stage_layers)
    assert cuts == (
        model.embedding.out_bytes,
        model.layers[2].out_bytes,
        model.layers[2].out_bytes,
    )
    assert model.layers[2].out_bytes == 8 * model.layers[-1].out_bytes  # 256x56² vs 2048x7²
    link = analytic.LINKS["pcie"]
    hops = cost.stage_times(Placement(4, 1)).p2p
    assert hops == tuple(1e3 * link.latency + size / (link.bandwidth / 1e3) for size in cuts)


def test_closed_form_reuse_inverts_the_uni_formula():
    m, p, r = 8, 8, 4
    gain = ((m + p - 1) / m) / ((r * m + p - 1) / (r * m)) - 1
    assert prose.closed_form_reuse(gain, m, p) == pytest.approx(r)
    assert prose.closed_form_reuse(10.0, m, p) == float("inf")


def test_crossings_interpolate_in_log_m():
    gains = {2: 0.0, 8: 0.5, 32: 0.1}
    low, high = jobs.crossings(gains, 0.25)
    assert 2 < low < 8 < high < 32
    assert jobs.matching_m(gains, 0.9).startswith("never (largest +50.0%, at m = 8)")


def test_quick_report_has_every_row(quick_report):
    assert "--quick --jobs 1 --no-tune" in quick_report
    for name in analytic.models():
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
def test_h200_profiles_load_in_ms_with_fp32_grads(name):
    import json

    profile = profiles.PROFILES[name]
    raw = json.loads((profiles.REPO / profile.path).read_text())
    cost = profiles.profiled(name)
    assert len(cost.layers) == profile.shape.layers == len(raw["layers"])
    for part, data in [*zip(cost.layers, raw["layers"], strict=True), (cost.head, raw["head"])]:
        assert part.fwd == pytest.approx(1e3 * data["fwd"])  # seconds -> ms
        assert part.bwd == pytest.approx(1e3 * data["bwd"])
        assert part.grad == pytest.approx(part.param * 4 / 18)  # fp32 main_grad of 18 B/param
    # the profile's param is 18 bytes per parameter: bf16 weight + fp32 grad, master, 2 moments
    assert profiles.state_bytes_per_param(name) == pytest.approx(18)


def test_missing_h200_profile_fails_clearly(monkeypatch, tmp_path):
    monkeypatch.setattr(profiles, "REPO", tmp_path)
    profiles.profiled.cache_clear()
    try:
        with pytest.raises(FileNotFoundError, match="megatron-prt profile --model bert"):
            profiles.profiled("BERT-base (H200)")
    finally:
        monkeypatch.undo()
        profiles.profiled.cache_clear()


def test_bi_job_gives_the_replica_sum_with_and_without():
    """A bi job that pays the sum also reports the same plans without it; uni has no sum."""
    chimera = next(v for v in jobs.baselines() if v.direction == "bi")
    job = jobs.Job("BERT-base (H200)", "pcie5", 8, chimera, True)
    (paid_job, paid), (free_job, free) = jobs.run_job(job)
    assert paid_job == job and free_job.replica_sum is False
    assert paid.replica_ms > 0 and free.replica_ms == 0
    assert paid.ms == pytest.approx(free.ms + paid.replica_ms, rel=0.05)
    uni = jobs.Job("BERT-base (H200)", "pcie5", 8, jobs.baselines()[0], True)
    assert [j for j, _ in jobs.run_job(uni)] == [uni]


def test_quick_report_has_every_h200_row(quick_report):
    assert "## BERT with per-layer costs profiled on an H200" in quick_report
    even_rows = quick_report.split("### Balanced splits")[0]
    for name, profile in profiles.PROFILES.items():
        assert profile.path in quick_report
        assert f"| {name} | 8 | 1F1B | " in even_rows
        assert f"| {name} | 8 | Chimera-style bi R=1 | " in even_rows
        assert even_rows.count(f"| {name} | 8 | PRT R=") == 2  # best uni, best bi
        assert f"| {name} | nvlink4 | 8 | " in quick_report  # with/without the replica sum
        for direction in ("uni", "bi"):  # beside the V100 FLOP model and the paper
            target = jobs.PAPER_GAINS[("BERT", direction)]
            assert quick_report.count(f"| {profile.v100} | {direction} | {target:+.2%} | ") == 2


# -- balanced splits: the partitioner's fastest split for 1F1B and PRT uni (H200 section) ---------
@pytest.fixture(scope="module")
def balanced():
    """--quick's settings for one H200 profile (the quick report holds both); the outcomes
    of the H200 jobs that get a balanced split, on the even and on the balanced split."""
    quick = jobs.settings_of(paper_scale.parse_args(["--quick"]))
    s = dataclasses.replace(quick, h200_names=quick.h200_names[:1])
    variants = jobs.balanced_variants(s.reuses)
    balanced_jobs = [j for j in jobs.h200_jobs(s) if j.variant in variants]
    return s, jobs.keep_faster_split(jobs.Results(jobs.run_all(balanced_jobs, 1)))


def _balanced_jobs(s):
    for name in s.h200_names:
        for m in s.microbatches:
            for v in jobs.balanced_variants(s.reuses):
                yield jobs.Job(name, jobs.H200_MAIN_LINK, m, v, True, "balanced")


def test_balanced_rows_exist_for_1f1b_and_every_prt_uni_variant(balanced):
    s, results = balanced
    variants = jobs.balanced_variants(s.reuses)
    assert variants[0].schedule == "1f1b"
    assert {v.direction for v in variants} == {"uni"}
    assert len(variants) == 1 + len(s.reuses) * len(jobs.PLACEMENTS)
    for job in _balanced_jobs(s):
        assert job in results


def test_balanced_stage_layers_cover_every_layer(balanced):
    s, results = balanced
    for job in _balanced_jobs(s):
        layers = results[job].stage_layers
        assert len(layers) == job.variant.placement.depth
        assert sum(layers) == len(profiles.profiled(job.model).layers)
        assert min(layers) >= 0
        assert results[job].search  # how the split was found is reported


def test_balanced_split_is_never_slower_than_the_even_one(balanced):
    """The partitioner searches a superset of the even split (and a row keeps the even
    split if its cost-aware plan beats the pick): a balanced row is never slower."""
    from dataclasses import replace

    s, results = balanced
    for job in _balanced_jobs(s):
        even = results[replace(job, partition="even")]
        assert results[job].ms <= even.ms * (1 + 1e-9)
        assert even.stage_layers == partition.uniform_layers(
            len(profiles.profiled(job.model).layers), job.variant.placement.depth
        )


def test_keep_faster_split_falls_back_to_the_even_split():
    """A balanced outcome slower than the even one is replaced by it, and says so."""
    from dataclasses import replace

    v = jobs.baselines()[0]
    even_job = jobs.Job("BERT-base (H200)", "nvlink4", 8, v, True)
    bal_job = replace(even_job, partition="balanced")
    even = jobs.Outcome(even_job, 10.0, 0.1, 1.0, 1.0, 0.0, 0, "textbook", 10.0, 0.0, (2, 1))
    slow = replace(even, job=bal_job, ms=11.0, stage_layers=(1, 2), search="exact")
    kept = jobs.keep_faster_split(jobs.Results({even_job: even, bal_job: slow}))
    assert kept[bal_job].ms == 10.0 and kept[bal_job].stage_layers == (2, 1)
    assert kept[bal_job].job == bal_job and kept[bal_job].search.startswith("even split kept")
    fast = replace(slow, ms=9.0)
    assert jobs.keep_faster_split(jobs.Results({even_job: even, bal_job: fast}))[bal_job] == fast


def test_even_rows_ignore_the_balanced_ones(balanced):
    """compare() on the default (even) split sees no balanced outcome, and vice versa."""
    s, results = balanced
    name, m = s.h200_names[0], s.microbatches[0]
    for split in ("even", "balanced"):
        c = results.compare(name, jobs.H200_MAIN_LINK, m, "uni", True, split)
        assert {o.job.partition for o in (c.baseline, c.best, *c.candidates)} == {split}


def test_quick_report_has_the_balanced_section(quick_report):
    section = quick_report.split("### Balanced splits")[1].split("### ")[0]
    assert "budget_bytes=" in section
    for name in profiles.PROFILES:
        assert f"| {name} | 8 | 1F1B | " in section
        assert section.count(f"| {name} | 8 | PRT R=") == 4  # R in {2, 4} x loop, wave
        assert f"| {name} | 8 | " in section.split("| model | m | schedule |")[0]  # gains


@pytest.mark.parametrize("name", ["BERT-large", "ResNet-50"])
def test_analytic_costs_are_a_cost_file(name):
    """The analytic source gives what a cost JSON gives: written and read back as one it is
    the same CostModel, split evenly over the stages as the runtime splits the layers."""
    import json

    from megatron_prt.core import Placement
    from megatron_prt.sim.cost import CostModel

    placement = Placement(8, 2, "wave")
    model = analytic.models()[name]
    cost = analytic.cost_model(model, placement, analytic.LINKS["nvlink"])
    assert CostModel.from_dict(json.loads(json.dumps(cost.to_dict()))) == cost
    assert cost.stage_layers == partition.uniform_layers(len(model.layers), placement.depth)
    assert cost.message_bytes > 0 and cost.p2p_bandwidth == 25e9 / 1e3  # bytes per ms


# -- split backward (zero bubble) and torch's schedules -------------------------------------------
@pytest.fixture(scope="module")
def split_rows():
    """BERT-base on NVLink at m = 8, R = 2: every non-split row, every split-backward and
    torch row (raw, and after :func:`zb.keep_non_split`)."""
    s = jobs.Settings(("BERT-base",), (8,), (8,), (2,), (), 8, h200_names=(), h200_links=())
    base = [jobs.Job("BERT-base", jobs.MAIN_LINK, 8, v) for v in jobs.all_variants(s.reuses)]
    plain = jobs.Results(jobs.run_all(base, 1))
    raw = jobs.Results({**plain, **jobs.run_all(zb.split_jobs(base, s), 1)})
    return s, raw, zb.keep_non_split(raw)


def _role(results, role):
    return [o for j, o in results.items() if j.variant.role == role]


def test_split_rows_exist_for_every_placement_and_torch_schedule(split_rows):
    _, raw, _ = split_rows
    labels = {o.job.variant.label for o in _role(raw, "zb")}
    assert labels == {"ZB-H1", "ZB bi R=1"} | {
        f"ZB R=2 {pl}/{d}" for pl in ("loop", "wave") for d in ("uni", "bi")
    }
    torch_rows = {o.job.variant.schedule for o in _role(raw, "peer")}
    assert torch_rows == {TORCH + p.name for p in peers.PEERS}


def test_split_row_is_never_slower_than_the_non_split_row_of_its_placement(split_rows):
    _, raw, kept = split_rows
    for o in _role(kept, "zb"):
        same = [
            x
            for x in kept.values()
            if x.job.variant.role in ("prt", "baseline", "reference")
            and x.job.variant.placement == o.job.variant.placement
        ]
        assert same and o.ms <= min(x.ms for x in same)
        assert o.ms <= raw[o.job].ms  # only ever replaced by a faster order


def test_zb_h1_beats_1f1b_under_its_memory(split_rows):
    """ZB-H1 fills 1F1B's bubbles with W under 1F1B's activation cap: faster, no more memory."""
    _, raw, _ = split_rows
    first = next(o for o in raw.values() if o.job.variant.label == "1F1B")
    h1 = next(o for o in raw.values() if o.job.variant.label == "ZB-H1")
    assert h1.plan == "split backward"
    assert h1.ms < first.ms and h1.busiest > first.busiest
    assert h1.peak_gib <= first.peak_gib * (1 + 1e-9)


def test_torch_1f1b_row_equals_ours(split_rows):
    _, raw, _ = split_rows
    ours = next(o for o in raw.values() if o.job.variant.label == "1F1B")
    torch_1f1b = next(o for o in raw.values() if o.job.variant.label == "torch 1F1B")
    assert torch_1f1b.ms == pytest.approx(ours.ms, rel=1e-12)
    assert torch_1f1b.peak_gib == pytest.approx(ours.peak_gib, rel=1e-12)


def test_busiest_rank_share_is_between_mean_share_and_one(split_rows):
    _, raw, _ = split_rows
    for o in raw.values():
        if o.plan.startswith("refused"):
            assert "torch" in o.plan and o.ms == float("inf")
            continue
        assert 1 - o.bubble - 1e-9 <= o.busiest <= 1 + 1e-9


def test_only_split_rows_get_the_wgrad_fraction():
    """The W share is set for split-backward and torch rows only: the other rows' costs (and
    numbers) are what they were."""
    for variant in (*jobs.all_variants((2,)), *zb.zb_variants((2,)), *zb.torch_variants((2,))):
        cost = jobs.job_cost(jobs.Job("BERT-large", jobs.MAIN_LINK, 8, variant))
        split_row = variant.role in jobs.SPLIT_ROLES
        assert cost.wgrad_fraction == (jobs.WGRAD_FRACTION if split_row else None)


def test_split_section_rows(split_rows):
    s, _, kept = split_rows
    text = "\n".join(zb.split_section(kept, s))
    assert "| BERT-base | 8 | ZB-H1 | " in text
    assert "| BERT-base | 8 | torch ZB1P R=2 | " in text
    assert "| BERT-base | nvlink | 8 | " in text  # the summary over models and m


def test_quick_report_has_the_split_section(quick_report):
    assert "## Split backward (zero bubble) and torch's schedules" in quick_report
    for name in (*analytic.models(), *profiles.PROFILES):
        assert f"| {name} | 8 | ZB-H1 | " in quick_report
        assert f"| {name} | 8 | torch 1F1B | " in quick_report


@pytest.mark.slow
def test_quick_report_tuned_row_is_never_slower(tuned_quick_report):
    """Every model and m of the split-backward tables has a tuned row, and it is at least as
    fast as the fastest other row of the same model, link and m (every split, every kind)."""
    table = tuned_quick_report.split("### Every model and m")[1].split("\n\n")[1].splitlines()
    header = [c.strip() for c in table[0].strip("|").split("|")]
    column = header.index("tuned vs fastest other row")
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in table[2:]]
    assert len(rows) == len(analytic.models()) + len(profiles.PROFILES)
    for row in rows:
        assert row[column].startswith("+"), row
    assert tuned_quick_report.count("| **tuned**: ") == len(rows)
