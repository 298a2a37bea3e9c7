"""Split backward against docs/theory.md, section 8 (uniform stages, F = I = W, no comm).

Per-stage times f = i = w = 1: the whole model's forward is D, its backward 2D."""

import itertools
import pathlib
import re

import pytest

from megatron_prt.core import Placement, Plan, StageTimes, build_plan
from megatron_prt.core.actions import Action, Op
from megatron_prt.core.zerobubble import split_lower_bound
from megatron_prt.sim.cost import CostModel
from megatron_prt.sim.simulate import simulate
from megatron_prt.sim.split_backward import markdown_table, target_row, target_rows

DOC = pathlib.Path(__file__).parent.parent / "docs" / "theory.md"


def sim(placement, m, schedule="zb"):
    d = placement.depth
    cost = CostModel(fwd_time=d, bwd_time=2.0 * d, wgrad_fraction=0.5, activation_bytes=1.0)
    return simulate(build_plan(placement, m, schedule), cost), cost


def bound(placement, m):
    plan = build_plan(placement, m, "zb")
    return split_lower_bound(placement, plan.mb_pipeline, StageTimes.uniform(placement.depth))


def one_f_one_b_split(placement: Placement, m: int) -> Plan:
    """1F1B with every B replaced by I then W at once (not from our generator)."""
    ranks = tuple(
        tuple(
            x
            for a in acts
            for x in (
                (a,) if a.op is Op.F else (Action(a.stage, Op.I, a.mb), Action(a.stage, Op.W, a.mb))
            )
        )
        for acts in build_plan(placement, m, "1f1b").ranks
    )
    return Plan(placement, m, ranks, "custom")


@pytest.mark.parametrize("p, m", list(itertools.product(range(1, 7), range(1, 10))))
def test_nothing_beats_the_split_bound(p, m):
    """Section 8.1: the generator and a hand-built 1F1B-with-split are never below it. That
    1F1B loses w per stage of its drain (an upstream I no longer waits for a W): (P-1)(f+i)."""
    config = Placement(p)
    b = bound(config, m)
    assert sim(config, m)[0].makespan >= b - 1e-9
    res = simulate(one_f_one_b_split(config, m), CostModel(fwd_time=p, bwd_time=2.0 * p))
    assert res.makespan >= b - 1e-9
    assert res.makespan == pytest.approx(3 * m + 2 * (p - 1))


@pytest.mark.parametrize("p", range(2, 9))
def test_r1_matches_zb_h1(p):
    """R = 1 uni, m >= P: T = 3m + P - 1, ZB-H1's bubble (P-1)/(3m+P-1), at 1F1B's memory."""
    for m in (p, 2 * p, 3 * p, 4 * p):
        res, _ = sim(Placement(p), m)
        assert res.makespan == pytest.approx(3 * m + p - 1)
        assert res.bubble_fraction == pytest.approx((p - 1) / (3 * m + p - 1))
        assert max(r.peak_activation_bytes for r in res.per_rank) <= 1.0 + 1e-9


@pytest.mark.parametrize("p", range(2, 9))
def test_wave_r2_matches_zb_v(p):
    """Wave R = 2 uni (ZB-V's V shape) reaches the bound (P-1)/(6m + P-1), 1F1B's memory."""
    for m in (p, 2 * p, 3 * p, 4 * p):
        res, _ = sim(Placement(p, 2, "wave"), m)
        assert res.makespan == pytest.approx(bound(Placement(p, 2, "wave"), m))
        assert res.bubble_fraction == pytest.approx((p - 1) / (6 * m + p - 1))
        assert max(r.peak_activation_bytes for r in res.per_rank) <= 1.0 + 1e-9


@pytest.mark.parametrize("p, r", list(itertools.product((2, 3, 4, 6, 8), (1, 2, 3))))
def test_uni_and_even_bi_reach_the_bound(p, r):
    """Section 8.4: uni (loop and wave) and bi with even P at m in {P, 2P, 3P, 4P}."""
    for placement, m in itertools.product(("loop", "wave"), (p, 2 * p, 3 * p, 4 * p)):
        config = Placement(p, r, placement)
        assert sim(config, m)[0].makespan == pytest.approx(3 * r * m + p - 1)
        assert bound(config, m) == pytest.approx(3 * r * m + p - 1)
    if p % 2:
        return
    for placement, m in itertools.product(("loop", "wave"), (p, 2 * p, 3 * p, 4 * p)):
        config = Placement(p, r, placement, "bi")
        h = (p - 1) // 2
        assert sim(config, m)[0].makespan == pytest.approx(3 * r * m + h)


@pytest.mark.parametrize("p, k", list(itertools.product((4, 8), (3, 4))))
def test_bubble_target_at_1f1b_memory(p, k):
    """At m >= 3P the best split-backward configuration idles <= 3%, at or under 1F1B's
    peak activation memory (whole model: F = 1, I = W = 1)."""
    row = target_row(p, k * p)
    assert row.best[0] <= 0.03 and row.best_uni[0] <= 0.03
    assert max(row.best[1], row.best_uni[1]) <= row.one_f_one_b[1] + 1e-9
    assert row.best[0] == pytest.approx(row.best_bound)


def test_the_docs_table_is_the_generated_one():
    text = DOC.read_text()
    found = re.search(
        r"<!-- split-backward table: begin -->\n(.*?)\n<!-- split-backward table: end -->",
        text,
        re.S,
    )
    assert found, "docs/theory.md lost its split-backward table markers"
    assert found.group(1) == markdown_table(target_rows()), (
        "regenerate with `python -m megatron_prt.sim.split_backward`"
    )


@pytest.mark.parametrize("p, k", list(itertools.product((2, 4, 6), (1, 2, 3))))
def test_as_fast_as_torchs_zero_bubble_orders_at_no_more_memory(p, k):
    """torch.distributed.pipelining's ZB1P (loop) and ZBV (V shape = our wave, R = 2), read
    into our IR and simulated by the same simulator: ours is no slower, holding no more."""
    pytest.importorskip("torch")
    from megatron_prt.runtime.peers import PEERS, PeerRefusedError, peer_plan

    m = k * p
    cost = CostModel(fwd_time=1.0, bwd_time=2.0, wgrad_fraction=0.5)
    for peer in (
        q for q in PEERS if q.name in ("ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble")
    ):
        try:
            theirs = peer_plan(peer, p, m, 2)
        except PeerRefusedError:  # torch's own limits (e.g. m and P)
            continue
        ours = build_plan(theirs.placement, m, "zb")
        mine, other = simulate(ours, cost), simulate(theirs, cost)
        assert mine.makespan <= other.makespan + 1e-9, peer.name
        peak = lambda res: max(r.peak_activation_bytes for r in res.per_rank)  # noqa: E731
        assert peak(mine) <= peak(other) + 1e-9, peer.name
