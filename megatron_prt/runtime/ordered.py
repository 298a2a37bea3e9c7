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
certain deadlock), and never crosses the order of another pair of ranks ([Note: pairwise
order]). The moves are kept only if the whole plan then completes under :func:`nccl_stuck`;
where it does not ([Note: repair]), the moves into the batches it is stuck at are undone,
until it does.
"""

from __future__ import annotations

from dataclasses import replace

from ..core.actions import Action, Op
from ..core.deps import producers
from ..core.lower import message_ends, message_key
from ..core.plan import Plan

_SENDS, _RECVS = (Op.SEND_F, Op.SEND_B), (Op.RECV_F, Op.RECV_B)
# Messages of a plan up to which the runtime runs the pass by default on NCCL (its cost
# grows with the moves the whole-plan check refuses: P=16, R=4 loop/uni, m=64, 8064
# messages, 6.6 CPU s; wave and bi plans far less); above, early_recvs=True opts in.
EARLY_RECVS_AUTO = 8192


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
    allows; the result completes under :func:`nccl_stuck` whenever ``plan`` does.

    The moves kept are those of trying each in plan order and keeping it if the plan with it
    still completes; found with a few :func:`nccl_stuck` runs per move that the pairwise
    rule lets through and the whole plan refuses ([Note: repair]), not one per receive."""
    if not plan.lowered:
        raise ValueError("post_recvs_early takes a lowered plan (core.lower.lower)")
    ends = _ends(plan)
    moves, ok = _causal_moves(plan, ends), 0
    while True:
        kept = _in_step_moves(plan, ends, moves)
        early = _apply(plan, set(kept), ends)
        if not _stuck(early, ends):
            return early
        # [Note: repair] a cycle through three or more ranks, or through a host's wait,
        # which the pairwise rule cannot see. The first k moves complete (k >= ok: the
        # moves before the last refused one are the same as last round), all of them do
        # not: bisect for the first move that makes the plan stick, and refuse it.
        stuck_at = len(kept)
        while stuck_at - ok > 1:
            mid = (ok + stuck_at) // 2
            if _stuck(_apply(plan, set(kept[:mid]), ends), ends):
                stuck_at = mid
            else:
                ok = mid
        moves.discard(kept[stuck_at - 1])
        ok = stuck_at - 1


def _apply(plan: Plan, moves: set[tuple[int, Action]], ends: dict) -> Plan:
    streams = [list(stream) for stream in plan.ranks]
    for rank, stream in enumerate(streams):
        # a receive only moves back, so the i-th original action is still at index i
        for at, action in enumerate(plan.ranks[rank]):
            if (rank, action) in moves and (target := _hoist_target(stream, at, ends)) is not None:
                stream.insert(target, stream.pop(at))
    return _with(plan, streams)


def _in_step_moves(plan: Plan, ends: dict, moves: set) -> list[tuple[int, Action]]:
    """The ``moves``, tried in plan order, kept (in that order) where every pair of ranks
    stays in step.

    [Note: pairwise order] Number a rank's batches by the computes before them (its
    *slot*). Between ranks r and q, if r's batch i pairs with q's batch j and r's later
    batch i' > i with q's earlier batch j' < j, the plan deadlocks: i waits for j to run,
    j for j' to finish, j' for i' to run, i' for i to finish. A receive moved from slot s to
    s - 1 on r, paired with slot t on q, creates such a crossing exactly when an operation
    left in r's slot s talks to q at a slot below t, so that is the only check."""
    slot, partner = _slots_and_partners(plan, ends)
    in_slot: dict[tuple[int, int], list[Action]] = {}
    for (rank, action), at in slot.items():
        in_slot.setdefault((rank, at), []).append(action)
    kept = []
    for rank, stream in enumerate(plan.ranks):
        trial = list(stream)
        for at, action in enumerate(stream):  # (index stays valid: see _apply)
            if (rank, action) not in moves:
                continue
            if (target := _hoist_target(trial, at, ends)) is None:
                continue
            s, (peer, send) = slot[rank, action], partner[rank, action]
            left = [a for a in in_slot[rank, s] if a is not action]
            if any(
                partner[rank, a][0] == peer and slot[partner[rank, a]] < slot[peer, send]
                for a in left
            ):
                continue
            trial.insert(target, trial.pop(at))
            in_slot[rank, s] = left
            in_slot.setdefault((rank, s - 1), []).append(action)
            slot[rank, action] = s - 1
            kept.append((rank, action))
    return kept


def _slots_and_partners(plan: Plan, ends: dict) -> tuple[dict, dict]:
    """(per (rank, comm action): the computes before it on its rank; per (rank, comm
    action): (peer rank, the matching action there), the k-th SEND of a rank pair to its
    k-th RECV)."""
    slot, queues = {}, {}
    for rank, stream in enumerate(plan.ranks):
        computes = 0
        for action in stream:
            if action.op.is_compute:
                computes += 1
                continue
            slot[rank, action] = computes
            src, dst = ends[action][:2]
            queues.setdefault((src, dst, action.op in _SENDS), []).append((rank, action))
    partner = {}
    for (src, dst, is_send), ops in queues.items():
        if not is_send:
            continue
        recvs = queues.get((src, dst, False), [])
        if [ends[a][2] for _, a in ops] != [ends[a][2] for _, a in recvs]:
            raise ValueError(f"ranks {(src, dst)}: sends and receives do not pair up")
        for send, recv in zip(ops, recvs, strict=True):
            partner[send], partner[recv] = recv, send
    return slot, partner


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


def _hoist_target(stream: list[Action], at: int, ends) -> int | None:
    """Where the RECV at ``stream[at]`` moves: just before the compute preceding it, not
    past a RECV from the same sender, and not into the batch that compute waits on for its
    own input (the executor waits on a whole batch); None where it stays."""
    computes = []
    for i in range(at - 1, -1, -1):  # the last two computes before it
        if stream[i].op.is_compute:
            computes.append(i)
            if len(computes) == 2:
                break
    if not computes:
        return None
    target = computes[0]
    batch = range(computes[1] + 1 if len(computes) > 1 else 0, target)
    if any(stream[i].op in _RECVS and ends[stream[i]][3] == stream[target] for i in batch):
        return None  # that compute waits on the batch: the early receive would delay it
    sender = ends[stream[at]][0]
    for i in range(target, at):
        if stream[i].op in _RECVS and ends[stream[i]][0] == sender:
            target = i + 1
    return target if target < at else None


def _with(plan: Plan, streams: list[list[Action]]) -> Plan:
    return replace(plan, ranks=tuple(map(tuple, streams)))
