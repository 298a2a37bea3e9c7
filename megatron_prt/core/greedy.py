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
several times, so the scheduler runs on a :class:`~megatron_prt.core.graph.Graph` compiled
once per (placement, micro-batch split) and events are bucketed by instant. That plan's
compiled replay (:func:`~megatron_prt.core.compiled.compiled_schedule`) comes from the graph's
tables and the
scheduler's own timeline rather than from its half a million actions.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from heapq import heapify, heappop, heappush
from operator import add, sub

from .actions import Action
from .compiled import compiled_schedule as compiled_schedule  # re-exported: its old home
from .graph import Graph, SortKey, compile_graph, oldest_first
from .placement import Placement
from .steady import SteadyWatch
from .timing import StageTimes


@dataclass(frozen=True)
class Policy:
    flush: bool = False
    alternate: bool = True
    caps: tuple[int, ...] | None = None  # None: unbounded
    fwd_key: SortKey | None = None  # None: oldest_first
    bwd_key: SortKey | None = None


@dataclass(frozen=True)
class ListResult:
    orders: tuple[Sequence[Action], ...]  # rank -> compute actions in execution order
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
    ends: tuple[list[int], ...]  # rank -> end tick of each of its actions
    forced: bool  # a forward ran past its cap (its start may lie after its earliest)

    def materialise(self, graph: Graph) -> ListResult:
        orders = tuple(map(graph.rank_actions, self.orders))
        return ListResult(orders, self.makespan, self.peak_held)


@dataclass(frozen=True)
class GaveUp:
    """A schedule abandoned at tick ``at``: its makespan would exceed the limit given."""

    at: int


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
    entries = graph.heap_entries(*keys)  # see [Note: heap entries made when needed]
    items, fill_through = entries.items, entries.fill_through
    duration, hop = graph.durations(ticks), ticks.longest_hop
    hopping, backward = hop > 0, graph.backward  # bools: the loop's tests of them are cheap
    edge_hop = None  # per id its edge's hop where the cuts differ; else every hop is hop
    if ticks.per_cut:  # a crossing edge of a free cut readies at once, as on one rank
        crossing_of = edge_hop = graph.consumer_hops(ticks)
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
    started, ends = [], [[] for _ in range(ranks)]  # ends: per rank, each action's end tick
    due: dict[int, list[int]] = {}  # instant -> ranks with an event then (a finish, an arrival)
    instants: list[int] = []  # heap of the instants in due
    for i in graph.sources:  # sources arrive at time 0
        fheap[rank_of[i]].append(entries.entry(i))
        due.setdefault(0, []).append(rank_of[i])
    source_ranks = sorted(set(due[0]))  # ranks that start micro-batches
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
            if action < 0 or (hopping and end[rank] != now):
                continue
            current[rank] = -1
            if last_bwd[rank]:  # the last action a rank started is the one finishing
                held[rank] -= 1
            step = users_of[action]  # its one user waits for it alone: ready now, or a hop
            if not step:  # later (see [Note: implied producers] in graph.py)
                continue
            user = action + step
            user_rank = rank_of[user]
            if hopping and crossing_of[action]:
                at = now + (hop if edge_hop is None else edge_hop[action])
                heappush(pending[user_rank], at * n + user)
                if at in due:
                    due[at].append(user_rank)
                else:
                    due[at] = [user_rank]
                    heappush(instants, at)
                continue
            heappush((bheap if backward[user] else fheap)[user_rank], items[user])
            if current[user_rank] < 0:  # else running past now, or in touched already
                touched.append(user_rank)
        arrived = (now + 1) * n  # pending entries below this have arrived by now
        for rank in touched:  # ranks choose independently: any order
            if current[rank] >= 0:
                continue
            fh, bh = fheap[rank], bheap[rank]
            if hopping:  # free hops ready their users at once: nothing pending
                pend = pending[rank]
                while pend and pend[0] < arrived:
                    user = heappop(pend) % n
                    heappush(bh if backward[user] else fh, items[user])
            if flush:
                heap = fh if fwd_left[rank] else bh
                if not heap:
                    continue
                forward = heap is fh
            # warm-up: rank r admits caps[r] forwards before its first backward (a forward
            # runs only while fewer than caps[r] activations await their backward); the caps
            # come from :mod:`megatron_prt.core.schedules` (round_trip_caps, megatron_caps).
            # 1F1B alternation: after a backward prefer a forward, after a forward a backward.
            elif (
                fh
                and (held[rank] < caps[rank] or forcing)
                and (not bh or (alternate and last_bwd[rank]))
            ):
                heap, forward = fh, True
            elif bh:
                heap, forward = bh, False
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
            order[rank].append(action)
            started.append(action)
            if forward:
                last_bwd[rank] = False
                held[rank] = holding = held[rank] + 1
                if flush:
                    fwd_left[rank] -= 1
                if holding > peak[rank]:
                    peak[rank] = holding
            else:
                last_bwd[rank] = True
            end[rank] = finish = now + busy
            ends[rank].append(finish)
            ending = due.get(finish)
            if ending is None:
                due[finish] = [rank]
                heappush(instants, finish)
            else:
                ending.append(rank)
        for rank in source_ranks:  # a micro-batch started: its entries are read from now on
            if current[rank] >= len(items):
                fill_through(current[rank])
        if current[watch_rank] == next_source:  # see [Note: repeating the steady state]
            run = dict(
                started=started, order=order, ends=ends, current=current, end=end,
                held=held, last_bwd=last_bwd, entries=entries, fheap=fheap,
                bheap=bheap, due=due, instants=instants,
                room=list(map(add, slack, end)) if bounded else None,  # the latest starts
            )  # fmt: skip
            skipped = watch.sample(now, interruptions, run)
            next_source = watch.next_source
            if skipped is not None:
                now += skipped[0]
                if bounded:  # the watch moved the latest starts (room) and the ends on
                    slack = list(map(sub, run["room"], end))
    return IdResult(tuple(order), now, now * tick, tuple(peak), started, tuple(ends), forced)


def _forced_rank(fheap: list[list[int]], current: list[int]) -> int:
    """All ranks idle and blocked by caps: the rank of the lowest-keyed admitted forward."""
    waiting = [(heap[0], rank) for rank, heap in enumerate(fheap) if heap and current[rank] < 0]
    if not waiting:
        raise RuntimeError("list scheduler stalled with no admissible action (bug)")
    return min(waiting)[1]
