"""A lowered plan replayed with blocking send/recv, compiled to integers.

The rule (:mod:`megatron_prt.core.validate` states it): a compute action waits until its
same-rank producers are done and the messages from its other producers are received; a SEND
waits until the compute that makes its tensor is done, then completes together with its
matching RECV, when the sender stands at the SEND and the receiver
at the RECV; a RECV never completes on its own. Producers come from
:func:`megatron_prt.core.deps.producers`, message identity from
:func:`megatron_prt.core.lower.message_key` and :func:`~megatron_prt.core.lower.message_ends`,
all asked once per kind of action (stage, op) and shifted to every micro-batch.

Every condition is a *token* ``base + mb`` in one byte array: a compute action's "done", a
message's "received", plus a block that is always set (no producer) and one that never is (a
producer no rank runs). A rank that waits parks on the token it waits for, or on the peer
whose RECV its SEND needs; so the replay is one pass over the actions.
"""

from __future__ import annotations

from operator import itemgetter

from .actions import Action, Op
from .deps import producers
from .lower import message_ends, message_key
from .plan import Plan

_KIND = itemgetter(0, 1)  # action -> (stage, op)
_MB = itemgetter(2)
_COMPUTE, _SEND, _RECV, _BAD = 0, 1, 2, 3  # _BAD: a SEND/RECV that carries no one tensor
_TYPE = {Op.SEND_F: _SEND, Op.SEND_B: _SEND, Op.RECV_F: _RECV, Op.RECV_B: _RECV}


class _Tables:
    """Per kind of action: its type, the token bases it waits on / sets, the SEND's peer."""

    def __init__(self, plan: Plan, kinds: list[tuple[int, Op]], mbs: int) -> None:
        placement, rank_of = plan.placement, plan.placement.stage_to_rank
        split = any(op is Op.I for _, op in kinds)
        kind_index = {kind: i for i, kind in enumerate(kinds)}
        self.always, self.never = 0, mbs  # token blocks [0, m) and [m, 2m)
        self.size = 2 * mbs + len(kinds) * mbs  # one block per kind: done or received
        messages: dict[tuple, int] = {}  # message (kind, from, to) -> token base

        def message_base(key: tuple) -> int:
            if key not in messages:
                messages[key] = self.size
                self.size += mbs
            return messages[key]

        self.type, self.need, self.own, self.peer = [], [], [], []
        self.errors: dict[int, ValueError] = {}  # kind -> why its SEND/RECV is malformed
        for i, (stage, op) in enumerate(kinds):
            own = 2 * mbs + i * mbs
            kind_type = _TYPE.get(op, _COMPUTE)
            need = [self.always, self.always]
            if kind_type == _COMPUTE:
                for slot, dep in enumerate(producers(Action(stage, op, 0), placement, split)):
                    if rank_of[dep.stage] != rank_of[stage]:
                        need[slot] = message_base(message_key(dep, Action(stage, op, 0))[:3])
                    elif (dep.stage, dep.op) in kind_index:
                        need[slot] = 2 * mbs + kind_index[dep.stage, dep.op] * mbs
                    else:
                        need[slot] = self.never
            peer_stage = stage
            if kind_type != _COMPUTE:  # a SEND or RECV sets the message's token
                try:
                    producer, consumer = message_ends(Action(stage, op, 0), placement, split)
                except ValueError as exc:
                    self.errors[i], kind_type = exc, _BAD
                else:
                    own = message_base(message_key(producer, consumer)[:3])
                    peer_stage = consumer.stage
                    if kind_type == _SEND:  # the tensor it sends must be made first
                        made = (producer.stage, producer.op)
                        need[0] = (
                            2 * mbs + kind_index[made] * mbs if made in kind_index else (self.never)
                        )
            self.type.append(kind_type)
            self.need.append(need)
            self.own.append(own)
            self.peer.append(rank_of[peer_stage])


def stuck_ranks(plan: Plan) -> dict[int, int]:
    """Replay ``plan``'s streams under blocking send/recv: ``{rank: step}`` for every rank
    that cannot finish (where it stands), empty when every rank does. Raises the
    ``ValueError`` of :func:`~megatron_prt.core.lower.message_ends` when a rank stops at a
    SEND or RECV that carries no one tensor.

    One loop over all actions on purpose (it is most of validating a lowered plan); local
    names keep it fast."""
    streams = plan.ranks
    kinds_of = [list(map(_KIND, acts)) for acts in streams]
    kinds = sorted(set().union(*kinds_of))
    kind_index = {kind: i for i, kind in enumerate(kinds)}
    kind_of = [list(map(kind_index.__getitem__, per_rank)) for per_rank in kinds_of]
    mb_of = [list(map(_MB, acts)) for acts in streams]
    mbs = max((max(per_rank, default=-1) for per_rank in mb_of), default=-1) + 1
    tables = _Tables(plan, kinds, mbs)
    kind_type, need, own, peer = tables.type, tables.need, tables.own, tables.peer
    done = bytearray(tables.size)
    done[: tables.always + mbs] = b"\x01" * mbs
    on_token: list[list[int] | None] = [None] * tables.size  # token -> ranks waiting for it
    on_rank: dict[int, list[int]] = {}  # rank -> senders waiting for it to reach a RECV
    pos = [0] * len(streams)
    todo = list(range(len(streams)))
    while todo:
        rank = todo.pop()
        kinds_here, mbs_here, i = kind_of[rank], mb_of[rank], pos[rank]
        end = len(kinds_here)
        while i < end:
            kind, mb = kinds_here[i], mbs_here[i]
            what = kind_type[kind]
            if what == _COMPUTE:
                first, second = need[kind]
                token = first + mb if not done[first + mb] else second + mb
                if not done[token]:
                    if on_token[token] is None:
                        on_token[token] = [rank]
                    else:
                        on_token[token].append(rank)
                    break
            elif what == _SEND:
                token = need[kind][0] + mb
                if not done[token]:  # its producer has not run (a plan read from a file)
                    if on_token[token] is None:
                        on_token[token] = [rank]
                    else:
                        on_token[token].append(rank)
                    break
                pos[rank] = i  # in case a malformed plan sends to its own rank
                token, receiver = own[kind] + mb, peer[kind]
                at = pos[receiver]
                theirs = kind_of[receiver]
                if not (
                    at < len(theirs)
                    and kind_type[theirs[at]] == _RECV
                    and own[theirs[at]] + mb_of[receiver][at] == token
                ):
                    on_rank.setdefault(receiver, []).append(rank)
                    break
                pos[receiver] = at + 1
                todo.append(receiver)
            elif what == _RECV:  # it waits for its SEND: wake the senders waiting for this rank
                todo += on_rank.pop(rank, ())
                break
            else:
                break
            token = own[kind] + mb
            done[token] = 1
            if on_token[token] is not None:
                todo += on_token[token]
                on_token[token] = None
            i += 1
        pos[rank] = i
    stuck = {rank: at for rank, at in enumerate(pos) if at < len(streams[rank])}
    for rank, at in stuck.items():
        if kind_type[kind_of[rank][at]] == _BAD:
            raise tables.errors[kind_of[rank][at]]
    return stuck
