"""A split-backward run judged as it is made ([Note: judging a run as it is made]).

The judge's makespan must be the replay's, to the tick, for every run of the portfolio
under every planning time (each judged under the times plans are compared by); a run must
stop under a limit one tick below its replay and never under its replay itself, so no run
that could win or tie is cut short. ``test_zerobubble_runs`` checks the chosen plan against
running and replaying every policy. Stage times given as lists must plan as tuples do:
the judge's cache, like the F/B portfolio's, hashes them."""

import itertools
import math
from dataclasses import replace

import pytest

from megatron_prt.core import Placement
from megatron_prt.core.plan import Plan, split_microbatches
from megatron_prt.core.replay import replay
from megatron_prt.core.schedules import build_plan
from megatron_prt.core.timing import StageTimes
from megatron_prt.core.zbgraph import Judge
from megatron_prt.core.zerobubble import (
    ZBScheduler,
    _planning_times,
    _portfolio,
    resolve_mem_cap,
)
from megatron_prt.sim.cost import CostModel, LayerCost


def priced(placement: Placement, per_cut: bool = False):
    """Unequal stages (a heavier head), W apart, message latency and CPU; ``per_cut``:
    every other stage sends a 4x larger message over a finite link."""
    layer = LayerCost(fwd=1.0, bwd=2.1, act=96.0, wgrad=1.1, wact=96.0)
    sizes = (8.0, 2.0) if per_cut else (None, None)
    layers = [replace(layer, out_bytes=sizes[k % 4 // 2]) for k in range(2 * placement.depth)]
    head = LayerCost(fwd=1.5, bwd=2.9, act=160.0)
    cost = CostModel(
        layers=tuple(layers),
        head=head,
        p2p_latency=0.07,
        p2p_cpu=0.03,
        p2p_bandwidth=40.0 if per_cut else math.inf,
    )
    return (
        cost.stage_times(placement),
        cost.stage_activation_bytes(placement),
        cost.stage_wgrad_keep(placement),
    )


CASES = [
    (Placement(p, r, where, direction), m)
    for p, r, where, direction in itertools.product((2, 3), (1, 2), ("loop", "wave"), ("uni", "bi"))
    if r > 1 or where == "loop"
    for m in (p, 2 * p + 1)
]


def _runs(placement: Placement, m: int, per_cut: bool = False):
    """Every policy's scheduler under every planning time, with the judge of ``times``."""
    times, act, keep = priced(placement, per_cut)
    mb_pipeline = split_microbatches(m, placement.num_pipelines)
    cap = resolve_mem_cap("zb-h2", placement, m, act)
    judge = Judge.of(placement, tuple(mb_pipeline), times)
    for planning in _planning_times(placement, times):
        for policy in _portfolio(placement, planning):
            args = (placement, mb_pipeline, planning, act, keep, cap, policy)
            yield times, mb_pipeline, judge, lambda args=args: ZBScheduler(*args, judge)


@pytest.mark.parametrize("per_cut", [False, True], ids=["one hop", "a hop per cut"])
@pytest.mark.parametrize("placement, m", CASES, ids=str)
def test_the_judge_replays_each_run_to_the_tick(placement, m, per_cut):
    checked = 0
    assert priced(placement, per_cut)[0].per_cut == (per_cut and placement.depth > 2)
    for times, mb_pipeline, judge, scheduler in _runs(placement, m, per_cut):
        result = scheduler().run()
        plan = Plan(placement, m, result.orders, "zb", mb_pipeline)
        assert result.replayed_ticks * judge.tick == replay(plan, times).makespan
        checked += 1
    assert checked >= 20


@pytest.mark.parametrize("placement, m", CASES[::3], ids=str)
def test_a_run_stops_exactly_when_its_replay_passes_the_limit(placement, m):
    for _, _, _, scheduler in _runs(placement, m):
        whole = scheduler().run()
        assert scheduler().run(whole.replayed_ticks) == whole
        cut = scheduler().run(whole.replayed_ticks - 1)
        assert cut.replayed_ticks == math.inf
        assert sum(map(len, cut.orders)) <= sum(map(len, whole.orders))


def test_stage_times_given_as_lists_plan_as_tuples_do():
    """The planners cache by stage times: lists are kept as tuples (they raised 'unhashable
    type' from the caches)."""
    placement = Placement(2, 2, "wave", "uni")
    fwd, bwd, wgt = [1.0, 1.5, 1.0, 2.0], [2.0, 3.0, 2.0, 4.0], [1.0, 1.0, 1.0, 2.0]
    listed = StageTimes(fwd, bwd, p2p=0.1, wgt=wgt)
    assert listed == StageTimes(tuple(fwd), tuple(bwd), p2p=0.1, wgt=tuple(wgt))
    for schedule in ("prt", "zb"):
        tupled = StageTimes(tuple(fwd), tuple(bwd), p2p=0.1, wgt=tuple(wgt))
        assert build_plan(placement, 5, schedule, listed) == build_plan(
            placement, 5, schedule, tupled
        )
