"""Plans one edit away from a given plan, for the validators' tests (test_flatcheck,
test_lowering_check): what a check must refuse, or at least judge as the other check does."""

from __future__ import annotations

import random
from dataclasses import replace

from megatron_prt.core.actions import Action, Op
from megatron_prt.core.plan import Plan


def with_ranks(plan: Plan, changes: dict, **fields) -> Plan:
    ranks = list(plan.ranks)
    for rank, actions in changes.items():
        ranks[rank] = tuple(actions)
    return replace(plan, ranks=tuple(ranks), **fields)


def mutations(plan: Plan, rng: random.Random, count: int):
    """Plans one edit away from ``plan``: an action dropped, doubled, moved, swapped with its
    neighbour, moved to another rank, or its micro-batch changed; in a lowered plan also a
    SEND/RECV of any kind added."""
    busy = [r for r, acts in enumerate(plan.ranks) if acts]
    for _ in range(count):
        rank = rng.choice(busy)
        acts = list(plan.ranks[rank])
        step = rng.randrange(len(acts))
        edit = rng.randrange(7 if plan.lowered else 6)
        if edit == 0:
            del acts[step]
        elif edit == 1:
            acts.insert(rng.randrange(len(acts) + 1), acts[step])
        elif edit == 2:
            acts.insert(rng.randrange(len(acts) + 1), acts.pop(step))
        elif edit == 3 and step + 1 < len(acts):
            acts[step], acts[step + 1] = acts[step + 1], acts[step]
        elif edit == 4 and len(plan.ranks) > 1:
            other = (rank + 1) % len(plan.ranks)
            moved = acts.pop(step)
            yield with_ranks(plan, {rank: acts, other: (*plan.ranks[other], moved)})
            continue
        elif edit == 5:
            stage, op, mb = acts[step]
            acts[step] = Action(stage, op, (mb + 1) % plan.num_microbatches)
        else:  # a SEND/RECV of any kind for a stage of this rank (lowered plans)
            stage = rng.choice(plan.placement.rank_stages[rank])
            op = rng.choice([Op.SEND_F, Op.SEND_B, Op.RECV_F, Op.RECV_B])
            extra = Action(stage, op, rng.randrange(plan.num_microbatches))
            acts.insert(rng.randrange(len(acts) + 1), extra)
        yield with_ranks(plan, {rank: acts})
