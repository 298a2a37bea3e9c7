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


@dataclass(frozen=True)
class Ticks:
    """One replay in integer ticks (``tick`` time units each), per action of
    :attr:`Replayer.actions`: ``end`` and ``duration`` (its rank's busy time); ``hop``: the
    ticks one cross-rank edge adds. Exact, so a caller may compare ends for equality."""

    end: list[int]
    duration: list[int]
    hop: int
    tick: float

    @property
    def makespan(self) -> float:
        return max(self.end, default=0) * self.tick


class Replayer:
    """A plan compiled for replay: its compute actions in one dependency order, each with
    its predecessors (the previous action on its rank, then its producers from
    :func:`megatron_prt.core.deps.producers`). Compile once, then :meth:`run` with as many
    stage times as needed. Raises :class:`PlanError` if the ranks block each other (a cyclic
    wait, i.e. a deadlock) or an action waits on one no rank runs."""

    def __init__(self, plan: Plan) -> None:
        placement = self.placement = plan.placement
        orders = [plan.compute_actions(r) for r in range(placement.ranks)]
        self.actions = [a for acts in orders for a in acts]
        index: dict[Action, int] = {}
        for i, action in enumerate(self.actions):
            index.setdefault(action, i)  # plans run each action once (validate checks)
        rank_of = placement.stage_to_rank
        split = plan.split_backward  # a scan of the whole plan: once
        preds: list[list[tuple[int, bool]]] = []
        missing = [0] * len(self.actions)  # producers no rank runs: never ready
        for rank, acts in enumerate(orders):
            for step, action in enumerate(acts):
                mine = [(len(preds) - 1, False)] if step else []
                for dep in producers(action, placement, split):
                    if dep in index:
                        mine.append((index[dep], rank_of[dep.stage] != rank))
                    else:
                        missing[len(preds)] += 1
                preds.append(mine)
        # preds[i]: (index of a predecessor, whether the edge crosses ranks), rank's first
        self.preds = [tuple(p) for p in preds]
        self.order = _dependency_order(self.preds, missing)
        if len(self.order) < len(self.actions):
            raise PlanError(_deadlock_message(plan, orders, self._done(orders)))
        self.kinds = sorted({(a.stage, a.op) for a in self.actions})
        kind_index = {kind: i for i, kind in enumerate(self.kinds)}
        self.kind_of = [kind_index[(a.stage, a.op)] for a in self.actions]

    def _done(self, orders) -> tuple[list[int], set[Action]]:
        """At a deadlock: per rank the actions that ran, and the set of them."""
        ran = {self.actions[i] for i in self.order}
        return [sum(1 for a in acts if a in ran) for acts in orders], ran

    def run_ticks(self, times: StageTimes | None = None) -> Ticks:
        """Every action as soon as its rank is free and its producers are done (plus
        ``times.p2p`` per cross-rank hop); default times: :meth:`StageTimes.uniform`."""
        times, tick = (times or StageTimes.uniform(self.placement.depth)).in_ticks()
        busy = [times.busy(Action(stage, op, 0), self.placement) for stage, op in self.kinds]
        duration = [busy[k] for k in self.kind_of]
        end = [0] * len(duration)
        hop = times.p2p
        for i in self.order:
            start = 0
            for j, crosses in self.preds[i]:
                ready = end[j] + hop if crosses else end[j]
                if ready > start:
                    start = ready
            end[i] = start + duration[i]
        return Ticks(end, duration, hop, tick)

    def run(self, times: StageTimes | None = None) -> Timeline:
        """:meth:`run_ticks` as start and end times per action, in ``times`` units."""
        ticks = self.run_ticks(times)
        tick = ticks.tick
        start, end = {}, {}
        for action, e, d in zip(self.actions, ticks.end, ticks.duration, strict=True):
            start[action] = (e - d) * tick
            end[action] = e * tick
        return Timeline(start, end)


def replay(plan: Plan, times: StageTimes | None = None) -> Timeline:
    """Run every rank's compute actions in order, each as soon as its rank is free and its
    producers are done (plus ``times.p2p`` per cross-rank hop). Raises :class:`PlanError` if
    the ranks block each other (a cyclic wait, i.e. a deadlock). To replay one plan under
    many stage times, compile it once with :class:`Replayer`."""
    return Replayer(plan).run(times)


def _dependency_order(preds, missing) -> list[int]:
    """Kahn's order of the actions; those waiting (transitively) on a cycle or on a
    ``missing`` producer are left out."""
    waiting = [len(p) + n for p, n in zip(preds, missing, strict=True)]
    users: list[list[int]] = [[] for _ in preds]
    for i, p in enumerate(preds):
        for j, _ in p:
            users[j].append(i)
    ready = deque(i for i, n in enumerate(waiting) if n == 0)
    order = []
    while ready:
        i = ready.popleft()
        order.append(i)
        for user in users[i]:
            waiting[user] -= 1
            if waiting[user] == 0:
                ready.append(user)
    return order


def _deadlock_message(plan, orders, done) -> str:
    pos, end = done
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
