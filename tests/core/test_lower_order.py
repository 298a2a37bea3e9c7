"""lower() writes every rank's stream in the one order of events its docstring states:
``(time, level, message before compute, producer's rank, producer's step)``, a compute at
its start, a SEND (producer's rank) and its RECV (consumer's rank) at the producer's end.
The reference here sorts those events as tuples, straight from the replay and the
dependency rule, so any change of lower's integer keys that reorders a stream fails."""

import itertools

import pytest

from megatron_prt.core import Action, Placement, StageTimes, build_plan
from megatron_prt.core.deps import carries_tensor, comm_ops, producers
from megatron_prt.core.lower import _levels, lower
from megatron_prt.core.replay import compiled


def _reference(plan, times=None):
    replayer = compiled(plan)
    ticks = replayer.run_ticks(times)
    levels = _levels(replayer, ticks) or ([0] * len(ticks.end), [0] * len(ticks.end))
    placement, split = plan.placement, plan.split_backward
    index, rank_of, step_of = {}, {}, {}
    for rank, acts in enumerate(plan.ranks):
        for step, action in enumerate(acts):
            index[action], rank_of[action], step_of[action] = len(index), rank, step
    events = [[] for _ in plan.ranks]
    for action, i in index.items():
        rank = rank_of[action]
        start = ticks.end[i] - ticks.duration[i]
        events[rank].append(((start, levels[0][i], 1, rank, step_of[action]), action))
        for dep in producers(action, placement, split):
            j = index[dep]
            if rank_of[dep] == rank or not carries_tensor(dep, action):
                continue
            send_op, recv_op = comm_ops(dep)
            key = (ticks.end[j], levels[1][j], 0, rank_of[dep], step_of[dep])
            events[rank_of[dep]].append((key, Action(dep.stage, send_op, dep.mb)))
            events[rank].append((key, Action(action.stage, recv_op, action.mb)))
    return tuple(tuple(action for _, action in sorted(stream)) for stream in events)


CASES = [
    (Placement(p, r, placement, direction), m, schedule)
    for (p, r, m), placement, direction, schedule in itertools.product(
        [(2, 1, 4), (3, 2, 7), (4, 2, 8), (4, 4, 16)],
        ["loop", "wave"],
        ["uni", "bi"],
        ["prt", "1f1b", "zb"],
    )
]


@pytest.mark.parametrize("placement, m, schedule", CASES, ids=str)
def test_lowered_streams_are_the_event_order(placement, m, schedule):
    try:
        plan = build_plan(placement, m, schedule)
    except Exception:  # a schedule that does not support this placement
        pytest.skip(f"{schedule} does not plan {placement}")
    assert lower(plan).ranks == _reference(plan)
    forward = plan.forward_only()
    assert lower(forward).ranks == _reference(forward)


@pytest.mark.parametrize("direction", ["uni", "bi"])
@pytest.mark.parametrize("schedule", ["prt", "zb"])
def test_zero_time_stages_keep_the_event_order(direction, schedule):
    """Stages that take no time: ties at one instant are broken by the levels."""
    place = Placement(3, 2, "wave", direction)
    busy = tuple(float(s % 3 != 0) for s in range(place.depth))
    times = StageTimes(busy, tuple(2 * t for t in busy))
    plan = build_plan(place, 7, schedule, times)
    assert lower(plan, times).ranks == _reference(plan, times)
