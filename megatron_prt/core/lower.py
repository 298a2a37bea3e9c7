"""Communication lowering: insert SEND/RECV for every cross-rank tensor edge.

Comm actions are placed by replaying the plan in time (uniform stage times unless given):
a SEND goes right after the compute that produced the tensor, and the matching RECV goes
into the consumer's stream at that same instant, after whatever the consumer has started by
then. Every SEND/RECV pair is therefore adjacent in one global order of events, so the
lowered plan completes even if both SEND and RECV block until matched (see
:mod:`megatron_prt.core.validate`). Same-rank hand-offs (wave turns, bi replicas on one
rank, F->B of a stage) get no communication: the runtime passes those tensors directly.
"""

from __future__ import annotations

from dataclasses import replace

from .actions import Action, Op
from .deps import carries_tensor, comm_ops, consumers, consumers_map, producers
from .placement import Placement
from .plan import Plan
from .replay import replay
from .timing import StageTimes


def message_key(producer: Action, consumer: Action) -> tuple:
    """Identity of the tensor on the edge ``producer -> consumer`` (see
    :mod:`megatron_prt.core.deps`): ``(kind, from stage, to stage, mb)``, kind ``act`` or
    ``grad``."""
    kind = "act" if producer.op is Op.F else "grad"
    return (kind, producer.stage, consumer.stage, producer.mb)


def message_ends(comm: Action, placement: Placement, split: bool = False) -> tuple[Action, Action]:
    """``(producer, consumer)`` of the tensor a SEND/RECV action carries. :func:`lower` names
    a SEND by its producer's stage and a RECV by its consumer's; the other end comes from
    the dependency rule."""
    stage, op, mb = comm
    sending = op in (Op.SEND_F, Op.SEND_B)
    ops = (Op.F, Op.I, Op.W) if split else (Op.F, Op.B)
    found = []
    for own in (Action(stage, o, mb) for o in ops):
        if sending:
            edges = [(own, c) for c in consumers(own, placement, split)]
        else:
            edges = [(p, own) for p in producers(own, placement, split)]
        found += [
            (p, c)
            for p, c in edges
            if carries_tensor(p, c) and comm_ops(p)[0 if sending else 1] is op
        ]
    if len(found) != 1:
        raise ValueError(
            f"{comm}: a SEND/RECV must carry exactly one tensor edge, found {found} "
            f"under {placement}"
        )
    return found[0]


def comm_key(comm: Action, placement: Placement, split: bool = False) -> tuple:
    """:func:`message_key` of the tensor a SEND/RECV action carries."""
    return message_key(*message_ends(comm, placement, split))


def lower(plan: Plan, times: StageTimes | None = None) -> Plan:
    """Return ``plan`` with SEND/RECV actions inserted (idempotent on lowered plans)."""
    if plan.lowered:
        return plan
    placement = plan.placement
    timeline = replay(plan, times)
    actions = list(timeline.start)
    consumers = consumers_map(actions, placement, plan.split_backward)
    rank_of = placement.stage_to_rank
    events = []  # (time, kind: 0 = message, 1 = compute, rank, action, consumer)
    for action, begin in timeline.start.items():
        rank = rank_of[action.stage]
        events.append((begin, 1, rank, action, None))
        for consumer in consumers[action]:
            if rank_of[consumer.stage] != rank:
                events.append((timeline.end[action], 0, rank, action, consumer))
    # Messages at an instant go before computes starting then; ties keep per-rank order.
    step = {a: i for acts in plan.ranks for i, a in enumerate(acts)}
    events.sort(key=lambda e: (e[0], e[1], e[2], step[e[3]]))
    streams: list[list[Action]] = [[] for _ in range(placement.ranks)]
    for _, kind, rank, action, consumer in events:
        if kind == 1:
            streams[rank].append(action)
            continue
        send_op, recv_op = comm_ops(action)
        streams[rank].append(Action(action.stage, send_op, action.mb))
        streams[rank_of[consumer.stage]].append(Action(consumer.stage, recv_op, action.mb))
    return replace(plan, ranks=tuple(tuple(s) for s in streams), lowered=True)
