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
"""

from __future__ import annotations

import functools
import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .actions import Action, Op
from .deps import consumers_map, producers
from .placement import Placement
from .timing import StageTimes

SortKey = Callable[[Action], tuple]


def oldest_first(action: Action) -> tuple:
    return (action.mb, action.stage)


@dataclass(frozen=True)
class Policy:
    flush: bool = False
    alternate: bool = True
    caps: tuple[int, ...] | None = None  # None: unbounded
    fwd_key: SortKey = oldest_first
    bwd_key: SortKey = oldest_first


@dataclass(frozen=True)
class ListResult:
    orders: tuple[tuple[Action, ...], ...]  # rank -> compute actions in execution order
    makespan: float
    peak_held: tuple[int, ...]  # rank -> most activations held at once


@dataclass
class _Rank:
    arrivals: list  # heap of (ready_time, key, action)
    fwd: list  # heap of (key, action)
    bwd: list  # heap of (key, action)
    forwards_left: int
    held: int = 0  # activations resident for a later backward
    peak: int = 0
    last_was_bwd: bool = False
    busy: bool = False


def required_actions(placement: Placement, mb_pipeline: Sequence[int]) -> list[Action]:
    """Every (stage, mb) F and B of a plan, in flow order per micro-batch."""
    out = []
    for mb, pipe in enumerate(mb_pipeline):
        for stage in placement.pipelines[pipe]:
            out.append(Action(stage, Op.F, mb))
        for stage in reversed(placement.pipelines[pipe]):
            out.append(Action(stage, Op.B, mb))
    return out


def list_schedule(
    placement: Placement,
    mb_pipeline: Sequence[int],
    times: StageTimes,
    policy: Policy,
) -> ListResult:
    """Schedule every F and B of ``mb_pipeline``'s micro-batches under ``policy``."""
    times, tick = times.in_ticks()
    actions, consumers, producer_counts, forwards = _graph(placement, tuple(mb_pipeline))
    waiting = dict(producer_counts)
    ready_at = dict.fromkeys(actions, 0)
    rank_of = placement.stage_to_rank
    ranks = [_Rank([], [], [], count) for count in forwards]
    order: list[list[Action]] = [[] for _ in ranks]
    events: list = []  # (time, seq, rank, finished action or None for a wake-up)
    seq = 0

    def arrive(action: Action) -> None:
        nonlocal seq
        rank = rank_of[action.stage]
        heapq.heappush(ranks[rank].arrivals, (ready_at[action], oldest_first(action), action))
        seq += 1
        heapq.heappush(events, (ready_at[action], seq, rank, None))

    def admit(state: _Rank, now: float) -> None:
        while state.arrivals and state.arrivals[0][0] <= now:
            _, _, action = heapq.heappop(state.arrivals)
            if action.op is Op.F:
                heapq.heappush(state.fwd, (policy.fwd_key(action), action))
            else:
                heapq.heappush(state.bwd, (policy.bwd_key(action), action))

    def pick(rank: int, force: bool = False) -> Action | None:
        state = ranks[rank]
        if policy.flush:
            if state.forwards_left:
                return heapq.heappop(state.fwd)[1] if state.fwd else None
            return heapq.heappop(state.bwd)[1] if state.bwd else None
        cap = policy.caps[rank] if policy.caps else None
        fwd_ok = bool(state.fwd) and (force or cap is None or state.held < cap)
        # 1F1B alternation: after a backward prefer a forward, after a forward a backward.
        if fwd_ok and (not state.bwd or (policy.alternate and state.last_was_bwd)):
            return heapq.heappop(state.fwd)[1]
        if state.bwd:
            return heapq.heappop(state.bwd)[1]
        return None

    def start(rank: int, action: Action, now: float) -> None:
        nonlocal seq
        state = ranks[rank]
        state.busy = True
        state.last_was_bwd = action.op is not Op.F
        if action.op is Op.F:
            state.held += 1
            state.peak = max(state.peak, state.held)
            state.forwards_left -= 1
        order[rank].append(action)
        seq += 1
        heapq.heappush(events, (now + times.busy(action, placement), seq, rank, action))

    for action in actions:
        if waiting[action] == 0:
            arrive(action)
    done = 0
    now = 0
    while done < len(actions):
        if not events:
            rank, action = _forced_choice(ranks, pick)
            start(rank, action, now)
            continue
        now = events[0][0]
        touched = set()
        # Drain every event at this instant before choosing, so a backward that becomes
        # ready now is seen by a rank that also became idle now.
        while events and events[0][0] == now:
            _, _, rank, finished = heapq.heappop(events)
            touched.add(rank)
            if finished is not None:
                done += 1
                _finish(ranks[rank], finished)
                for nxt in consumers[finished]:
                    hop = times.p2p if rank_of[nxt.stage] != rank else 0
                    ready_at[nxt] = max(ready_at[nxt], now + hop)
                    waiting[nxt] -= 1
                    if waiting[nxt] == 0:
                        arrive(nxt)
        for rank in sorted(touched):
            state = ranks[rank]
            if not state.busy:
                admit(state, now)
                action = pick(rank)
                if action is not None:
                    start(rank, action, now)
    return ListResult(
        tuple(tuple(acts) for acts in order), now * tick, tuple(state.peak for state in ranks)
    )


@functools.lru_cache(maxsize=32)
def _graph(placement: Placement, mb_pipeline: tuple[int, ...]):
    """What every policy of a portfolio shares: the actions, their consumers, how many
    producers each waits for, and each rank's forward count. Read-only for callers."""
    actions = required_actions(placement, mb_pipeline)
    consumers = consumers_map(actions, placement)
    producer_counts = {a: len(producers(a, placement)) for a in actions}
    rank_of = placement.stage_to_rank
    forwards = tuple(
        sum(1 for a in actions if a.op is Op.F and rank_of[a.stage] == r)
        for r in range(placement.ranks)
    )
    return actions, consumers, producer_counts, forwards


def _finish(state: _Rank, action: Action) -> None:
    state.busy = False
    if action.op is Op.B:
        state.held -= 1


def _forced_choice(ranks: list[_Rank], pick) -> tuple[int, Action]:
    """All ranks idle and blocked by caps: run the lowest-keyed admitted forward."""
    best = None
    for rank, state in enumerate(ranks):
        if not state.busy and state.fwd and (best is None or state.fwd[0] < best[0]):
            best = (state.fwd[0], rank)
    if best is None:
        raise RuntimeError("list scheduler stalled with no admissible action (bug)")
    return best[1], pick(best[1], force=True)
