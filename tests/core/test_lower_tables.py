"""The replay tables a scheduled plan keeps (megatron_prt.core.compiled.compiled_schedule)
are the tables the plan's actions give (Replayer(plan)), for any split of the
micro-batches: per action its kind (from the graph's kinds) and its producer on another
rank (written one row of ids at a time when each pipeline's micro-batches are evenly
spaced, looked up id by id when not)."""

import itertools

import pytest

from megatron_prt.core import Placement, StageTimes
from megatron_prt.core.compiled import compiled_schedule
from megatron_prt.core.greedy import Policy, compile_graph, schedule_ids
from megatron_prt.core.plan import Plan, split_microbatches
from megatron_prt.core.replay import Replayer

SPLITS = {
    "in turn": None,  # split_microbatches
    "halves": lambda m: tuple(2 * mb // m for mb in range(m)),
    "one lone": lambda m: (1, *([0] * (m - 1))),
    "uneven": lambda m: tuple(int(mb % 3 == 1) for mb in range(m)),
}


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize(
    "placement, direction", list(itertools.product(["loop", "wave"], ["uni", "bi"]))
)
def test_kept_tables_are_the_plans_tables(placement, direction, split):
    for p, r, m in ((2, 1, 4), (3, 2, 7), (4, 2, 9)):
        place = Placement(p, r, placement, direction)
        if SPLITS[split] is None or place.num_pipelines == 1:
            mb_pipeline = split_microbatches(m, place.num_pipelines)
        else:
            mb_pipeline = SPLITS[split](m)
        graph = compile_graph(place, mb_pipeline)
        times = StageTimes.uniform(place.depth)
        result = schedule_ids(graph, times, Policy())
        plan = Plan(place, m, result.materialise(graph).orders, "prt", mb_pipeline)
        fast, slow = compiled_schedule(graph, times, result, plan), Replayer(plan)
        assert fast.kinds == slow.kinds
        assert fast.kind_of == slow.kind_of
        assert fast.remote_producers() == slow.remote_producers()


def test_lanes_are_the_evenly_spaced_splits():
    def lanes(mb_pipeline):
        return Plan(
            Placement(2, 1, "loop", "bi"), len(mb_pipeline), ((), ()), "prt", mb_pipeline
        ).lanes

    assert lanes((0, 1, 0, 1, 0)) == [(0, 2), (1, 2)]
    assert lanes((0, 0, 1, 1)) is None
    assert lanes((1, 0, 0, 0)) == [(1, 1), (0, 4)]
    assert lanes((0, 0, 0, 1)) is None  # pipeline 0 stops early
    assert lanes((0, 0, 0)) == [(0, 1), (3, 1)]  # pipeline 1 has none
