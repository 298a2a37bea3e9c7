"""Replay a plan's compute actions in time: the shared engine of validation, lowering and
simulation. Dependencies come only from :func:`megatron_prt.core.deps.producers`."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from .actions import Action
from .deps import producers
from .grid import format_grid
from .plan import Plan
from .timing import StageTimes


class PlanError(ValueError):
    """An invalid plan. The message names rank, step and action and shows the grid."""


@dataclass(frozen=True)
class Timeline:
    """``start[a]``/``end[a]`` for every compute action, in ``times`` units."""

    start: dict[Action, float]
    end: dict[Action, float]

    @property
    def makespan(self) -> float:
        return max(self.end.values(), default=0.0)


def replay(plan: Plan, times: StageTimes | None = None) -> Timeline:
    """Run every rank's compute actions in order, each as soon as its rank is free and its
    producers are done (plus ``times.p2p`` per cross-rank hop). Raises :class:`PlanError` if
    the ranks block each other (a cyclic wait, i.e. a deadlock)."""
    placement = plan.placement
    times, tick = (times or StageTimes.uniform(placement.depth)).in_ticks()
    split = plan.split_backward
    orders = [plan.compute_actions(r) for r in range(placement.ranks)]
    pos = [0] * len(orders)
    free = [0] * len(orders)
    start: dict[Action, float] = {}
    end: dict[Action, float] = {}
    waiters: dict[Action, list[int]] = {}
    runnable = deque(range(len(orders)))
    rank_of = placement.stage_to_rank
    while runnable:
        rank = runnable.popleft()
        acts = orders[rank]
        while pos[rank] < len(acts):
            action = acts[pos[rank]]
            ready = free[rank]
            blocker = None
            for dep in producers(action, placement, split):
                if dep not in end:
                    blocker = dep
                    break
                hop = times.p2p if rank_of[dep.stage] != rank else 0
                ready = max(ready, end[dep] + hop)
            if blocker is not None:
                waiters.setdefault(blocker, []).append(rank)
                break
            start[action] = ready
            end[action] = free[rank] = ready + times.busy(action, placement)
            pos[rank] += 1
            runnable.extend(waiters.pop(action, ()))
    if any(p < len(acts) for p, acts in zip(pos, orders, strict=True)):
        raise PlanError(_deadlock_message(plan, orders, pos, end))
    return Timeline({a: t * tick for a, t in start.items()}, {a: t * tick for a, t in end.items()})


def _deadlock_message(plan, orders, pos, end) -> str:
    lines = ["plan deadlocks: every unfinished rank waits on an action that cannot run"]
    where = {a: (r, i) for r, acts in enumerate(orders) for i, a in enumerate(acts)}
    marks = {}
    for rank, acts in enumerate(orders):
        if pos[rank] < len(acts):
            action = acts[pos[rank]]
            missing = [
                d for d in producers(action, plan.placement, plan.split_backward) if d not in end
            ]
            why = "; ".join(_whereabouts(d, rank, where) for d in missing)
            lines.append(
                f"  rank {rank}, step {pos[rank]}: {action} (stage {action.stage}, "
                f"mb {action.mb}) waits on {why}"
            )
            marks[rank] = pos[rank]
    return "\n".join(lines) + "\n" + format_grid(orders, marks)


def _whereabouts(dep: Action, rank: int, where: dict) -> str:
    if dep not in where:
        return f"{dep}, which no rank runs"
    dep_rank, dep_step = where[dep]
    if dep_rank == rank:
        return f"{dep}, which this rank runs later (step {dep_step})"
    return f"{dep}, which rank {dep_rank} runs at step {dep_step}"
