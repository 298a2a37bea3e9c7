"""Repeating the list scheduler's steady state (megatron_prt.core.steady) changes no
schedule: every policy of the portfolio, scheduled with the watch and without it, gives the
same orders, start ticks, makespan, peaks and give-up instants; the grid does repeat."""

import itertools
import math
from dataclasses import astuple, replace

import pytest
from test_planner_fast_paths import same_replay

from megatron_prt.core import Placement, StageTimes, greedy
from megatron_prt.core.greedy import IdResult, Policy, Run, compile_graph, compiled_schedule
from megatron_prt.core.plan import Plan, split_microbatches
from megatron_prt.core.schedules import _keys, _portfolio, _rank_bounds
from megatron_prt.core.steady import SteadyWatch


def _unequal(depth: int) -> StageTimes:
    return StageTimes(
        tuple(1.0 + 0.5 * (k % 3) for k in range(depth)), tuple(2.0 + (k % 2) for k in range(depth))
    )


def _steps(graph, times, policy, tails, bound) -> list:
    """Results of one run asked to stop at the bound, then a little past it, then never."""
    run = Run(graph, times, policy, tails)
    return [run.run(limit) for limit in (bound, bound + bound // 50, None)]


def _comparable(result) -> tuple:
    """All of a result but the order of starts within an instant (any dependency order)."""
    if isinstance(result, IdResult):
        return (*astuple(replace(result, started=[])), sorted(result.started))
    return result


class _NoWatch:
    @staticmethod
    def of(*_args):
        return None


@pytest.fixture
def repeats(monkeypatch) -> list[bool]:
    """Per sample of any watch: whether it repeated a period."""
    seen = []
    sample = SteadyWatch.sample

    def counting(self, *args):
        skipped = sample(self, *args)
        seen.append(skipped is not None)
        return skipped

    monkeypatch.setattr(SteadyWatch, "sample", counting)
    return seen


@pytest.fixture
def prefixes(monkeypatch) -> list[int]:
    """Per run that copied part of a period once more after its repeats: the actions copied."""
    copied = []
    resume_at = SteadyWatch._resume_at

    def counting(self, sample, period, times, run):
        count = len(run["started"])
        now = resume_at(self, sample, period, times, run)
        copied.append(len(run["started"]) - count)
        return now

    monkeypatch.setattr(SteadyWatch, "_resume_at", counting)
    return copied


@pytest.mark.parametrize(
    "placement, direction", list(itertools.product(["loop", "wave"], ["uni", "bi"]))
)
def test_repeating_the_steady_state_changes_no_schedule(
    placement, direction, repeats, prefixes, monkeypatch
):
    # the portfolio of large plans on a grid, and the whole portfolio at P=8 R=4 m=128
    # (below that size bi plans seldom reach a steady state)
    configs = [
        (p, r, scale * p + 3, math.inf)
        for p, r, scale in itertools.product((2, 3, 4, 8), (1, 2, 4), (4, 8))
    ]
    for p, r, m, size in [*configs, (8, 4, 128, 0)]:
        place = Placement(p, r, placement, direction)
        graph = compile_graph(place, split_microbatches(m, place.num_pipelines))
        for times in (StageTimes.uniform(place.depth), _unequal(place.depth)):
            ticks, _ = times.in_ticks()
            bounds = _rank_bounds(place, graph.mb_pipeline, ticks)
            bound = max(head + work + tail for head, work, tail in bounds)
            tails = [0 if tail == math.inf else tail for _, _, tail in bounds]
            for caps, key, alternate in _portfolio(place, times, size):
                policy = Policy(alternate=alternate, caps=caps, **_keys(place, m, key))
                watched = _steps(graph, times, policy, tails, bound)
                with monkeypatch.context() as patch:
                    patch.setattr(greedy, "SteadyWatch", _NoWatch)
                    plain = _steps(graph, times, policy, tails, bound)
                assert list(map(_comparable, watched)) == list(map(_comparable, plain)), (
                    place, m, times, key,
                )  # fmt: skip
    assert any(repeats)  # the grid does repeat steady states
    assert any(prefixes)  # and copies part of a period once more after the repeats


@pytest.mark.parametrize(
    "p, r, m, placement, direction, which",
    [(4, 2, 67, "loop", "uni", 1), (3, 2, 27, "wave", "uni", 0), (8, 4, 128, "loop", "bi", 0)],
)
def test_a_repeated_schedule_replays_as_its_plan(p, r, m, placement, direction, which, repeats):
    """The scheduler's kept timeline and dependency order, repeated periods included, are
    the ones the plan's actions give."""
    place = Placement(p, r, placement, direction)
    times = StageTimes.uniform(place.depth)
    graph = compile_graph(place, split_microbatches(m, place.num_pipelines))
    caps, key, alternate = list(_portfolio(place, times, math.inf))[which]
    policy = Policy(alternate=alternate, caps=caps, **_keys(place, m, key))
    result = Run(graph, times, policy, None).run(None)
    assert any(repeats)
    plan = Plan(place, m, result.materialise(graph).orders, "prt", graph.mb_pipeline)
    same_replay(compiled_schedule(graph, times, result, plan), plan, [times, _unequal(place.depth)])
