"""Event simulation of a plan under a cost model: time, bubble, memory and traffic.

Semantics: each rank runs its compute actions in plan order; an action starts when its rank
is free and every producer has finished (plus one hop time per cross-rank edge). A forward
allocates its stage's activation bytes when it starts; the backward frees them when it ends
(split backward: I frees all but the share W needs, :meth:`CostModel.stage_wgrad_keep`, W
the rest). Under activation recomputation a stage's bytes are what it keeps (recomputed
layers: their inputs, or all but the attention core) and its backward includes the rerun
forward (:mod:`megatron_prt.sim.cost`); the same rule holds them. Any valid
plan simulates, F/B or F/I/W, whoever built it.
Communication overlaps compute (a hop delays the consumer, not the sender): receives posted
before their producer ends, the runtime's gloo, shared-memory and NCCL ``early_recvs`` setting
(:mod:`megatron_prt.sim.posting` also models NCCL without it).

Direction ``bi`` ends with the replica-gradient sum (:mod:`megatron_prt.sim.replica_sync`):
each rank pair starts it once both have finished their compute; a model with tied
embeddings (``tied_grad_bytes``) then sums its first and last stages' copies, each pair once
both ranks are through the step and the replica sum; the makespan is the last rank's end of
either. Both are free unless the cost model sets the ``replica_*`` costs; their time counts
as idle (not busy) in the per-rank stats and the bubble fraction.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from ..core.actions import Action, Op
from ..core.deps import consumers_map
from ..core.placement import Placement, cut_index
from ..core.plan import Plan
from ..core.replay import Timeline, replay
from ..core.zerobubble import WGRAD_KEEP_FRACTION
from .cost import CostModel
from .replica_sync import GradSum, replica_syncs, tied_syncs


@dataclass(frozen=True)
class RankStats:
    rank: int
    busy: float
    idle: float
    peak_inflight: int  # most (stage, mb) activations held at once
    peak_activation_bytes: float
    param_bytes: float  # weights of the stages (and replicas) on this rank
    replica_wait: float = 0.0  # bi: from its last compute until its mirrored rank's
    replica_sync: float = 0.0  # bi: exchanging and adding replica gradients
    replica_bytes: float = 0.0  # bi: gradient bytes sent to the mirrored rank (and received)
    tied_wait: float = 0.0  # tied embeddings: from its step (and replica sum) until its peer's
    tied_sync: float = 0.0  # tied embeddings: exchanging and adding the copies' gradients

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
    replica_sync_time: float = 0.0  # bi: what the replica-gradient sum adds to the makespan
    replica_bytes: float = 0.0  # bi: gradient bytes all ranks send to their mirrored ranks
    tied_sync_time: float = 0.0  # what the tied embedding sum adds to the makespan after that

    def to_dict(self) -> dict:
        return {
            "config": self.plan.to_dict()["config"],
            "makespan": self.makespan,
            "bubble_fraction": self.bubble_fraction,
            "p2p_messages": self.p2p_messages,
            "p2p_bytes": self.p2p_bytes,
            "replica_sync_time": self.replica_sync_time,
            "replica_bytes": self.replica_bytes,
            "tied_sync_time": self.tied_sync_time,
            "per_rank": [r.to_dict() for r in self.per_rank],
        }


def simulate(plan: Plan, cost: CostModel | None = None) -> SimResult:
    """Simulate ``plan`` (compute-only or lowered) under ``cost`` (default: forward 1,
    backward 2 for the whole model, free communication). Times in the cost's unit."""
    cost = cost or CostModel()
    if plan.split_backward:  # [Note: the split form's own costs] in sim/layer_cost.py
        cost = cost.split_form()
    placement = plan.placement
    timeline = replay(plan, cost.stage_times(placement))
    act_bytes = cost.stage_activation_bytes(placement)
    keep = cost.stage_wgrad_keep(placement)
    param_bytes = cost.stage_param_bytes(placement)
    acts = [plan.compute_actions(rank) for rank in range(placement.ranks)]
    ready = [max((timeline.end[a] for a in mine), default=0.0) for mine in acts]
    syncs = replica_syncs(placement, cost, ready)
    replicas_done = max([timeline.makespan, *(sync.end for sync in syncs)])
    tied = tied_syncs(placement, cost, [sync.end for sync in syncs] if syncs else ready)
    makespan = max([replicas_done, *(sum_.end for sum_ in tied)])
    stats = []
    for rank, mine in enumerate(acts):
        busy = sum(timeline.end[a] - timeline.start[a] for a in mine)
        peak_n, peak_b = _peak_memory(mine, timeline, act_bytes, keep)
        params = sum(param_bytes[placement.model_stage(s)] for s in placement.rank_stages[rank])
        stat = RankStats(rank, busy, makespan - busy, peak_n, peak_b, params)
        stat = _with_sync(stat, syncs[rank]) if syncs else stat
        stats.append(_with_tied(stat, tied[rank]) if tied else stat)
    total_busy = sum(s.busy for s in stats)
    bubble = 1.0 - total_busy / (placement.ranks * makespan) if makespan > 0 else 0.0
    messages, message_bytes = _count_messages(plan, timeline, _cut_bytes(cost, placement))
    message_bytes += 0 * cost.message_bytes  # the number type messages * bytes gave
    return SimResult(
        plan,
        timeline,
        makespan,
        bubble,
        tuple(stats),
        messages,
        message_bytes,
        replicas_done - timeline.makespan,
        sum(sync.sent_bytes for sync in syncs),
        makespan - replicas_done,
    )


def _with_sync(stat: RankStats, sync: GradSum) -> RankStats:
    return replace(
        stat,
        replica_wait=sync.start - sync.ready,
        replica_sync=sync.end - sync.start,
        replica_bytes=sync.sent_bytes,
    )


def _with_tied(stat: RankStats, tied: GradSum) -> RankStats:
    return replace(stat, tied_wait=tied.start - tied.ready, tied_sync=tied.end - tied.start)


# -- the in-flight activation rule ---------------------------------------------------------
FREES = (Op.B, Op.W)  # the backward that ends an activation's life (W when split)
SHARED = (Op.F, Op.B, Op.I, Op.W)  # the actions that change what a rank holds


def held_activations(
    actions: Sequence[Action],
    timeline: Timeline | None = None,
    keep: float | Sequence[float] = WGRAD_KEEP_FRACTION,
) -> list[tuple[Action, float]]:
    """THE memory rule: a rank holds the activation of ``(stage, mb)`` from the start of
    its forward until the end of the backward that frees it: all of it until ``B``; with
    split backward, all of it until ``I`` ends, then the share ``keep`` that ``W`` needs
    (its weight GEMMs' inputs and output gradients) until ``W`` ends. Returns the rank's
    ``(action, change)`` changes, in shares of the stage's activation (``+1`` at F, ``-1``
    at B, ``-(1 - keep)`` at I, ``-keep`` at W), in the order it sees them: by time under
    ``timeline`` (frees before allocations at one instant); without one, in ``actions``
    order, which is the time order too (a rank runs its actions one after the other) unless
    a zero-time backward ends at the very instant a later forward starts.

    ``keep``: one share for every stage, or one per model stage (indexed as the cost
    model's per-stage bytes, ``stage % len(keep)``); above 1, I adds (its output gradients
    outweigh what it frees).

    Recomputation changes the sizes, not the rule: a stage holds, from F to B, the bytes its
    layers keep (:meth:`~megatron_prt.sim.cost.CostModel.layer_act_bwd`); what megatron
    re-materialises inside B is freed within it, a transient like a forward's, not held;
    under split backward its fully recomputed layers hold nothing after I (their share of
    ``keep`` is 0: :meth:`~megatron_prt.sim.cost.CostModel.stage_wgrad_keep`)."""
    shares = {Op.F: lambda k: 1, Op.B: lambda k: -1, Op.I: lambda k: k - 1, Op.W: lambda k: -k}
    per_stage = not isinstance(keep, (int, float))
    changes = [
        (a, shares[a.op](keep[a.stage % len(keep)] if per_stage else keep))
        for a in actions
        if a.op in shares
    ]
    if timeline is not None:
        changes.sort(key=lambda c: _instant(c, timeline))
    return changes


def _instant(change: tuple[Action, float], timeline: Timeline) -> tuple[float, int]:
    """When a change happens: a forward's at its start, a backward's at its end; at one
    instant backwards (0) come before forwards (1)."""
    action, _ = change
    return (timeline.start[action], 1) if action.op is Op.F else (timeline.end[action], 0)


def _peak_memory(acts, timeline: Timeline, act_bytes, keep) -> tuple[int, float]:
    """(most activations held at once, most activation bytes held at once) on one rank; an
    activation counts as held until the backward that ends its life (B or W)."""
    count = peak_n = 0
    held = peak_b = 0.0
    for action, change in held_activations(acts, timeline, keep):
        count += 1 if action.op is Op.F else -1 if action.op in FREES else 0
        held += change * act_bytes[action.stage % len(act_bytes)]
        peak_n, peak_b = max(peak_n, count), max(peak_b, held)
    return peak_n, peak_b


def _cut_bytes(cost: CostModel, placement: Placement) -> tuple[float, ...]:
    """Bytes of each cut's message (:meth:`CostModel.cut_message_bytes`, as the hops)."""
    return cost.cut_message_bytes(cost.layer_counts(placement.depth))


def _count_messages(plan: Plan, timeline: Timeline, cut_bytes: tuple[float, ...]):
    """The messages between ranks, and their bytes (``cut_bytes[k]`` across cut ``k``)."""
    placement = plan.placement
    rank_of = placement.stage_to_rank
    consumers = consumers_map(timeline.start, placement, plan.split_backward)
    crossing = [
        cut_index(action.stage, user.stage, placement.depth)
        for action, users in consumers.items()
        for user in users
        if rank_of[user.stage] != rank_of[action.stage]
    ]
    return len(crossing), sum(map(cut_bytes.__getitem__, crossing))
