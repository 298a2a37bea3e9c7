"""The list scheduler's loop (megatron_prt.core.greedy) against the planner it replaced
(tests/reference_planner.py) on the policies large plans run, wave/uni's unbounded
``deepest`` among them; and its give-up bound against one computed from the finished
schedule: a run stopped at a limit stops at the first start whose bound passes the limit,
and resumed it ends where a run without a limit ends."""

import itertools
import math

import pytest
import reference_planner as ref
from test_planner_equivalence import _times

from megatron_prt.core import Placement, StageTimes
from megatron_prt.core import graph as graph_module
from megatron_prt.core.actions import Action, Op
from megatron_prt.core.greedy import GaveUp, IdResult, Policy, Run, compile_graph, list_schedule
from megatron_prt.core.plan import split_microbatches
from megatron_prt.core.schedules import _keys, _portfolio, _rank_bounds

PLACEMENTS = list(itertools.product(["loop", "wave"], ["uni", "bi"]))
KINDS = ["uniform", "unequal", "hop", "cpu", "idle"]


def _large_policies(place: Placement, m: int, times: StageTimes):
    """The policies of a large plan's portfolio, as (fast, reference) pairs."""
    for caps, key, alternate in _portfolio(place, times, math.inf):
        fast = Policy(alternate=alternate, caps=caps, **_keys(place, m, key))
        old_fwd, old_bwd = ref._keys(place, m, key)
        old = ref.Policy(alternate=alternate, caps=caps, fwd_key=old_fwd, bwd_key=old_bwd)
        yield key, fast, old


@pytest.mark.parametrize("placement, direction", PLACEMENTS)
@pytest.mark.parametrize("kind", KINDS)
def test_large_plan_policies_schedule_as_the_reference(placement, direction, kind):
    for p, r, m in (
        (3, 1, 7),
        (2, 3, 9),
        (4, 2, 13),
        (5, 2, 8),
        (4, 4, 11),
        (8, 2, 19),
        (16, 2, 37),
    ):
        place = Placement(p, r, placement, direction)
        times = _times(place, kind) or StageTimes.uniform(place.depth)
        mb_pipeline = split_microbatches(m, place.num_pipelines)
        for key, fast, old in _large_policies(place, m, times):
            got = list_schedule(place, mb_pipeline, times, fast)
            want = ref.list_schedule(place, mb_pipeline, times, old)
            assert (got.orders, got.makespan, got.peak_held) == (
                want.orders, want.makespan, want.peak_held,
            ), (p, r, m, key)  # fmt: skip


def test_wave_uni_deepest_schedules_as_the_reference():
    """The policy that wins wave/uni at scale (unbounded warm-up, deepest first): at P=64
    R=8 m=512 its schedule never settles into a repeating state, so every action of it is
    list-scheduled."""
    place = Placement(8, 4, "wave", "uni")
    for m, times in itertools.product((16, 41, 96), [None, _times(place, "unequal")]):
        times = times or StageTimes.uniform(place.depth)
        mb_pipeline = split_microbatches(m, 1)
        [(_, fast, old)] = [
            pair for pair in _large_policies(place, m, times) if pair[0] == "deepest"
        ]
        got = list_schedule(place, mb_pipeline, times, fast)
        want = ref.list_schedule(place, mb_pipeline, times, old)
        assert (got.orders, got.makespan, got.peak_held) == (
            want.orders, want.makespan, want.peak_held,
        )  # fmt: skip


def _first_start_past(result: IdResult, graph, times, tails, limit: int) -> int | None:
    """The earliest start of the finished schedule whose bound (start + the rank's work
    from it on + its tail) passes ``limit``, or None."""
    ticks, _ = times.in_ticks()
    duration = graph.durations(ticks)
    starts = []
    for rank, (ids, ends) in enumerate(zip(result.orders, result.ends, strict=True)):
        left = sum(map(duration.__getitem__, ids))
        for action, end in zip(ids, ends, strict=True):
            begin = end - duration[action]
            if begin + left + tails[rank] > limit:
                starts.append(begin)
                break
            left -= duration[action]
    return min(starts, default=None)


@pytest.mark.parametrize("placement, direction", PLACEMENTS)
@pytest.mark.parametrize("kind", ["uniform", "unequal", "hop", "idle"])
def test_a_run_gives_up_at_the_first_start_past_its_limit(placement, direction, kind):
    """Limits from the lower bound to past the makespan, on plans that repeat their steady
    state (P=4 R=2 m=67) and plans that do not; each run, stopped and resumed with the
    next limit, gives up where the finished schedule says and ends as an unlimited run."""
    checked = 0
    for p, r, m in ((3, 2, 7), (4, 2, 67)):
        place = Placement(p, r, placement, direction)
        times = _times(place, kind) or StageTimes.uniform(place.depth)
        graph = compile_graph(place, split_microbatches(m, place.num_pipelines))
        ticks, _ = times.in_ticks()
        bounds = _rank_bounds(place, graph.mb_pipeline, ticks)
        bound = max(head + work + tail for head, work, tail in bounds)
        tails = [0 if tail == math.inf else tail for _, _, tail in bounds]
        for caps, key, alternate in _portfolio(place, times, math.inf):
            policy = Policy(alternate=alternate, caps=caps, **_keys(place, m, key))
            whole = Run(graph, times, policy, tails).run(None)
            run = Run(graph, times, policy, tails)
            limits = sorted({bound - 1, bound, (bound + whole.ticks) // 2, whole.ticks - 1})
            for limit in [limit for limit in limits if limit >= 0]:
                result, past = run.run(limit), _first_start_past(whole, graph, times, tails, limit)
                if past is None:
                    assert isinstance(result, IdResult), (p, key, limit)
                    break
                assert result == GaveUp(past), (p, key, limit)
                checked += 1
            assert run.run(None) == whole
    assert checked


def test_a_rule_with_two_unimplied_producers_is_refused(monkeypatch):
    """The scheduler readies an action when its one producer finishes; a dependency rule
    giving an action two producers, neither implied by the other, is refused by name."""
    producers = graph_module.producers

    def with_an_extra(action, placement):
        deps = producers(action, placement)
        if action.op is Op.F and deps:  # a forward also waits for the source
            return (*deps, Action(placement.pipelines[0][0], Op.F, action.mb))
        return deps

    monkeypatch.setattr(graph_module, "producers", with_an_extra)
    with pytest.raises(ValueError, match="implied producers"):
        graph_module.Graph(Placement(2, 2, "loop", "uni"), (0, 0, 0))
