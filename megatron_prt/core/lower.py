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

from bisect import bisect_left
from dataclasses import replace
from itertools import accumulate, compress, pairwise, repeat
from operator import itemgetter

from .actions import Action, Op
from .deps import carries_tensor, comm_ops, consumers, producers
from .gcpause import without_gc
from .placement import Placement
from .plan import Plan
from .replay import Replayer, Ticks, compiled, keep_compiled
from .timing import StageTimes

_STAGE, _MB = itemgetter(0), itemgetter(2)


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


@without_gc
def lower(plan: Plan, times: StageTimes | None = None) -> Plan:
    """Return ``plan`` with SEND/RECV actions inserted (idempotent on lowered plans).

    Events: each compute at its start; each cross-rank edge at its producer's end, a SEND on
    the producer's rank and a RECV on the consumer's. One order of all events, ``(time,
    message before compute, producer's rank, producer's step)``, written as one integer per
    event, gives every rank's stream; each rank sorts only its own events. The lowered plan
    keeps the compiled replay of ``plan`` (same compute actions)."""
    if plan.lowered:
        return plan
    replayer = compiled(plan)
    ticks = replayer.run_ticks(times)
    spans = list(pairwise([0, *accumulate(map(len, plan.ranks))]))
    starts, ends = _event_keys(plan, replayer.rank_of, ticks, spans)
    sends, recvs = _messages(replayer)
    streams = []
    for first, last in spans:
        send_cut = slice(bisect_left(sends[0], first), bisect_left(sends[0], last))
        recv_cut = slice(bisect_left(recvs[0], first), bisect_left(recvs[0], last))
        keys = starts[first:last]
        keys += map(ends.__getitem__, sends[0][send_cut])
        keys += map(ends.__getitem__, recvs[1][recv_cut])
        items = replayer.actions[first:last] + sends[1][send_cut] + recvs[2][recv_cut]
        order = sorted(range(len(keys)), key=keys.__getitem__)
        streams.append(tuple(map(items.__getitem__, order)))
    lowered = replace(plan, ranks=tuple(streams), lowered=True)
    keep_compiled(lowered, replayer)
    return lowered


def _event_keys(plan: Plan, rank_of: list[int], ticks: Ticks, spans) -> tuple[list, list]:
    """Per compute action the integer of its start event and of its end (message) event."""
    ranks, steps = plan.placement.ranks, max(map(len, plan.ranks), default=0) + 1
    step = [i - first for first, last in spans for i in range(first, last)]
    ends = ticks.end
    starts = [
        ((2 * (e - d) + 1) * ranks + r) * steps + s
        for e, d, r, s in zip(ends, ticks.duration, rank_of, step, strict=True)
    ]
    return starts, [
        (2 * e * ranks + r) * steps + s for e, r, s in zip(ends, rank_of, step, strict=True)
    ]


def _messages(replayer: Replayer) -> tuple[tuple, tuple]:
    """Every cross-rank edge: SENDs as (producer indices in order, SEND actions); RECVs as
    (consumer indices in order, their producers, RECV actions). An action sends at most one
    tensor to another rank and receives at most one (the dependency rule)."""
    actions, kind_of = replayer.actions, replayer.kind_of
    remote = replayer.remote_producers()
    receives = [producer >= 0 for producer in remote]
    users = list(compress(range(len(actions)), receives))
    producers_ = list(compress(remote, receives))
    ops = [comm_ops(Action(stage, op, 0)) for stage, op in replayer.kinds]
    send_op, recv_op = [o[0] for o in ops], [o[1] for o in ops]
    sent = sorted(producers_)
    source = list(map(actions.__getitem__, sent))
    send = zip(
        map(_STAGE, source),
        map(send_op.__getitem__, map(kind_of.__getitem__, sent)),
        map(_MB, source),
        strict=True,
    )
    source = list(map(actions.__getitem__, producers_))
    recv_ops = map(recv_op.__getitem__, map(kind_of.__getitem__, producers_))
    sinks = map(_STAGE, map(actions.__getitem__, users))
    recv = zip(sinks, recv_ops, map(_MB, source), strict=True)
    return (sent, _make_actions(send)), (users, producers_, _make_actions(recv))


def _make_actions(rows) -> list[Action]:
    return list(map(tuple.__new__, repeat(Action), rows))
