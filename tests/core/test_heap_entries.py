"""The list scheduler's heap entries (megatron_prt.core.graph.HeapEntries), made a
micro-batch at a time: every entry is ``key * n + id`` of its action's key, filled or made
alone; a run reads none it has not made (it would raise), and a run that gives up early
makes only those of the micro-batches it started."""

import itertools
import math

import pytest

from megatron_prt.core import Placement, StageTimes, greedy
from megatron_prt.core import graph as graph_module
from megatron_prt.core.greedy import GaveUp, Policy, Run, compile_graph
from megatron_prt.core.plan import split_microbatches
from megatron_prt.core.schedules import _keys, _portfolio, _rank_bounds

PLACEMENTS = list(itertools.product(["loop", "wave"], ["uni", "bi"]))


@pytest.mark.parametrize("placement, direction", PLACEMENTS)
@pytest.mark.parametrize("key_name", ["depth_first", "grouped", "deepest"])
def test_entries_are_key_then_id(placement, direction, key_name):
    place, m = Placement(3, 2, placement, direction), 7
    graph = compile_graph(place, split_microbatches(m, place.num_pipelines))
    keys = _keys(place, m, key_name)
    fwd, bwd = keys["fwd_key"], keys["bwd_key"]
    want = [
        (bwd if i & 1 else fwd)(graph.stage[i], graph.mb[i]) * graph.n + i for i in range(graph.n)
    ]
    entries = graph.heap_entries(fwd, bwd)
    assert [entries.entry(i) for i in range(graph.n)] == want
    entries.fill_through(graph.width + 1)  # the second micro-batch, whole
    assert entries.items == want[: 2 * graph.width]
    entries.fill_through(0)  # never shrinks
    assert entries.items == want[: 2 * graph.width]
    entries.fill()
    assert entries.items == want


@pytest.fixture
def made(monkeypatch) -> list:
    """Every HeapEntries a graph makes, as made."""
    kept = []
    heap_entries = graph_module.Graph.heap_entries

    def keeping(self, *keys):
        entries = heap_entries(self, *keys)
        kept.append(entries)
        return entries

    monkeypatch.setattr(graph_module.Graph, "heap_entries", keeping)
    return kept


class _NoWatch:  # repeating a steady state makes every entry (the shifted heaps read them)
    @staticmethod
    def of(*_args):
        return None


@pytest.mark.parametrize("placement, direction", PLACEMENTS)
def test_a_run_that_gives_up_makes_only_the_entries_it_started(
    placement, direction, made, monkeypatch
):
    monkeypatch.setattr(greedy, "SteadyWatch", _NoWatch)
    place, m = Placement(8, 2, placement, direction), 64
    times = StageTimes.uniform(place.depth)
    graph = compile_graph(place, split_microbatches(m, place.num_pipelines))
    ticks, _ = times.in_ticks()
    bounds = _rank_bounds(place, graph.mb_pipeline, ticks)
    tails = [0 if tail == math.inf else tail for _, _, tail in bounds]
    bound = max(head + work + tail for head, work, tail in bounds)
    early = 0
    for caps, key, alternate in _portfolio(place, times, math.inf):
        policy = Policy(alternate=alternate, caps=caps, **_keys(place, m, key))
        whole = Run(graph, times, policy, tails).run(None)
        duration = graph.durations(ticks)
        begin = {}
        for ids, ends in zip(whole.orders, whole.ends, strict=True):
            begin.update((i, end - duration[i]) for i, end in zip(ids, ends, strict=True))
        for limit in sorted({bound, (bound + whole.ticks) // 2}):
            run = Run(graph, times, policy, tails)
            result = run.run(limit)
            if not isinstance(result, GaveUp):
                continue
            # a give-up comes within an instant: sources starting then may have started
            started = [i for i in graph.sources if begin[i] <= result.at]
            assert len(made[-1].items) <= (max(started) // graph.width + 1) * graph.width
            early += 0 < len(made[-1].items) < graph.n
            assert run.run(None) == whole  # resumed, it makes the rest
            assert made[-1].items == [made[-1].entry(i) for i in range(graph.n)]
    assert early  # some run stopped after some micro-batches started, before all
