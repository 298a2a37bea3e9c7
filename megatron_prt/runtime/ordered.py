"""Receives posted early under NCCL's ordering, and a checker of that ordering (stdlib only).

NCCL semantics, as modelled here (:func:`nccl_stuck`): a rank's program is its lowered
stream, each maximal run of consecutive SEND/RECV actions one batch
(``batch_isend_irecv``, as the executor issues it). The host never blocks on a batch; it
blocks only before a compute whose tensor input another rank sends, until the batch holding
that RECV has completed. The batches of one rank run one after the other on its
communication stream, in the order posted. A running batch completes once every one of
its operations has its counterpart in a batch that is running (or done) on the peer: per
ordered pair of ranks, the k-th SEND matches the k-th RECV. A RECV posted early therefore
holds back every later SEND of its rank until its own sender has reached it.

The rule (:func:`post_recvs_early`, megatron's ``overlap_p2p_comm``): each RECV moves back
over the compute before it, into the batch of the compute before that, i.e. the receive
for the next compute is posted with the sends of the current one, and its transfer runs
while the current compute does; it never joins the batch holding the input of the compute
it jumps (that compute would wait for it), never passes a RECV from the same sender (the pairing
above), never moves when its producer needs that compute or a later one of the rank (a
certain deadlock), and is kept only if the whole plan still completes under
:func:`nccl_stuck`: all moves are tried at once, then, if that deadlocks, one by one in
plan order, each kept if the plan with it still completes (the cost: one check per receive).
"""

from __future__ import annotations

from dataclasses import replace

from ..core.actions import Action, Op
from ..core.deps import producers
from ..core.lower import message_ends, message_key
from ..core.plan import Plan

_SENDS, _RECVS = (Op.SEND_F, Op.SEND_B), (Op.RECV_F, Op.RECV_B)
# Messages of a plan up to which the runtime runs the pass by default on NCCL: the
# one-by-one check costs receives x plan length (about 7 s at 2000 messages: P=8, R=2, m=32).
EARLY_RECVS_AUTO = 2048


def _ends(plan: Plan) -> dict[Action, tuple[int, int, tuple, Action]]:
    """Per comm action (on its rank): (sender rank, receiver rank, message key, consumer,
    producer)."""
    placement, split = plan.placement, plan.split_backward
    rank_of, found = placement.rank_of, {}
    for stream in plan.ranks:
        for action in stream:
            if not action.op.is_compute and action not in found:
                producer, consumer = message_ends(action, placement, split)
                key = message_key(producer, consumer)
                sender, receiver = rank_of(producer.stage), rank_of(consumer.stage)
                found[action] = (sender, receiver, key, consumer, producer)
    return found


def nccl_stuck(plan: Plan, ends: dict | None = None) -> dict[int, str]:
    """Run the lowered ``plan`` under NCCL's ordering (module docstring); return, per rank
    that cannot finish, where it stands (empty: the plan completes). Raises ``ValueError``
    if the k-th SEND and k-th RECV of a rank pair carry different messages."""
    return {
        rank: f"host at {host or 'its end'}, stream at batch {batch or 'its end'}"
        for rank, (host, batch) in _stuck(plan, ends if ends is not None else _ends(plan)).items()
    }


def _stuck(plan: Plan, ends: dict) -> dict[int, tuple]:
    """Per rank that cannot finish: (the compute its host waits at or None, the batch its
    stream waits at or None)."""
    batches: list[list[list[Action]]] = []  # rank -> its batches, in posting order
    programs: list[list[tuple]] = []  # rank -> ("C", action) | ("B", batch index)
    for stream in plan.ranks:
        mine, program = [], []
        for action in stream:
            if action.op.is_compute:
                program.append(("C", action))
            elif program and program[-1][0] == "B":
                mine[-1].append(action)
            else:
                mine.append([action])
                program.append(("B", len(mine) - 1))
        batches.append(mine)
        programs.append(program)
    where_recv, partner = _pair(plan, batches, ends)
    ranks = range(len(plan.ranks))
    pc, posted, head = [0] * len(ranks), [0] * len(ranks), [0] * len(ranks)
    progress = True
    while progress:
        progress = False
        for r in ranks:  # hosts: post batches, run computes whose input has arrived
            while pc[r] < len(programs[r]):
                kind, item = programs[r][pc[r]]
                if kind == "B":
                    posted[r] += 1
                elif item in where_recv and where_recv[item] >= head[r]:
                    break
                pc[r] += 1
                progress = True
        running = [head[r] if head[r] < posted[r] else -1 for r in ranks]
        done = [
            running[r] >= 0
            and all(running[q] == b or head[q] > b for q, b in partner[r][running[r]])
            for r in ranks
        ]
        for r in ranks:  # batches whose every counterpart runs complete together
            if done[r]:
                head[r] += 1
                progress = True
    return {
        r: (
            programs[r][pc[r]][1] if pc[r] < len(programs[r]) else None,
            batches[r][head[r]] if head[r] < len(batches[r]) else None,
        )
        for r in ranks
        if pc[r] < len(programs[r]) or head[r] < len(batches[r])
    }


def _pair(plan: Plan, batches, ends) -> tuple[dict, list]:
    """(consumer action -> index of the batch holding its RECV on the consumer's rank,
    per rank per batch the (peer rank, peer batch) of each operation's counterpart)."""
    sent: dict[tuple, list] = {}  # (sender, receiver) -> [(batch, key)] in order
    got: dict[tuple, list] = {}
    where_recv = {}
    for mine in batches:
        for index, batch in enumerate(mine):
            for action in batch:
                src, dst, key, consumer, _ = ends[action]
                if action.op in _SENDS:
                    sent.setdefault((src, dst), []).append((index, key))
                else:
                    got.setdefault((src, dst), []).append((index, key))
                    where_recv[consumer] = index
    partner = [[[] for _ in mine] for mine in batches]
    for pair, sends in sent.items():
        recvs = got.get(pair, [])
        if [k for _, k in sends] != [k for _, k in recvs]:
            raise ValueError(f"ranks {pair}: sends {sends} and receives {recvs} do not pair up")
        src, dst = pair
        for (send_batch, _), (recv_batch, _) in zip(sends, recvs, strict=True):
            partner[src][send_batch].append((dst, recv_batch))
            partner[dst][recv_batch].append((src, send_batch))
    return where_recv, partner


def post_recvs_early(plan: Plan) -> Plan:
    """``plan`` (lowered) with each RECV moved as early as the rule in the module docstring
    allows; the result completes under :func:`nccl_stuck` whenever ``plan`` does."""
    if not plan.lowered:
        raise ValueError("post_recvs_early takes a lowered plan (core.lower.lower)")
    ends = _ends(plan)
    moves = _causal_moves(plan, ends)
    streams = [list(stream) for stream in plan.ranks]
    for rank, stream in enumerate(streams):
        for action in plan.ranks[rank]:
            if (rank, action) in moves:
                _hoist(stream, action, ends)
    if not _stuck(_with(plan, streams), ends):
        return _with(plan, streams)
    streams = [list(stream) for stream in plan.ranks]
    for rank, stream in enumerate(plan.ranks):  # one by one, keeping those that stay safe
        for action in stream:
            trial = list(streams[rank])
            if (rank, action) in moves and _hoist(trial, action, ends):
                candidate = [*streams[:rank], trial, *streams[rank + 1 :]]
                if not _stuck(_with(plan, candidate), ends):
                    streams = candidate
    return _with(plan, streams)


def _causal_moves(plan: Plan, ends: dict) -> set[tuple[int, Action]]:
    """The (rank, RECV) pairs whose message's producer needs none of the rank's computes from
    the one the RECV would jump on: else the early receive would hold back, on the rank's
    stream, a send its own sender waits for (a certain deadlock, found without the check)."""
    placement, split = plan.placement, plan.split_backward
    streams = [plan.compute_actions(rank) for rank in range(placement.ranks)]
    index = {a: i for stream in streams for i, a in enumerate(stream)}
    needs: dict[Action, list[int]] = {}  # per compute: the last compute of each rank it needs
    pos = [0] * len(streams)
    moved = True
    while moved:  # in an order where producers come first
        moved = False
        for rank, stream in enumerate(streams):
            while pos[rank] < len(stream):
                action = stream[pos[rank]]
                inputs = producers(action, placement, split)
                if any(p not in needs for p in inputs):
                    break
                before = [*inputs, stream[pos[rank] - 1]] if pos[rank] else inputs
                last = [max(col) for col in zip(*(needs[p] for p in before), strict=True)]
                last = last or [-1] * len(streams)
                for p in inputs:
                    last[placement.rank_of(p.stage)] = max(
                        last[placement.rank_of(p.stage)], index[p]
                    )
                last[rank] = pos[rank]
                needs[action] = last
                pos[rank] += 1
                moved = True
    found = set()
    for rank, stream in enumerate(plan.ranks):
        jumped = None
        for action in stream:
            if action.op.is_compute:
                jumped = action
            elif action.op in _RECVS and jumped is not None:
                if needs[ends[action][4]][rank] < index[jumped]:
                    found.add((rank, action))
    return found


def _hoist(stream: list[Action], recv: Action, ends) -> bool:
    """Move ``recv`` in place to just before the compute preceding it, not past a RECV from
    the same sender, and not into the batch that compute waits on for its own input (the
    executor waits on a whole batch); whether it moved."""
    at = stream.index(recv)
    computes = [i for i in range(at) if stream[i].op.is_compute]
    if not computes:
        return False
    target = computes[-1]
    batch = range(computes[-2] + 1 if len(computes) > 1 else 0, target)
    if any(stream[i].op in _RECVS and ends[stream[i]][3] == stream[target] for i in batch):
        return False  # that compute waits on the batch: the early receive would delay it
    sender = ends[recv][0]
    for i in range(target, at):
        if stream[i].op in _RECVS and ends[stream[i]][0] == sender:
            target = i + 1
    if target >= at:
        return False
    stream.insert(target, stream.pop(at))
    return True


def _with(plan: Plan, streams: list[list[Action]]) -> Plan:
    return replace(plan, ranks=tuple(map(tuple, streams)))
