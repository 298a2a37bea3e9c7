"""Event-driven list scheduling: turns a policy into per-rank compute orders.

The generator replays time with :class:`StageTimes`: whenever a rank is idle it starts the
best *ready* action its policy admits. Readiness comes only from
:func:`megatron_prt.core.deps.producers`, so the order is valid by construction.

Policies:

* 1F1B-like (PRT's default): a forward may start only while the rank holds fewer than
  ``caps[rank]`` activations awaiting backward (the warm-up depth, which bounds memory);
  with ``alternate`` a rank that just ran a backward prefers a forward and vice versa, as in
  1F1B's steady state; otherwise a ready backward always goes first. Among forwards (and
  among backwards) the lowest ``fwd_key`` (``bwd_key``) wins.
* ``flush`` (GPipe): all forwards of a rank before any of its backwards.

If every rank is blocked only by its cap (possible with tiny caps on odd placements), the
lowest-keyed waiting forward runs anyway, so the generator never deadlocks. The result also
reports the makespan and each rank's peak held activations, which the portfolio search in
:mod:`megatron_prt.core.schedules` ranks policies by.

Speed: a plan of P=64, R=8, m=512 has half a million actions and the portfolio schedules it
several times, so the scheduler runs on a :class:`Graph` compiled once per (placement,
micro-batch split): actions are integers, each heap entry is one integer (key, then action)
and events are bucketed by instant. Actions become :class:`Action` values only for the plan
that is kept, and that plan's compiled replay
(:func:`~megatron_prt.core.compiled.compiled_schedule`) comes from the graph's tables and the
scheduler's own timeline rather than from its half a million actions.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from heapq import heapify, heappop, heappush
from itertools import chain, repeat
from operator import add, itemgetter, mod, sub
from typing import NamedTuple

from .actions import Action, Op
from .compiled import compiled_schedule as compiled_schedule  # re-exported: its old home
from .deps import producers
from .placement import Placement
from .steady import SteadyWatch
from .timing import StageTimes


class SortKey(NamedTuple):
    """A preference among actions: ``by_stage[stage] + by_mb[mb]``, lower runs first. Two
    tables rather than a function so that keying half a million actions is arithmetic.
    Distinct (stage, mb) must get distinct keys (ties would fall to the action id)."""

    by_stage: Sequence[int]
    by_mb: Sequence[int]

    def __call__(self, stage: int, mb: int) -> int:
        return self.by_stage[stage] + self.by_mb[mb]


def oldest_first(num_stages: int, num_microbatches: int) -> SortKey:
    """(mb, stage): the oldest micro-batch first, then the lowest stage."""
    return SortKey(range(num_stages), range(0, num_microbatches * num_stages, num_stages))


@dataclass(frozen=True)
class Policy:
    flush: bool = False
    alternate: bool = True
    caps: tuple[int, ...] | None = None  # None: unbounded
    fwd_key: SortKey | None = None  # None: oldest_first
    bwd_key: SortKey | None = None


@dataclass(frozen=True)
class ListResult:
    orders: tuple[tuple[Action, ...], ...]  # rank -> compute actions in execution order
    makespan: float
    peak_held: tuple[int, ...]  # rank -> most activations held at once


@dataclass(frozen=True)
class IdResult:
    """A schedule over :attr:`Graph.actions` ids (what :func:`list_schedule` wraps)."""

    orders: tuple[list[int], ...]
    ticks: int  # makespan in ticks of the stage times scheduled with
    makespan: float
    peak_held: tuple[int, ...]
    started: list[int]  # every id in the order the ranks started them (a dependency order)
    begins: tuple[list[int], ...]  # rank -> start tick of each of its actions
    forced: bool  # a forward ran past its cap (its start may lie after its earliest)

    def materialise(self, graph: Graph) -> ListResult:
        orders = tuple(map(graph.actions_of, self.orders))
        return ListResult(orders, self.makespan, self.peak_held)


@dataclass(frozen=True)
class GaveUp:
    """A schedule abandoned at tick ``at``: its makespan would exceed the limit given."""

    at: int


class Graph:
    """The F/B actions of (placement, micro-batch split) as integers, with what every policy
    shares: id ``mb * 2D + 2 * position + (0 for F, 1 for B)`` (position: flow position in
    the micro-batch's pipeline); ``stage``/``mb``/``rank``/``kinds`` per id (kind:
    ``2 * stage + op bit``); ``producer_counts`` per id, from
    :func:`megatron_prt.core.deps.producers` less the implied ones (below);
    ``consumers[pipe][offset]``: ``(offset of a consumer, whether the edge crosses ranks)``
    within one micro-batch of that pipeline (the rule never crosses micro-batches). Every
    per-id list is one micro-batch's template repeated. Read-only once built.

    [Note: implied producers]
    A backward waits for its own forward and for the next stage's backward, which waits for
    the next stage's forward, which waits for this forward: so the scheduler takes that
    forward's finish before the next stage's forward starts, before that backward finishes,
    and waits for the backward alone. Its readiness comes at the same instant, and with hops
    at the same tick (the forward runs on the backward's rank: no hop, earlier finish). So
    every action waits for one producer at most and readies one at most (checked): it is
    ready once that one is, a micro-batch's actions one chain."""

    def __init__(self, placement: Placement, mb_pipeline: tuple[int, ...]) -> None:
        self.placement, self.mb_pipeline = placement, mb_pipeline
        self.width = width = 2 * placement.depth
        pipes = range(placement.num_pipelines)
        stage_t = [[p * placement.depth + j // 2 for j in range(width)] for p in pipes]
        rank_t = [[placement.stage_to_rank[s] for s in stages] for stages in stage_t]
        counts_t, self.consumers = zip(*(self._edges(p, rank_t[p]) for p in pipes), strict=True)
        kinds_t = [[2 * s + (j & 1) for j, s in enumerate(stages)] for stages in stage_t]
        self.stage, self.rank, self.kinds, self.producer_counts = [], [], [], []
        for pipe in mb_pipeline:
            self.stage += stage_t[pipe]
            self.rank += rank_t[pipe]
            self.kinds += kinds_t[pipe]
            self.producer_counts += counts_t[pipe]
        self.mb = list(chain.from_iterable(map(repeat, range(len(mb_pipeline)), repeat(width))))
        self.n = len(self.stage)

    def _edges(self, pipe: int, ranks: list[int]) -> tuple[list[int], list[tuple]]:
        """One micro-batch of ``pipe``: producer count and consumers per offset."""
        placement, depth = self.placement, self.placement.depth
        counts = [0] * self.width
        consumers: list[list[tuple[int, bool]]] = [[] for _ in range(self.width)]
        for offset in range(self.width):
            action = Action(pipe * depth + offset // 2, (Op.F, Op.B)[offset & 1], 0)
            deps = producers(action, placement)
            for dep in deps:
                dep_offset = 2 * (dep.stage - pipe * depth) + (dep.op is Op.B)
                if dep.stage == action.stage and deps[-1].op is Op.B:
                    continue  # a backward's own forward: see [Note: implied producers]
                counts[offset] += 1
                consumers[dep_offset].append((offset, ranks[offset] != ranks[dep_offset]))
        if max(counts) > 1 or max(map(len, consumers)) > 1:
            raise ValueError(
                f"pipeline {pipe}: an action waits for two producers or readies two, none "
                "implied by another: the list scheduler takes a micro-batch's actions as one "
                "chain ([Note: implied producers] in megatron_prt/core/greedy.py); extend it"
            )
        return counts, [tuple(users) for users in consumers]

    def kinds_of(self, ids: list[int]) -> list[int]:
        """:attr:`kinds` of ``ids``: ``id mod (width * pipelines)`` when micro-batches take
        the pipelines in turn (what :func:`~megatron_prt.core.plan.split_microbatches`
        does), arithmetic rather than a look-up in a half-million-long table."""
        pipes = self.placement.num_pipelines
        if self.mb_pipeline != tuple(mb % pipes for mb in range(len(self.mb_pipeline))):
            return list(map(self.kinds.__getitem__, ids))
        return list(map(mod, ids, repeat(self.width * pipes)))

    @functools.cached_property
    def sources(self) -> list[int]:
        """The ids with no producer (a pipeline's first forward), from one micro-batch's
        template per pipeline (the counts repeat per micro-batch)."""
        counts, width = self.producer_counts, self.width
        firsts = {}  # pipeline -> the offsets of its template with no producer
        for mb, pipe in enumerate(self.mb_pipeline):
            if pipe not in firsts:
                base = mb * width
                firsts[pipe] = [j for j in range(width) if not counts[base + j]]
        return [mb * width + j for mb, pipe in enumerate(self.mb_pipeline) for j in firsts[pipe]]

    @functools.cached_property
    def consumer_steps(self) -> tuple[list[int], list[bool]]:
        """Per id: how far ahead its one consumer's id lies (0: none), and whether that edge
        crosses ranks (the scheduler's view of :attr:`consumers`: ``id + step``)."""
        steps_t, crossing_t = [], []
        for users in self.consumers:
            steps_t.append([edges[0][0] - j if edges else 0 for j, edges in enumerate(users)])
            crossing_t.append([bool(edges) and edges[0][1] for edges in users])
        steps: list[int] = []
        crossing: list[bool] = []
        for pipe in self.mb_pipeline:
            steps += steps_t[pipe]
            crossing += crossing_t[pipe]
        return steps, crossing

    @functools.cached_property
    def producer_ids(self) -> tuple[list[int], list[int]]:
        """Per id its producers' ids in :func:`megatron_prt.core.deps.producers`' order, as
        two slots (``n`` where an action has fewer producers)."""
        return self._per_id(0, self.n), self._per_id(1, self.n)

    def _per_id(self, slot: int, none: int) -> list[int]:
        """Slot 0 or 1 of the producers, or (2) the producer on another rank, as ids."""
        templates = [offsets[slot] for offsets in self._producer_offsets]
        out: list[int] = []
        for mb, pipe in enumerate(self.mb_pipeline):
            base = mb * self.width
            out += [none if o < 0 else base + o for o in templates[pipe]]
        return out

    @functools.cached_property
    def _producer_offsets(self) -> list[tuple[list[int], ...]]:
        """Per pipeline, one micro-batch: per offset the offsets of its first and second
        producer and of its producer on another rank (-1: none)."""
        placement, depth, width = self.placement, self.placement.depth, self.width
        rank, out = placement.stage_to_rank, []
        for pipe in range(placement.num_pipelines):
            slots: tuple[list[int], ...] = ([-1] * width, [-1] * width, [-1] * width)
            for offset in range(width):
                action = Action(pipe * depth + offset // 2, (Op.F, Op.B)[offset & 1], 0)
                for slot, dep in enumerate(producers(action, placement)):
                    slots[slot][offset] = 2 * (dep.stage - pipe * depth) + (dep.op is Op.B)
                    if rank[dep.stage] != rank[action.stage]:
                        slots[2][offset] = slots[slot][offset]
            out.append(slots)
        return out

    @functools.cached_property
    def actions(self) -> list[Action]:
        """id -> :class:`Action` (built on first use: only kept plans need them)."""
        rows = zip(self.stage, self._ops, self.mb, strict=True)
        return list(map(tuple.__new__, repeat(Action), rows))  # Action._make, without a call

    def actions_of(self, ids: list[int]) -> tuple[Action, ...]:
        """The :class:`Action` of each id, made now, in this order: a plan's actions made
        rank after rank lie in memory in plan order, which the passes reading the plan
        (validation, lowering) walk faster than actions made in id order and gathered."""
        if len(ids) < 2:  # itemgetter of one id returns the value, not a tuple
            return tuple(Action(self.stage[i], self._ops[i], self.mb[i]) for i in ids)
        pick = itemgetter(*ids)
        rows = zip(pick(self.stage), pick(self._ops), pick(self.mb), strict=True)
        return tuple(map(tuple.__new__, repeat(Action), rows))  # Action._make, without a call

    @functools.cached_property
    def _ops(self) -> list[Op]:
        """id -> its op (ids alternate F, B)."""
        return [Op.F, Op.B] * (self.n // 2)

    def busy_per_kind(self, ticks: StageTimes) -> list[int]:
        """Per kind ``2 * stage + op bit``: its rank's busy time under ``ticks``; read-only,
        kept for the next policy of a portfolio (the last stage times asked only)."""
        kept = self.__dict__.get("_busy")
        if kept is None or kept[0] != ticks:
            placement = self.placement
            per_kind = [
                ticks.busy(Action(stage, op, 0), placement)
                for stage in range(placement.num_stages)
                for op in (Op.F, Op.B)
            ]
            kept = self._busy = (ticks, per_kind)
        return kept[1]

    def durations(self, ticks: StageTimes) -> list[int]:
        """id -> its rank's busy time under ``ticks`` (integer stage times); read-only, kept
        for the next policy of a portfolio (the last stage times asked only)."""
        kept = self.__dict__.get("_durations")
        if kept is None or kept[0] != ticks:
            per_kind = self.busy_per_kind(ticks)
            kept = self._durations = (ticks, list(map(per_kind.__getitem__, self.kinds)))
        return kept[1]

    def work_per_rank(self, ticks: StageTimes) -> list[int]:
        """rank -> the busy time of all its actions under ``ticks``."""
        placement, per_kind = self.placement, self.busy_per_kind(ticks)
        mbs = [self.mb_pipeline.count(p) for p in range(placement.num_pipelines)]
        work = [0] * placement.ranks
        for stage, rank in enumerate(placement.stage_to_rank):
            both = per_kind[2 * stage] + per_kind[2 * stage + 1]
            work[rank] += mbs[placement.pipeline_of(stage)] * both
        return work

    def heap_items(self, fwd_key: SortKey, bwd_key: SortKey) -> list[int]:
        """id -> its heap entry ``key * n + id``: one integer orders by key, then id."""
        n, width = self.n, self.width
        by_stage = (fwd_key.by_stage, bwd_key.by_stage)
        template = [  # per offset: (by-stage part of the entry, op bit)
            [(by_stage[j & 1][s] * n + j, j & 1) for j, s in enumerate(self.stage[:width])]
        ]
        if self.placement.num_pipelines == 2:
            second = self.stage[width : 2 * width]
            template.append([(by_stage[j & 1][s] * n + j, j & 1) for j, s in enumerate(second)])
        parts = [[part for part, _ in offsets] for offsets in template]
        half = width // 2  # offsets alternate F, B: one (F, B) pair of additions per stage
        items: list[int] = []
        for mb, pipe in enumerate(self.mb_pipeline):
            adds = [fwd_key.by_mb[mb] * n + mb * width, bwd_key.by_mb[mb] * n + mb * width]
            items += map(add, parts[pipe], adds * half)
        return items


@functools.lru_cache(maxsize=8)
def compile_graph(placement: Placement, mb_pipeline: tuple[int, ...]) -> Graph:
    """The shared :class:`Graph` of a configuration (cached: a portfolio and the callers
    comparing plans ask for the same one)."""
    return Graph(placement, mb_pipeline)


def list_schedule(
    placement: Placement,
    mb_pipeline: Sequence[int],
    times: StageTimes,
    policy: Policy,
) -> ListResult:
    """Schedule every F and B of ``mb_pipeline``'s micro-batches under ``policy``."""
    graph = compile_graph(placement, tuple(mb_pipeline))
    result = schedule_ids(graph, times, policy)
    assert isinstance(result, IdResult)  # no limit given: never gives up
    return result.materialise(graph)


def schedule_ids(
    graph: Graph,
    times: StageTimes,
    policy: Policy,
    give_up_above: int | None = None,
    tails: Sequence[int] | None = None,
) -> IdResult | GaveUp:
    """List-schedule ``graph`` under ``policy`` in integer ticks (see :class:`Run`)."""
    return Run(graph, times, policy, tails).run(give_up_above)


class Run:
    """One policy's list scheduling over ``graph``, resumable. :meth:`run` continues it
    until it finishes (:class:`IdResult`, orders as graph ids) or until its makespan must
    exceed ``limit`` ticks (:class:`GaveUp`; a later call with a larger limit continues
    from there). The bound: when a rank starts an action, that start plus the rank's
    remaining work plus ``tails[rank]`` (time that must follow its last action, e.g. the
    shortest backward tail) is a lower bound on the makespan."""

    def __init__(
        self, graph: Graph, times: StageTimes, policy: Policy, tails: Sequence[int] | None
    ) -> None:
        self._args = (graph, times, policy, tails or [0] * graph.placement.ranks)
        self._steps = None
        self.result: IdResult | None = None

    def run(self, limit: int | None = None) -> IdResult | GaveUp:
        if self.result is not None:
            return self.result
        try:
            if self._steps is None:
                self._steps = _steps(*self._args, limit)
                return next(self._steps)
            return self._steps.send(limit)
        except StopIteration as done:
            self.result = done.value
            return self.result


def _steps(graph: Graph, times: StageTimes, policy: Policy, tails: Sequence[int], limit):
    """The list scheduler as a generator: yields :class:`GaveUp` when past ``limit`` and
    takes the next limit (None: none); returns the :class:`IdResult`. ``slack[rank]``: how long
    the rank may still stay idle, from ``end[rank]`` (when its last action ended; -1 before
    its first), without its bound passing the limit: only a start after idle time checks.

    The event loop is one function on purpose: it runs once per action of every portfolio
    policy, and local variables are what keeps it fast. An event is a rank in ``due[time]``
    (its finish or an arrival for it), ``instants`` the heap of those times: ranks finish
    together, so there are far fewer instants than actions. Every event at an instant is
    taken before any rank chooses, so a backward that becomes ready now is seen by a rank
    that also became idle now; ranks then choose independently (each from its own heaps),
    so the order they are looked at in does not change the schedule."""
    ticks, tick = times.in_ticks()
    n, ranks = graph.n, graph.placement.ranks
    placement, rank_of = graph.placement, graph.rank
    users_of, crossing_of = graph.consumer_steps
    oldest = oldest_first(placement.num_stages, len(graph.mb_pipeline))
    keys = (policy.fwd_key or oldest, policy.bwd_key or oldest)
    items = graph.heap_items(*keys)
    duration, hop = graph.durations(ticks), ticks.p2p
    watch = SteadyWatch.of(graph, ticks, hop, policy.flush, keys)
    # the watch samples at the end of an instant in which watch_rank started next_source
    watch_rank, next_source = (0, -2) if watch is None else (watch.rank, 0)
    left = graph.work_per_rank(ticks)
    # past any makespan: every action run one after another, each after a hop
    longest = max(graph.busy_per_kind(ticks), default=0)  # of every action's duration
    unlimited = n * (longest + hop) + max(tails, default=0) + 1
    give_up, bounded = (unlimited, False) if limit is None else (limit, True)
    slack = [give_up - work - tail + 1 for work, tail in zip(left, tails, strict=True)]
    alternate, flush = policy.alternate, policy.flush
    caps = policy.caps or (n,) * ranks
    forwards = Counter(graph.rank[0::2]) if flush else {}  # rank -> its forwards (ids: F, B)
    fwd_left = [forwards.get(rank, 0) for rank in range(ranks)]
    fheap, bheap, pending = ([[] for _ in range(ranks)] for _ in range(3))
    held, peak, last_bwd = [0] * ranks, [0] * ranks, [False] * ranks
    current, end, order = [-1] * ranks, [-1] * ranks, [[] for _ in range(ranks)]
    started, begins = [], [[] for _ in range(ranks)]
    due: dict[int, list[int]] = {}  # instant -> ranks with an event then (a finish, an arrival)
    instants: list[int] = []  # heap of the instants in due
    add_order, add_begin = [o.append for o in order], [b.append for b in begins]
    add_started = started.append
    for i in graph.sources:  # sources arrive at time 0
        fheap[rank_of[i]].append(items[i])
        due.setdefault(0, []).append(rank_of[i])
    instants += due
    for heap in fheap:
        heapify(heap)
    now = interruptions = 0  # interruptions: forced forwards and give-ups
    forced = False
    while instants or len(started) < n:  # no instant left: none running, none arriving
        forcing = not instants  # every rank blocked by its cap alone:
        if forcing:  # the lowest-keyed waiting forward runs anyway
            touched, forced = [_forced_rank(fheap, current)], True
            interruptions += 1
        else:
            now = heappop(instants)
            touched = due.pop(now)
        # ranks with an event now: finishing, idle (sources at 0, a forced forward) or, with
        # hops, due an arrival (their action may end later); ranks readied now join touched
        for rank in tuple(touched):
            action = current[rank]
            if action < 0 or (hop and end[rank] != now):
                continue
            current[rank] = -1
            if action & 1:
                held[rank] -= 1
            step = users_of[action]  # its one user waits for it alone: ready now, or a hop
            if not step:  # later (see [Note: implied producers])
                continue
            user = action + step
            user_rank = rank_of[user]
            if hop and crossing_of[action]:
                at = now + hop
                heappush(pending[user_rank], at * n + user)
                if at in due:
                    due[at].append(user_rank)
                else:
                    due[at] = [user_rank]
                    heappush(instants, at)
                continue
            heappush((bheap if user & 1 else fheap)[user_rank], items[user])
            touched.append(user_rank)
        arrived = (now + 1) * n  # pending entries below this have arrived by now
        for rank in touched:  # ranks choose independently: any order
            if current[rank] >= 0:
                continue
            fh, bh = fheap[rank], bheap[rank]
            if hop:  # free hops ready their users at once: nothing pending
                pend = pending[rank]
                while pend and pend[0] < arrived:
                    user = heappop(pend) % n
                    heappush(bh if user & 1 else fh, items[user])
            if flush:
                heap = fh if fwd_left[rank] else bh
                if not heap:
                    continue
            # warm-up: rank r admits caps[r] forwards before its first backward (a forward
            # runs only while fewer than caps[r] activations await their backward); the caps
            # come from :mod:`megatron_prt.core.schedules` (round_trip_caps, megatron_caps).
            # 1F1B alternation: after a backward prefer a forward, after a forward a backward.
            elif (
                fh
                and (held[rank] < caps[rank] or forcing)
                and (not bh or (alternate and last_bwd[rank]))
            ):
                heap = fh
            elif bh:
                heap = bh
            else:
                continue
            action = heappop(heap) % n
            busy = duration[action]
            if bounded and now != end[rank]:  # idle since its last action (no limit: no
                slack[rank] -= now - end[rank]  # start can pass the bound, none is kept)
                while slack[rank] < 0:  # (the action waits, popped, for the next limit)
                    interruptions += 1
                    limit = yield GaveUp(now)
                    raised = (unlimited if limit is None else limit) - give_up
                    give_up += raised
                    slack = [idle + raised for idle in slack]
                    bounded = limit is not None
            current[rank] = action
            add_order[rank](action)
            add_started(action)
            add_begin[rank](now)
            if action & 1:
                last_bwd[rank] = True
            else:
                last_bwd[rank] = False
                held[rank] = holding = held[rank] + 1
                if flush:
                    fwd_left[rank] -= 1
                if holding > peak[rank]:
                    peak[rank] = holding
            end[rank] = finish = now + busy
            ending = due.get(finish)
            if ending is None:
                due[finish] = [rank]
                heappush(instants, finish)
            else:
                ending.append(rank)
        if current[watch_rank] == next_source:  # see [Note: repeating the steady state]
            run = dict(
                started=started, order=order, begins=begins, current=current, end=end,
                held=held, last_bwd=last_bwd, items=items, fheap=fheap,
                bheap=bheap, due=due, instants=instants,
                room=list(map(add, slack, end)) if bounded else None,  # the latest starts
            )  # fmt: skip
            skipped = watch.sample(now, interruptions, run)
            next_source = watch.next_source
            if skipped is not None:
                now += skipped[0]
                if bounded:  # the watch moved the latest starts (room) and the ends on
                    slack = list(map(sub, run["room"], end))
    return IdResult(tuple(order), now, now * tick, tuple(peak), started, tuple(begins), forced)


def _forced_rank(fheap: list[list[int]], current: list[int]) -> int:
    """All ranks idle and blocked by caps: the rank of the lowest-keyed admitted forward."""
    waiting = [(heap[0], rank) for rank, heap in enumerate(fheap) if heap and current[rank] < 0]
    if not waiting:
        raise RuntimeError("list scheduler stalled with no admissible action (bug)")
    return min(waiting)[1]
