"""What the planner's fast paths take for granted, checked from outside: a scheduled plan's
compiled replay (made from the scheduler's tables and timeline) is the one the plan's actions
give; the plans the scheduler and the lowering vouch for pass the full checks; the vouching
stays on the object that earned it."""

import itertools
import pickle
from dataclasses import replace

import pytest
from test_planner_equivalence import _times

from megatron_prt.core import Placement, StageTimes
from megatron_prt.core.greedy import Policy, compile_graph, compiled_schedule, schedule_ids
from megatron_prt.core.lower import lower
from megatron_prt.core.plan import Plan, split_microbatches, vouch, vouched
from megatron_prt.core.replay import PlanError, Replayer, compiled
from megatron_prt.core.schedules import _keys, _portfolio, _prt_portfolio, build_plan
from megatron_prt.core.validate import validate

KINDS = ["uniform", "unequal", "hop", "cpu", "idle"]


def same_replay(fast: Replayer, plan: Plan, times_list) -> None:
    slow = Replayer(plan)  # derived from the actions alone, with the dependency walk
    for name in ("actions", "rank_of", "kinds", "kind_of", "_dep", "_crosses"):
        assert getattr(fast, name) == getattr(slow, name), name
    assert fast.remote_producers() == slow.remote_producers()
    assert fast.preds == slow.preds
    for times in times_list:
        assert fast.run_ticks(times) == slow.run_ticks(times), times
    # the fast order is a dependency order too: every action after its producers
    position = {i: k for k, i in enumerate(fast.order)}
    assert sorted(position) == list(range(len(fast.actions)))
    for i, deps in enumerate(slow.preds):
        assert all(position[j] < position[i] for j, _ in deps)


@pytest.mark.parametrize(
    "placement, direction", list(itertools.product(["loop", "wave"], ["uni", "bi"]))
)
@pytest.mark.parametrize("kind", KINDS)
def test_scheduled_replay_is_the_plans_replay(placement, direction, kind):
    """Every policy of the portfolio, forced forwards included (tiny caps force them, and
    then the scheduler's timeline is not the replay's): the tables and the timeline kept
    with the plan equal what the plan's actions give."""
    forced_seen = 0
    for p, r in ((1, 2), (2, 2), (3, 2), (4, 1)):
        place = Placement(p, r, placement, direction)
        times = _times(place, kind) or StageTimes.uniform(place.depth)
        others = [None, StageTimes.uniform(place.depth, p2p=0.3), times]
        for m in (2, p + 1, 2 * p + 1):
            mb_pipeline = split_microbatches(m, place.num_pipelines)
            graph = compile_graph(place, mb_pipeline)
            for caps, key, alternate in _portfolio(place, times, 2 * place.depth * m):
                policy = Policy(alternate=alternate, caps=caps, **_keys(place, m, key))
                result = schedule_ids(graph, times, policy)
                plan = Plan(place, m, result.materialise(graph).orders, "prt", mb_pipeline)
                same_replay(compiled_schedule(graph, times, result, plan), plan, others)
                forced_seen += result.forced
    assert forced_seen  # the grid does reach forced forwards


@pytest.mark.parametrize(
    "placement, direction", list(itertools.product(["loop", "wave"], ["uni", "bi"]))
)
@pytest.mark.parametrize("kind", KINDS)
def test_vouched_plans_pass_the_full_checks(placement, direction, kind):
    """build_plan's plans and their lowerings (under the build's times and under others)
    are vouched for, and the checks that vouching skips pass on them."""
    for p, r in ((1, 3), (2, 2), (3, 2), (4, 2)):
        place = Placement(p, r, placement, direction)
        times = _times(place, kind)
        for m in sorted({2, p + 1, 3 * p + 1}):
            _prt_portfolio.cache_clear()
            plan = build_plan(place, m, times=times)
            assert vouched(plan)
            same_replay(compiled(plan), plan, [None, times])
            for lower_times in (None, times, StageTimes.uniform(place.depth, p2p=0.5)):
                lowered = lower(plan, lower_times)  # from the replay the scheduler kept
                assert vouched(lowered)
                assert lowered == lower(replace(plan), lower_times)  # one derived from actions
                validate(lowered, full=True)
            validate(plan, full=True)


def test_vouching_stays_on_the_object():
    plan = build_plan(Placement(2, 2, "wave", "bi"), 4)
    assert vouched(plan)
    assert not vouched(replace(plan))
    assert not vouched(Plan.from_json(plan.to_json()))
    assert not vouched(Plan.from_csv(plan.to_csv()))
    assert not vouched(pickle.loads(pickle.dumps(plan)))
    assert not vouched(plan.compute_only())  # a plan derived from it is checked again
    unchecked = replace(plan)
    validate(unchecked)
    assert vouched(unchecked)  # a plan that passed is not checked twice
    lowered = lower(replace(plan))
    assert not vouched(lowered)  # the lowering of an unchecked plan is checked in full
    validate(lowered)
    assert vouched(lowered)


def test_full_check_ignores_a_vouch():
    """A plan vouched for by mistake (a producer's bug) still fails the full check."""
    plan = build_plan(Placement(2, 1, "loop", "uni"), 3)
    ranks = (plan.ranks[0][:-1], plan.ranks[1])  # drops rank 0's last backward
    bad = vouch(Plan(plan.placement, 3, ranks))
    validate(bad)  # trusted
    with pytest.raises(PlanError, match="missing"):
        validate(bad, full=True)
