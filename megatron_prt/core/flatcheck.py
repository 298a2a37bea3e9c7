"""The full check of a plan on flat integer lists: a quick, independent yes.

:func:`megatron_prt.core.validate.validate` asks :func:`passes` first. It re-derives every
condition from the actions and the dependency rule (:func:`megatron_prt.core.deps.producers`,
:func:`megatron_prt.core.lower.message_ends`, asked once per kind of action), trusting no
mark a producer left on the plan; only when it says no do the action-by-action checks run,
to find and name the fault. See [Note: flat check].

[Note: flat check]
Every action of kind ``(stage, op)``, numbered ``kind = stage * len(ops) + slot`` (``ops``:
the ops the plan holds, ``slot``: the op's place among them), sets the entry of its
micro-batch in its kind's *row* ``where[kind]`` (-1 where absent) to its position ``i`` on
its rank; every row's actions are on the kind's stage's rank. The dependency rule never
crosses micro-batches, so an edge "producer kind -> consumer kind" is a pair of rows
compared element by element, and rows are only ever compared on one rank (a SEND names its
producer's stage, a RECV its consumer's). The positions are one int object per position,
shared by all ranks: few enough to stay in cache while rows are read and compared. The
checks:

* exactly once, right rank, right pipeline: whole-list comparisons and one count of the
  filled entries of ``where`` (as many as the plan has actions: no two share an entry);
* a producer on the consumer's rank: ``producer row <= consumer row`` (an earlier position
  on one rank is an earlier step; -1 <= -1 where a micro-batch skips the stage);
* a producer on another rank: the replay. Each rank runs its actions in order while their
  remote producers are done; a rank that waits parks on the rank it waits for and is woken
  when that rank moves. Local producers need no check there (they precede on the rank).
  The replay's outcome does not depend on the order ranks are taken in (an action that can
  run stays runnable until it runs), so "every rank finishes" is the close check's verdict.

A lowered plan adds the SEND/RECV rows: every message (a consumer with a remote producer)
has exactly one SEND, after its producer on the producer's rank, and one RECV, before its
consumer on the consumer's rank, and there are no other SEND/RECV actions. Then a compute
action never blocks under :mod:`megatron_prt.core.rendezvous`'s rule (its local producers
and its RECV precede it on its rank), so only the SEND/RECV pairs can, and the replay walks
pairs (see [Note: pairs only]). It also proves the compute order (producer, SEND = RECV,
consumer is a path in time). A SEND before its producer is refused by both (the close
checks' blocking replay makes a SEND wait for its producer and names it;
:func:`megatron_prt.core.lower.lower` never writes one, zero-time stages included).

[Note: pairs only]
In a lowered plan that passed the row checks, ``pairs`` gives every SEND and its RECV one
number of their own (one to one: each message fills one slot of one SEND row and one of one
RECV row, no two actions share an entry of ``where``, and the SEND/RECV count is twice the
message count), the two on different ranks (``_carriers`` refuses a same-rank carrier), and
compute actions never block. A pair completes when both ranks stand at it
(:mod:`megatron_prt.core.rendezvous`: a SEND and its RECV complete together), so compute
actions need no step of their own in the replay: each rank walks its SEND/RECV numbers
only. :func:`_pairs_complete` runs it with no parking: the first rank to reach a pair
stands there and stops; the rank that reaches the other end later finds it standing,
completes the pair, hands the first back to the loop (its walk goes on past the pair) and
walks on. Every rank that stops stands at a SEND/RECV (a rank handed back is in the loop
again), so no pair whose two ranks both stand at it is ever left behind, and no pair
completes unless both stood at it: the run completes exactly the pairs the rule can
complete, in some order, and which order does not matter (a pair that can complete stays
so until it does).

[Note: a lowering's check covers its plan]
:func:`lowering_passes` decides "``plan`` and ``lowered`` both pass" from ``lowered``'s flat
check plus one comparison: ``plan`` is a compute plan of the same placement, micro-batch count
and split, and each of its ranks holds, in order, the compute actions of that rank of
``lowered``: equal stages, ops and micro-batches, ``plan``'s of exact types (an op given as
its string, or a micro-batch as the float ``1.0``, would compare equal; :func:`_exact_types`).
Compared column by column (:mod:`megatron_prt.core.columns`) as one sequence, rank after rank
(plus the first and last action of each rank of ``plan`` being of that rank's stages:
``lowered``'s compute actions are on their stages' ranks, so the sequence is rank 0's block,
then rank 1's, and a rank of ``plan`` that starts and ends inside its own block is that
block). Every check of
``plan`` then holds because ``lowered`` passed it: the shape checks and exactly-once read
the same compute actions (comm actions are extra rows, never counted as compute); a
producer on the consumer's rank precedes it on both; and a producer on another rank comes
before its SEND, the SEND completes with its RECV, the RECV precedes the consumer, so the
order in which ``lowered``'s blocking replay completes, restricted to compute actions,
runs every rank of ``plan`` in its order with each action after its producers: ``plan``'s
replay finishes (its outcome does not depend on the order ranks are taken in). When the
comparison fails nothing is assumed: ``plan`` is checked on its own.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from itertools import chain, compress, islice, repeat
from operator import getitem, itemgetter, le, ne, setitem

from .actions import Action, Op
from .columns import columns, join
from .deps import producers
from .lower import message_ends
from .placement import Placement
from .plan import Plan

_COMPUTE = (Op.F, Op.B, Op.I, Op.W)
_COMPUTE_SET = frozenset(_COMPUTE)
_SENDS = (Op.SEND_F, Op.SEND_B)


def passes(plan: Plan) -> bool:
    """True when ``plan`` passes every check of
    :func:`~megatron_prt.core.validate.validate`; False says only that a closer look is
    needed (it may still pass). Linear in the plan, mostly in C-level list passes."""
    return _passing(plan) is not None


def lowering_passes(plan: Plan, lowered: Plan) -> bool:
    """True when both ``plan`` and ``lowered`` pass every check of
    :func:`~megatron_prt.core.validate.validate`, decided from ``lowered``'s check alone
    when ``lowered`` holds ``plan``'s compute actions themselves (see [Note: a lowering's
    check covers its plan]); False says only that a closer look is needed."""
    flat = _passing(lowered)
    if flat is None or not lowered.lowered or plan.lowered:
        return False
    if (plan.placement, plan.num_microbatches, plan.mb_pipeline) != (
        lowered.placement,
        lowered.num_microbatches,
        lowered.mb_pipeline,
    ):
        return passes(plan)
    if len(plan.ranks) != len(lowered.ranks) or sum(map(len, plan.ranks)) != flat.computes:
        return passes(plan)
    per_rank = list(map(columns, plan.ranks))
    mine = join(per_rank)
    if not _exact_types(*mine):
        return passes(plan)
    computes = list(map(_COMPUTE_SET.__contains__, flat.op_of))
    made = (list(compress(column, computes)) for column in flat.columns)
    if any(map(ne, made, mine)):
        return passes(plan)
    # the same sequence, rank after rank; lowered's runs rank 0's stages first, then rank
    # 1's...: a plan rank whose first and last action are of its own stages is that block
    rank_of = plan.placement.stage_to_rank
    ends = ((rank, own[0][0], own[0][-1]) for rank, own in enumerate(per_rank) if own[0])
    if all(rank_of[first] == rank == rank_of[last] for rank, first, last in ends):
        return True
    return passes(plan)


def _exact_types(stages: list, ops: list, mbs: list) -> bool:
    """Every stage and micro-batch an ``int`` and every op an :class:`Op`, not merely equal
    to one: an op given as its string equals its Op (the flat check refuses it, the close
    checks decide), a micro-batch ``1.0`` equals 1 (refused); a ``bool`` the flat check
    passes as the int it equals, and so does this."""
    return set(map(type, ops)) == {Op} and set(map(type, stages)) | set(map(type, mbs)) == {int}


def _passing(plan: Plan) -> _Flat | None:
    """The flat plan when ``plan`` passes (:func:`passes`), else None."""
    try:
        flat = _Flat.of(plan)
    except (IndexError, KeyError, TypeError):  # a stage out of range or on another rank
        return None
    if flat is None or not flat.local_order_holds():
        return None
    if plan.lowered:
        pairs = flat.message_pairs()
        done = pairs is not None and _pairs_complete(*pairs)
    else:
        done = _replay_completes(*flat.remote_needs())
    return flat if done else None


class _Flat:
    """A plan as integer rows, one per kind of action, holding positions on the rank (see
    [Note: flat check]). Kinds are numbered ``stage * len(ops) + slot``, slot the op's place
    among the ops the plan holds (``slot``), so ``where`` has one row per kind the plan
    could hold."""

    def __init__(self, plan: Plan, n: int, ops: list[Op]) -> None:
        self.plan, self.placement, self.m = plan, plan.placement, plan.num_microbatches
        self.n, self.ops = n, ops
        self.slot = {op: k for k, op in enumerate(ops)}
        self.lengths = list(map(len, plan.ranks))
        self.split = Op.I in ops
        self.kinds_per_pipeline = self.placement.depth * len(ops)
        self.lanes = [(0, 1)] * self.placement.num_pipelines  # see row
        if self.split:
            self.compute_ops = (Op.F, Op.I, Op.W)
        else:
            self.compute_ops = (Op.F, Op.B) if {Op.B, Op.W} & set(ops) else (Op.F,)

    def kind(self, stage: int, op: Op) -> int | None:
        """The kind of ``(stage, op)``, None when the plan has no ``op`` at all."""
        slot = self.slot.get(op)
        return None if slot is None else stage * len(self.ops) + slot

    def row(self, kind: int | None) -> list[int]:
        """Position on its rank of the action of ``kind`` per micro-batch of its stage's pipeline
        (-1: none), in micro-batch order: a strided slice of the whole row when every
        pipeline's micro-batches are evenly spaced (:attr:`Plan.lanes`; bi's two pipelines
        take turns), the whole row otherwise. The rest of the row is -1
        (``_pipelines_match``), so every comparison of rows and every count of -1 entries
        gives the verdict whole rows would, on half the entries for bi."""
        if kind is None:
            return [-1] * self.m
        start, step = self.lanes[kind // self.kinds_per_pipeline]
        row = self.where[kind]
        return row if (start, step) == (0, 1) else row[start::step]  # read, never written

    @classmethod
    def of(cls, plan: Plan) -> _Flat | None:
        """The flat plan, or None when a shape check fails: rank count, a pipeline per
        micro-batch, stage and micro-batch in range, every action on its stage's rank and
        its micro-batch's pipeline, no action twice, comm only if lowered, the compute
        actions exactly those the plan needs."""
        placement, m = plan.placement, plan.num_microbatches
        if len(plan.ranks) != placement.ranks or len(plan.mb_pipeline) != m:
            return None
        per_rank = list(map(columns, plan.ranks))  # see [Note: columnar ranks]
        stages, op_of, mbs = flat_columns = join(per_rank)
        if not mbs or min(mbs) < 0:  # one past the last: an IndexError below
            return None
        if set(map(type, op_of)) != {Op}:  # "F" equals Op.F and hashes alike: not enough
            return None
        present = set(op_of)  # Op hashes as its str value: fast
        ops = [op for op in Op if op in present]
        if len(ops) != len(present) or (not plan.lowered and not present <= set(_COMPUTE)):
            return None  # an op that is no Op, or communication in a plan not lowered
        if min(stages) < 0:
            return None
        # each action's row: its stage's table (a rank's are None but at its own stages, so
        # a stage of another rank is a TypeError and one past the last an IndexError; a
        # negative one would wrap), then its op's row there; its micro-batch's entry there
        # is set below (one past the last: an IndexError). Rows are plain lists: reading a
        # list hands out the int it holds, where an array makes a new one per read
        flat = cls(plan, len(mbs), ops)
        flat.columns = flat_columns
        where = flat.where = [[-1] * m for _ in range(placement.num_stages * len(ops))]
        rows = map(
            getitem,
            chain.from_iterable(
                map(_stage_tables(placement, rank, ops, where).__getitem__, own[0])
                for rank, own in enumerate(per_rank)
            ),
            op_of,
        )
        return flat if flat._complete(rows, mbs, op_of) and flat._pipelines_match() else None

    def _complete(self, rows: Iterable[list[int]], mbs: list[int], op_of: list[Op]) -> bool:
        """Every action's entry (its row, at its micro-batch) set to its position, no entry
        twice; compute ops one of F | F, B | F, I, W; every needed action there."""
        m, n, compute_ops = self.m, self.n, self.compute_ops
        if not set(self.ops) & set(_COMPUTE) <= set(compute_ops):
            return False
        # positions on the rank, one int object each for all ranks (see [Note: flat check])
        positions = list(range(max(self.lengths)))
        per_rank = map(getitem, repeat(positions), map(slice, self.lengths))
        deque(map(setitem, rows, mbs, chain.from_iterable(per_rank)), maxlen=0)
        if len(self.where) * m - sum(map(list.count, self.where, repeat(-1))) != n:
            return False
        if self.plan.lowered:  # every op is an Op (of) and the compute ones of compute_ops
            self.computes = sum(map(op_of.count, compute_ops))
            self.op_of = op_of  # lowering_passes picks the compute actions by it
        else:  # a plan not lowered holds compute actions only (of), all of compute_ops
            self.computes = n
        return self.computes == m * self.placement.depth * len(compute_ops)

    def _pipelines_match(self) -> bool:
        """Every stage's actions are of micro-batches of its pipeline: in each row of a
        stage, the other pipelines' micro-batches are absent (a strided slice of the row
        when they are evenly spaced, as ``split_microbatches`` makes them)."""
        placement, per_stage = self.placement, len(self.ops)
        if placement.num_pipelines == 1:
            return True
        self.lanes = self.plan.lanes or self.lanes  # else whole rows
        for pipeline, stages in enumerate(placement.pipelines):
            others = [mb for mb, p in enumerate(self.plan.mb_pipeline) if p != pipeline]
            if not others:
                continue
            step = others[1] - others[0] if len(others) > 1 else 1
            if others == list(range(others[0], others[-1] + 1, step)):
                pick = itemgetter(slice(others[0], others[-1] + 1, step))
            else:
                pick = itemgetter(*others, others[0])  # always a tuple
            absent = pick([-1] * self.m)
            for kind in range(stages[0] * per_stage, (stages[-1] + 1) * per_stage):
                if pick(self.where[kind]) != absent:
                    return False
        return True

    def _edges(self) -> list[tuple[int, int, bool]]:
        """(producer kind, consumer kind, crosses ranks) of every compute kind, from the
        dependency rule asked once per kind."""
        placement, rank_of, split = self.placement, self.placement.stage_to_rank, self.split
        edges = []
        for stage in range(placement.num_stages):
            for op in self.compute_ops:
                for dep in producers(Action(stage, op, 0), placement, split):
                    crosses = rank_of[dep.stage] != rank_of[stage]
                    edges.append((self.kind(dep.stage, dep.op), self.kind(stage, op), crosses))
        return edges

    def local_order_holds(self) -> bool:
        """Every producer on its consumer's rank comes before it there; False too when a
        kind has two producers on other ranks (one wait per action is all the replay
        holds; the dependency rule gives at most one today, the close checks decide else)."""
        self.edges = self._edges()
        remote = [c for _, c, crosses in self.edges if crosses]
        if len(remote) != len(set(remote)):
            return False
        row = self.row
        return all(all(map(le, row(p), row(c))) for p, c, crosses in self.edges if not crosses)

    def remote_needs(self) -> tuple[list[list[int]], list[list[int]], list[int]]:
        """Per rank, per action: the position of its producer on another rank (-1: none)
        and that rank (its stage's rank, as ``of`` checked; the rank count: none), each
        with one spare entry last, where the absent (-1) entries of a row land; and the
        rank lengths."""
        rank_of, per_stage, ranks = self.placement.stage_to_rank, len(self.ops), len(self.lengths)
        needs = [[-1] * (length + 1) for length in self.lengths]
        afters = [[ranks] * (length + 1) for length in self.lengths]
        for producer, consumer, crosses in self.edges:
            if crosses:
                consumers, rank = self.row(consumer), rank_of[consumer // per_stage]
                _scatter(needs[rank], consumers, self.row(producer))
                _scatter(afters[rank], consumers, repeat(rank_of[producer // per_stage]))
        return needs, afters, self.lengths

    def _carriers(self) -> dict[tuple[int, int, bool], int] | None:
        """(producer kind, consumer kind, sends) -> the SEND (sends) or RECV kind carrying
        that edge (:func:`message_ends`, asked once per kind); None if the plan holds one
        that carries no one tensor across ranks."""
        carrier, rank_of = {}, self.placement.stage_to_rank
        for stage in range(self.placement.num_stages):
            for op in (op for op in self.ops if op.is_comm):
                kind = self.kind(stage, op)
                try:
                    ends = message_ends(Action(stage, op, 0), self.placement, self.split)
                except ValueError:
                    ends = None
                # a kind that carries no one tensor, or hands one over on its rank (no
                # message needed: the close look), is refused when the plan holds it; a
                # kind that would carry one is kept even when absent: its edge's check
                # then finds no SEND or RECV there
                if ends is None or rank_of[ends[0].stage] == rank_of[ends[1].stage]:
                    row = self.row(kind)
                    if row.count(-1) != len(row):
                        return None
                    continue
                edge = tuple(self.kind(end.stage, end.op) for end in ends)
                carrier[(*edge, op in _SENDS)] = kind
        return carrier

    def message_pairs(self) -> tuple[list[list[int]], int] | None:
        """Per rank, per action of a lowered plan (plus one spare entry last, where the
        absent -1 entries of a row land): the number of its message for a SEND or RECV, the
        same for both, 0 for a compute action; and one past the last number. Given that every
        message has its SEND after the producer and its RECV before the consumer and there
        are no other SEND/RECV actions (else None): then the numbers pair the plan's
        SEND/RECV actions one to one."""
        carrier, row = self._carriers(), self.row
        if carrier is None:
            return None
        rank_of, per_stage = self.placement.stage_to_rank, len(self.ops)
        pairs = [[0] * (length + 1) for length in self.lengths]
        messages, numbered = 0, 1
        for producer, consumer, crosses in self.edges:
            if not crosses:
                continue
            sent = carrier.get((producer, consumer, True))
            received = carrier.get((producer, consumer, False))
            if sent is None or received is None:
                return None
            sends, receives, consumers = row(sent), row(received), row(consumer)
            if not (all(map(le, row(producer), sends)) and all(map(le, receives, consumers))):
                return None
            # a message is all there or all absent (every compute action is there): else a
            # lone SEND would share its number with the spare entry. The SENDs are: there
            # where the producer is (>= it), absent at the other pipelines' micro-batches
            # (_pipelines_match), so only the RECVs need counting
            absent = consumers.count(-1)
            if receives.count(-1) != absent:
                return None
            messages += len(consumers) - absent
            numbers = range(numbered, numbered + len(sends))
            numbered += len(sends)
            _scatter(pairs[rank_of[sent // per_stage]], sends, numbers)
            _scatter(pairs[rank_of[received // per_stage]], receives, numbers)
        return (pairs, numbered) if 2 * messages == self.n - self.computes else None


def _scatter(target: list[int], indices: Iterable[int], values: Iterable[int]) -> None:
    """``target[i] = v`` for each pair, at C speed (``operator.setitem`` takes its arguments
    as they are; a bound ``list.__setitem__`` packs a tuple per call)."""
    deque(map(setitem, repeat(target), indices, values), maxlen=0)


def _stage_tables(
    placement: Placement, rank: int, ops: list[Op], rows: list[list[int]]
) -> list[dict[Op, list[int]] | None]:
    """Per stage: op -> its row (``rows[stage * len(ops) + slot]``) for the stages of
    ``rank``, None for the others."""
    tables: list[dict[Op, list[int]] | None] = [None] * placement.num_stages
    for stage in placement.rank_stages[rank]:
        tables[stage] = dict(zip(ops, rows[stage * len(ops) : (stage + 1) * len(ops)], strict=True))
    return tables


def _replay_completes(needs: list[list[int]], afters: list[list[int]], lengths: list[int]) -> bool:
    """Each rank runs its actions in order while ``needs[rank][i]``, a position on rank
    ``afters[rank][i]``, is done (-1 always is); a rank that waits parks on the rank it
    waits for, woken when that one moves. True when every rank finishes. One loop whose
    cost is the number of times a rank waits.

    Position ``j`` of rank ``r`` is done when ``r`` stands past it (``pos[r] > j``): no
    per-action mark to write as ranks move. ``afters`` names the rank count where there is
    no need: a rank that is always past every position."""
    ranks = len(lengths)
    pos = [0] * ranks + [max(lengths) + 1]
    waiting: list[list[int]] = [[] for _ in range(ranks)]  # rank -> ranks parked on it
    todo = list(range(ranks))
    next_rank = todo.pop  # todo grows in place (+=): the bound method stays its own
    while todo:
        rank = next_rank()
        need, after = needs[rank], afters[rank]
        first = i = pos[rank]
        end = lengths[rank]
        while i < end and pos[after[i]] > need[i]:
            i += 1
        if i > first:
            pos[rank] = i
            woken = waiting[rank]
            if woken:  # the list is kept and emptied: no new list per wake
                todo += woken
                woken.clear()
        if i < end:
            waiting[after[i]].append(rank)
    return pos[:-1] == lengths


def _pairs_complete(pairs: list[list[int]], numbered: int) -> bool:
    """The blocking replay of a lowered plan whose SEND/RECV actions ``pairs`` numbers
    (per rank, per action, one spare entry last; numbers below ``numbered``) in pairs
    across ranks, compute actions (0) never blocking: a pair completes when both ranks stand
    at it. True when every rank finishes (see [Note: pairs only]).

    Each rank walks its SEND/RECV numbers only (compute actions filtered out in C). The
    first rank to reach a pair stands there (``standing``) and stops; the second completes
    it, hands the first back to the loop and walks on. A rank's walk is an iterator, so a
    rank handed back goes on past the pair it stood at. One step per SEND/RECV and one per
    time a rank is taken up, no positions, no parking lists."""
    walks = [filter(None, islice(pair, len(pair) - 1)) for pair in pairs]
    standing = [-1] * numbered  # the rank standing at a pair, if one is
    todo = list(range(len(walks)))
    again, finished = todo.append, 0
    for rank in todo:  # grows while it is walked: each time a rank is handed back
        for number in walks[rank]:
            peer = standing[number]
            if peer < 0:
                standing[number] = rank
                break
            again(peer)
        else:
            finished += 1
    return finished == len(walks)
