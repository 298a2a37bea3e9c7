"""The simulator against the closed forms of docs/theory.md (uniform stages, no comm).

Per-stage forward time f, backward b (chunk level: the whole model's forward is D*f).
"""

import itertools
import math

import pytest

from megatron_prt.core import Placement, StageTimes, build_plan
from megatron_prt.core.schedules import makespan_lower_bound
from megatron_prt.sim.cost import CostModel
from megatron_prt.sim.simulate import simulate


def sim(placement, m, schedule="prt", fwd=1.0, bwd=2.0):
    d = placement.depth
    cost = CostModel(fwd_time=fwd * d, bwd_time=bwd * d, activation_bytes=float(d))
    plan = build_plan(placement, m, schedule, cost.stage_times(placement))
    return simulate(plan, cost)


GRID = list(itertools.product(range(1, 7), range(1, 13)))


@pytest.mark.parametrize("p, m", GRID)
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_one_stage_per_rank_bubble(p, m, schedule):
    """(P-1)/(m+P-1) for 1F1B and GPipe, any m (section 2)."""
    res = sim(Placement(p), m, schedule)
    assert res.makespan == pytest.approx((m + p - 1) * 3.0)
    assert res.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize("p, m", GRID)
def test_one_stage_per_rank_memory(p, m):
    """1F1B: rank r holds min(m, P-r) activations; GPipe holds all m (section 2)."""
    one_f = sim(Placement(p), m, "1f1b")
    assert [r.peak_inflight for r in one_f.per_rank] == [min(m, p - r) for r in range(p)]
    gpipe = sim(Placement(p), m, "gpipe")
    assert [r.peak_inflight for r in gpipe.per_rank] == [m] * p


@pytest.mark.parametrize("p, r, k", list(itertools.product(range(2, 7), range(2, 5), (1, 2, 3))))
def test_interleaved_bubble_and_memory(p, r, k):
    """Megatron's order, m = kP: bubble (P-1)/(Rm+P-1); rank q holds
    min(Rm, 2(P-q-1) + (R-1)P + 1) chunk activations (section 3)."""
    m = k * p
    res = sim(Placement(p, r), m, "interleaved")
    assert res.bubble_fraction == pytest.approx((p - 1) / (r * m + p - 1))
    expect = [min(r * m, 2 * (p - q - 1) + (r - 1) * p + 1) for q in range(p)]
    assert [s.peak_inflight for s in res.per_rank] == expect


@pytest.mark.parametrize("p, r", list(itertools.product(range(1, 9), range(1, 7))))
def test_prt_loop_meets_interleaved_bound(p, r):
    """PRT loop/uni, m a multiple of P: bubble <= (P-1)/(Rm+P-1), the bound, holding no more
    activations on any rank than megatron-core's order (section 3)."""
    for m in (p, 2 * p, 4 * p):
        res = sim(Placement(p, r), m)
        assert res.bubble_fraction <= (p - 1) / (r * m + p - 1) + 1e-12
        if r > 1 and p > 1:
            megatron = sim(Placement(p, r), m, "interleaved")
            for ours, theirs in zip(res.per_rank, megatron.per_rank, strict=True):
                assert ours.peak_inflight <= theirs.peak_inflight


@pytest.mark.parametrize("p, r", list(itertools.product(range(1, 7), range(1, 5))))
def test_prt_loop_any_m_is_close_to_the_bound(p, r):
    """Where megatron-core refuses (m not a multiple of P) PRT still runs, within 2%."""
    for m in range(p, 3 * p + 1):
        res = sim(Placement(p, r), m)
        assert res.makespan <= (r * m + p - 1) * 3.0 * 1.02


@pytest.mark.parametrize(
    "placement, direction",
    list(itertools.product(["loop", "wave"], ["uni", "bi"])),
)
def test_no_schedule_beats_the_lower_bound(placement, direction):
    """Section 1's bound holds for every simulated plan, and equals the closed form
    H / (Rm + H), H = P-1 (uni) or floor((P-1)/2) (bi), for uniform stages."""
    for p, r, m in itertools.product(range(1, 7), range(1, 4), (2, 3, 5, 8)):
        pl = Placement(p, r, placement, direction)
        res = sim(pl, m)
        times = StageTimes.uniform(pl.depth)
        bound = makespan_lower_bound(pl, res.plan.mb_pipeline, times)
        h = (p - 1) if direction == "uni" else (p - 1) // 2
        assert bound == pytest.approx((r * m + h) * 3.0)
        assert res.makespan >= bound - 1e-9


@pytest.mark.parametrize("p", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("placement", ["loop", "wave"])
def test_bi_reaches_its_bound_from_two_rounds(p, placement):
    """bi, m = 2P or 4P: bubble H/(Rm+H) with H = floor((P-1)/2); R=1 is Chimera's
    (P/2-1)/(m+P/2-1) for even P (section 4)."""
    h = (p - 1) // 2
    for r, m in itertools.product((1, 2, 4), (2 * p, 4 * p)):
        res = sim(Placement(p, r, placement, "bi"), m)
        assert res.bubble_fraction == pytest.approx(h / (r * m + h))


@pytest.mark.parametrize("p", [2, 3, 4, 6, 8])
def test_wave_reaches_the_bound_with_enough_micro_batches(p):
    """wave/uni: the bound (P-1)/(Rm+P-1) from m = 2P at R <= 2 and within 1% from
    m = 3P at R <= 4; below that the far turn starves (section 5)."""
    for r in (1, 2):
        res = sim(Placement(p, r, "wave"), 2 * p)
        assert res.bubble_fraction == pytest.approx((p - 1) / (r * 2 * p + p - 1))
    for r in (3, 4):
        res = sim(Placement(p, r, "wave"), 3 * p)
        assert res.makespan <= (r * 3 * p + p - 1) * 3.0 * 1.01


def test_design_example_54_percent():
    """DESIGN.md: m = P = 8, R = 4 predicts about +54% over 1F1B."""
    model = CostModel(fwd_time=1.0, bwd_time=2.0)  # the same model, split 8 or 32 ways
    base = simulate(build_plan(Placement(8), 8, "1f1b"), model).makespan
    prt = simulate(build_plan(Placement(8, 4), 8), model).makespan
    assert base / prt == pytest.approx(((8 + 7) / 8) / ((4 * 8 + 7) / 32), rel=1e-12)
    assert math.isclose(base / prt, 1.538, rel_tol=1e-3)
