"""lower() makes each RECV on its producer's rank (no look-up of producers) and falls back
to making it on its consumer's rank (the producer looked up in the replay) when the plan
lacks a consumer; both give the same streams for every complete plan, and the fallback is
the one taken for a plan with an action missing."""

import itertools
from dataclasses import replace
from itertools import accumulate, pairwise

import pytest

from megatron_prt.core import Action, Op, Placement, StageTimes, build_plan
from megatron_prt.core import lower as lowering
from megatron_prt.core.replay import compiled


def _both(plan, times=None):
    replayer = compiled(plan)
    ticks = replayer.run_ticks(times)
    spans = list(pairwise([0, *accumulate(map(len, plan.ranks))]))
    keys = lowering._event_keys(ticks, lowering._levels(replayer, ticks))
    messages = lowering._Messages(replayer)
    return (
        lowering._from_producers(plan, spans, keys, messages, replayer.kind_of),
        lowering._from_consumers(plan, spans, keys, messages, replayer),
    )


@pytest.mark.parametrize(
    "placement, direction, schedule",
    list(itertools.product(["loop", "wave"], ["uni", "bi"], ["prt", "zb"])),
)
def test_producer_and_consumer_side_agree(placement, direction, schedule):
    for p, r in ((2, 1), (3, 2), (4, 4)):
        place = Placement(p, r, placement, direction)
        times = StageTimes(
            tuple(1.0 + k % 2 for k in range(place.depth)),
            tuple(2.0 + k % 3 for k in range(place.depth)),
            p2p=0.5,
        )
        plan = build_plan(place, p + 3, schedule, times)
        for one in (plan, plan.forward_only()):
            fast, slow = _both(one, times)
            assert fast is not None
            assert fast == slow


def test_a_plan_missing_a_consumer_takes_the_consumer_side():
    plan = build_plan(Placement(3, 1, "loop", "uni"), 4)
    last = Action(0, Op.B, 3)  # stage 0's backward of the last micro-batch: nothing needs it
    ranks = tuple(tuple(a for a in acts if a != last) for acts in plan.ranks)
    partial = replace(plan, ranks=ranks)
    fast, slow = _both(partial)
    assert fast is None
    assert lowering.lower(partial).ranks == tuple(slow)
    assert last not in lowering.lower(partial).ranks[0]
