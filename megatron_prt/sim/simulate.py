"""Event simulation of a plan under a cost model: time, bubble, memory and traffic.

Semantics: each rank runs its compute actions in plan order; an action starts when its rank
is free and every producer has finished (plus one hop time per cross-rank edge). A forward
allocates its stage's activation bytes when it starts; the backward frees them when it ends.
Communication overlaps compute (a hop delays the consumer, not the sender).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core.actions import Op
from ..core.deps import consumers_map
from ..core.plan import Plan
from ..core.replay import Timeline, replay
from .cost import CostModel


@dataclass(frozen=True)
class RankStats:
    rank: int
    busy: float
    idle: float
    peak_inflight: int  # most (stage, mb) activations held at once
    peak_activation_bytes: float
    param_bytes: float  # weights of the stages (and replicas) on this rank

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass(frozen=True)
class SimResult:
    plan: Plan
    timeline: Timeline
    makespan: float
    bubble_fraction: float
    per_rank: tuple[RankStats, ...]
    p2p_messages: int
    p2p_bytes: float

    def to_dict(self) -> dict:
        return {
            "config": self.plan.to_dict()["config"],
            "makespan": self.makespan,
            "bubble_fraction": self.bubble_fraction,
            "p2p_messages": self.p2p_messages,
            "p2p_bytes": self.p2p_bytes,
            "per_rank": [r.to_dict() for r in self.per_rank],
        }


def simulate(plan: Plan, cost: CostModel | None = None) -> SimResult:
    cost = cost or CostModel()
    placement = plan.placement
    timeline = replay(plan, cost.stage_times(placement))
    act_bytes = cost.stage_activation_bytes(placement)
    param_bytes = cost.stage_param_bytes(placement)
    makespan = timeline.makespan
    stats = []
    for rank in range(placement.ranks):
        acts = plan.compute_actions(rank)
        busy = sum(timeline.end[a] - timeline.start[a] for a in acts)
        peak_n, peak_b = _peak_memory(acts, timeline, act_bytes)
        params = sum(param_bytes[placement.model_stage(s)] for s in placement.rank_stages[rank])
        stats.append(RankStats(rank, busy, makespan - busy, peak_n, peak_b, params))
    total_busy = sum(s.busy for s in stats)
    bubble = 1.0 - total_busy / (placement.ranks * makespan) if makespan > 0 else 0.0
    messages = _count_messages(plan, timeline)
    return SimResult(
        plan, timeline, makespan, bubble, tuple(stats), messages, messages * cost.message_bytes
    )


def _peak_memory(acts, timeline: Timeline, act_bytes) -> tuple[int, float]:
    frees = (Op.B, Op.W)
    events = []
    for a in acts:
        size = act_bytes[a.stage % len(act_bytes)]
        if a.op is Op.F:
            events.append((timeline.start[a], 1, 1, size))
        elif a.op in frees:
            events.append((timeline.end[a], 0, -1, -size))
    events.sort()  # at one instant frees (0) come before allocations (1)
    count = peak_n = 0
    held = peak_b = 0.0
    for _, _, dn, db in events:
        count += dn
        held += db
        peak_n, peak_b = max(peak_n, count), max(peak_b, held)
    return peak_n, peak_b


def _count_messages(plan: Plan, timeline: Timeline) -> int:
    rank_of = plan.placement.stage_to_rank
    consumers = consumers_map(timeline.start, plan.placement, plan.split_backward)
    return sum(
        1
        for action, users in consumers.items()
        for user in users
        if rank_of[user.stage] != rank_of[action.stage]
    )
