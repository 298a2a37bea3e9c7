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

from collections.abc import Iterable, Sequence
from dataclasses import replace
from functools import lru_cache
from itertools import accumulate, compress, pairwise, repeat
from operator import add, mul, sub

from .actions import Action, Op
from .columns import RankActions, columns, picker
from .deps import carries_tensor, comm_ops, producers
from .gcpause import without_gc
from .placement import Placement
from .plan import Plan, vouch, vouched
from .replay import Replayer, Ticks, compiled, keep_compiled
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
    the dependency rule (:func:`_message_edges`, asked once per placement)."""
    stage, op, mb = comm
    # an op given as its string equals the Op but is no SEND/RECV the rule names
    found = _message_edges(placement, split).get((stage, op), ()) if isinstance(op, Op) else ()
    if len(found) != 1:
        found = [(p._replace(mb=mb), c._replace(mb=mb)) for p, c in found]
        raise ValueError(
            f"{comm}: a SEND/RECV must carry exactly one tensor edge, found {found} "
            f"under {placement}"
        )
    producer, consumer = found[0]
    return Action(producer.stage, producer.op, mb), Action(consumer.stage, consumer.op, mb)


@lru_cache(maxsize=32)
def _message_edges(placement: Placement, split: bool) -> dict[tuple, list[tuple[Action, Action]]]:
    """``(stage, comm op)`` -> the tensor edges of micro-batch 0 such a SEND/RECV could
    carry: every edge of the dependency rule that carries a tensor, under the SEND of its
    producer's stage and the RECV of its consumer's (:func:`~megatron_prt.core.deps.comm_ops`
    of the producer), in the order the consumers and their producers are listed."""
    ops = (Op.F, Op.I, Op.W) if split else (Op.F, Op.B)
    sends: dict[tuple, list] = {}
    receives: dict[tuple, list] = {}
    for stage in range(placement.num_stages):
        for op in ops:
            consumer = Action(stage, op, 0)
            for producer in producers(consumer, placement, split):
                if carries_tensor(producer, consumer):
                    send_op, recv_op = comm_ops(producer)
                    sends.setdefault((producer.stage, send_op), []).append((producer, consumer))
                    receives.setdefault((stage, recv_op), []).append((producer, consumer))
    return {**sends, **receives}


def comm_key(comm: Action, placement: Placement, split: bool = False) -> tuple:
    """:func:`message_key` of the tensor a SEND/RECV action carries."""
    return message_key(*message_ends(comm, placement, split))


@without_gc
def lower(plan: Plan, times: StageTimes | None = None) -> Plan:
    """Return ``plan`` with SEND/RECV actions inserted (idempotent on lowered plans).

    Events: each compute at its start; each cross-rank edge at its producer's end, a SEND on
    the producer's rank and a RECV on the consumer's. One order of all events, ``(time,
    level, message before compute, producer's rank, producer's step)``, written as one
    number per event (:func:`_event_keys`), gives every rank's stream; each rank sorts only
    its own events. The level (:func:`_levels`) is 0 unless actions take no time: it puts a
    zero-time producer before its message and the message before its consumer when all
    three share an instant. The lowered plan keeps the compiled replay of ``plan`` (same
    compute actions), and is vouched for when ``plan`` is
    (:func:`~megatron_prt.core.plan.vouch`: every SEND/RECV pair is adjacent in that one
    order, so it completes under blocking send/recv)."""
    if plan.lowered:
        return plan
    replayer = compiled(plan)
    ticks = replayer.run_ticks(times)
    spans = list(pairwise([0, *accumulate(map(len, plan.ranks))]))
    keys = _event_keys(ticks, _levels(replayer, ticks))
    messages = _Messages(replayer)
    streams = _from_producers(plan, spans, keys, messages, replayer.kind_of)
    if streams is None:
        streams = _from_consumers(plan, spans, keys, messages, replayer)
    lowered = replace(plan, ranks=tuple(streams), lowered=True)
    keep_compiled(lowered, replayer)
    return vouch(lowered) if vouched(plan) else lowered


def _from_producers(plan: Plan, spans: list, keys: tuple, messages: _Messages, kind_of: list):
    """Every rank's stream, each message made on its producer's rank: a SEND there, and a
    RECV (its consumer's stage and op, the same micro-batch, the same key) handed to the
    consumer's rank, so no action looks its producer up. The same streams as
    :func:`_from_consumers` when every RECV it makes has its consumer in the plan; None
    when a rank gets more or fewer RECVs than it has actions that receive (a plan with a
    missing or repeated action) or a producer sends to two ranks."""
    if messages.to_ranks is None:
        return None
    starts, ends = keys
    sent_by_kind, receives = messages.sent, messages.receives
    streams = [_Stream() for _ in plan.ranks]
    expected, received = [], [0] * len(plan.ranks)  # per rank: RECVs it needs, RECVs made
    for rank, (first, last), computes in zip(range(len(streams)), spans, plan.ranks, strict=True):
        kinds, here = kind_of[first:last], ends[first:last]
        stages, ops, mbs = columns(computes)
        streams[rank].add_all(starts[first:last], stages, ops, mbs)
        sent = list(map(sent_by_kind.__getitem__, kinds))  # its SEND's op, or None
        streams[rank].add(compress(here, sent), stages, sent, mbs)
        if messages.to_ranks[rank]:
            consumer_stages = list(map(messages.consumer_stage.__getitem__, kinds))
        for dest, recv_ops in messages.to_ranks[rank]:
            recvs = list(map(recv_ops.__getitem__, kinds))  # the consumer's RECV op, or None
            received[dest] += streams[dest].add(compress(here, recvs), consumer_stages, recvs, mbs)
        expected.append(sum(map(receives.__getitem__, kinds)))
    if received != expected:
        return None
    return [stream.sorted() for stream in streams]


def _from_consumers(plan: Plan, spans: list, keys: tuple, messages: _Messages, replayer):
    """Every rank's stream, each RECV made on its consumer's rank with the key of its
    producer's message event (:meth:`Replayer.remote_producers`)."""
    starts, ends = keys
    remote, kind_of = replayer.remote_producers(), replayer.kind_of
    streams = []
    for (first, last), computes in zip(spans, plan.ranks, strict=True):
        kinds = kind_of[first:last]
        stages, ops, mbs = columns(computes)
        stream = _Stream()
        stream.add_all(starts[first:last], stages, ops, mbs)
        sent = list(map(messages.sent.__getitem__, kinds))  # its SEND's op, or None
        stream.add(compress(ends[first:last], sent), stages, sent, mbs)
        received = list(map(messages.received.__getitem__, kinds))  # its RECV's op, or None
        at = map(ends.__getitem__, compress(remote[first:last], received))
        stream.add(at, stages, received, mbs)
        streams.append(stream.sorted())
    return streams


class _Stream:
    """One rank's lowered actions as they are gathered: the event key of each and its
    stage, op and micro-batch (see [Note: columnar ranks] in :mod:`megatron_prt.core.
    columns`); :meth:`sorted` orders them by key."""

    def __init__(self) -> None:
        self.keys: list = []
        self.columns: tuple[list, list, list] = ([], [], [])

    def add(self, keys: Iterable, stages: Sequence, ops: Sequence, mbs: Sequence) -> int:
        """Add the rows whose op is not None (``stages``, ``ops``, ``mbs`` as long; ``keys``
        those rows' keys only); return how many."""
        before = len(self.keys)
        self.keys += keys
        into_stages, into_ops, into_mbs = self.columns
        into_stages += compress(stages, ops)
        into_ops += filter(None, ops)  # an Op is a non-empty str: true
        into_mbs += compress(mbs, ops)
        return len(self.keys) - before

    def add_all(self, keys: list, stages: Sequence, ops: Sequence, mbs: Sequence) -> None:
        """Add every row (all four as long)."""
        self.keys += keys
        for column, rows in zip(self.columns, (stages, ops, mbs), strict=True):
            column += rows

    def sorted(self) -> RankActions:
        """The rank's actions in key order (keys are distinct: a total order)."""
        keys = self.keys
        by_key = picker(sorted(range(len(keys)), key=keys.__getitem__))
        return RankActions(*map(by_key, self.columns))


def _event_keys(ticks: Ticks, levels: tuple[list, list] | None) -> tuple[list, list]:
    """Per compute action ``i`` (its index in the plan, ranks concatenated: the order of
    (rank, step)) the number of its start event ``(((start levels + level) 2 + 1) n + i``
    and of its end (message) event ``(((end levels + level) 2) n + i``, ``n`` actions;
    without ``levels`` every level is 0 and ``levels`` 1. Floats when every key is below
    2**53, so exact integers (they compare faster in a sort than integers past 2**30),
    integers otherwise."""
    n = len(ticks.end)
    depth = 1 if levels is None else max(levels[1], default=0) + 1
    unit = depth * 2 * n  # one tick
    if (max(ticks.end, default=0) + 1) * unit < 2**53:
        unit = float(unit)
    ends = list(map(add, map(mul, ticks.end, repeat(unit)), range(n)))
    # start = end key - duration ticks + the start flag; durations take few values
    back = {busy: busy * unit - n for busy in set(ticks.duration)}
    starts = list(map(sub, ends, map(back.__getitem__, ticks.duration)))
    if levels is not None:
        level_unit = repeat(2 * n)
        starts = list(map(add, starts, map(mul, levels[0], level_unit)))
        ends = list(map(add, ends, map(mul, levels[1], level_unit)))
    return starts, ends


def _levels(replayer: Replayer, ticks: Ticks) -> tuple[list[int], list[int]] | None:
    """Per compute action the level of its start event and of its message event, or None
    when every action takes time (all levels 0). Ties at one instant otherwise put a
    message before the compute that made it. A zero-time action's message is one level
    above its start; an action starts at least at the level of the previous action of its
    rank starting at the same instant, and above the message it receives at that instant.
    Walked in the replay's dependency order, so producers are levelled first."""
    duration, end = ticks.duration, ticks.end
    if 0 not in duration:
        return None
    remote, rank_of = replayer.remote_producers(), replayer.rank_of
    start_level, message_level = [0] * len(end), [0] * len(end)
    for i in replayer.order:
        start, level = end[i] - duration[i], 0
        before = i - 1
        if i and rank_of[before] == rank_of[i] and end[before] - duration[before] == start:
            level = start_level[before]
        producer = remote[i]
        if producer >= 0 and end[producer] == start and message_level[producer] > level:
            level = message_level[producer]
        start_level[i] = level
        message_level[i] = level + 1 if duration[i] == 0 else 0
    return start_level, message_level


class _Messages:
    """Per kind of compute action (:attr:`Replayer.kinds`): ``sent``, the op of the SEND
    it makes, and ``received``, of the RECV it takes (None: it sends / receives no tensor
    to / from another rank; both named by the action's own stage); ``receives``: 1 if it
    takes one, else 0; ``consumer_stage``: the stage of the action on another rank it
    sends to. ``to_ranks[rank]``: per rank its producers send to, ``(that rank, per kind
    the consumer's RECV op there or None)``; None if a kind sends to two kinds. The
    dependency rule is asked once per kind: an action receives at most one tensor from
    another rank."""

    def __init__(self, replayer: Replayer) -> None:
        kinds, placement = replayer.kinds, replayer.placement
        self.sent: list[Op | None] = [None] * len(kinds)
        self.received: list[Op | None] = [None] * len(kinds)
        self.consumer_stage = [-1] * len(kinds)
        kind_index = {kind: k for k, kind in enumerate(kinds)}
        split, rank_of = any(op is Op.I for _, op in kinds), placement.stage_to_rank
        to_ranks: dict[int, dict[int, list]] = {}  # producer's rank -> consumer's rank -> ops
        for kind, (stage, op) in enumerate(kinds):
            for dep in producers(Action(stage, op, 0), placement, split):
                dep_kind = kind_index.get((dep.stage, dep.op))
                if rank_of[dep.stage] == rank_of[stage] or dep_kind is None:
                    continue
                if self.sent[dep_kind] is not None:  # two consumers: none of the fast path
                    to_ranks = None
                self.sent[dep_kind], self.received[kind] = comm_ops(dep)
                self.consumer_stage[dep_kind] = stage
                if to_ranks is not None:
                    by_consumer = to_ranks.setdefault(rank_of[dep.stage], {})
                    ops = by_consumer.setdefault(rank_of[stage], [None] * len(kinds))
                    ops[dep_kind] = self.received[kind]
        self.receives = [int(op is not None) for op in self.received]
        self.to_ranks = (
            None
            if to_ranks is None
            else [list(to_ranks.get(rank, {}).items()) for rank in range(placement.ranks)]
        )
