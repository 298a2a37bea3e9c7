"""Replay a plan's compute actions in time: the shared engine of validation, lowering and
simulation. Dependencies come only from :func:`megatron_prt.core.deps.producers`."""

from __future__ import annotations

from dataclasses import dataclass

from .actions import Action, Op
from .deps import producers
from .grid import format_grid
from .plan import Plan
from .timing import StageTimes

_COMPUTE = frozenset(op for op in Op if op.is_compute)


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
    wait, i.e. a deadlock) or an action waits on one no rank runs.

    Compiling is linear in the plan and touches no :class:`Action` beyond reading each one
    once: the producers of a kind of action (stage, op) are asked of the dependency rule
    once and shifted to every micro-batch (the rule never crosses micro-batches), and
    actions are found by ``kind * m + mb``."""

    def __init__(self, plan: Plan) -> None:
        self.placement = plan.placement
        orders = [[a for a in acts if a[1] in _COMPUTE] for acts in plan.ranks]
        self.actions = [a for acts in orders for a in acts]
        self.rank_of = [r for r, acts in enumerate(orders) for _ in acts]
        self.kinds = sorted({(a[0], a[1]) for a in self.actions})
        kind_index = {kind: i for i, kind in enumerate(self.kinds)}
        self.kind_of = [kind_index[a[0], a[1]] for a in self.actions]
        self._deps, missing = self._compile_deps(plan, kind_index)
        self.order = self._dependency_order(orders, missing)
        if len(self.order) < len(self.actions):
            raise PlanError(_deadlock_message(plan, orders, self._done(orders)))

    def _compile_deps(self, plan: Plan, kind_index: dict) -> tuple[list[tuple], list[int]]:
        """Per action its producers as ``(index, crosses ranks)``, and how many of its
        producers no rank runs."""
        placement, actions, split = self.placement, self.actions, plan.split_backward
        mbs = max((a[2] for a in actions), default=-1) + 1
        slot = [-1] * (len(self.kinds) * mbs)
        for i in range(len(actions) - 1, -1, -1):  # the first of any repeat wins
            slot[self.kind_of[i] * mbs + actions[i][2]] = i
        rank_of = placement.stage_to_rank
        kind_deps = []  # per kind: ((kind of producer or -1 if no rank runs it), ...)
        for stage, op in self.kinds:
            deps = producers(Action(stage, op, 0), placement, split)
            kind_deps.append(tuple(kind_index.get((d.stage, d.op), -1) for d in deps))
        crossing = [
            tuple(k >= 0 and rank_of[self.kinds[k][0]] != rank_of[stage] for k in deps)
            for (stage, _), deps in zip(self.kinds, kind_deps, strict=True)
        ]
        out, missing = [], [0] * len(actions)
        for i, (kind, action) in enumerate(zip(self.kind_of, actions, strict=True)):
            mine = []
            for k, crosses in zip(kind_deps[kind], crossing[kind], strict=True):
                j = slot[k * mbs + action[2]] if k >= 0 else -1
                if j < 0:
                    missing[i] += 1
                else:
                    mine.append((j, crosses))
            out.append(tuple(mine))
        return out, missing

    def _dependency_order(self, orders: list[list[Action]], missing: list[int]) -> list[int]:
        """Every rank runs its actions in order while their producers are done; a rank that
        waits parks on the producer it waits for. The actions that ran, in the order they
        ran (a dependency order); those waiting on a cycle or a missing producer are left
        out."""
        deps, done, order = self._deps, bytearray(len(self.actions)), []
        parked: dict[int, list[int]] = {}
        pos, ends, first = [], [], 0
        for acts in orders:
            pos.append(first)
            first += len(acts)
            ends.append(first)
        todo = list(range(len(orders)))
        while todo:
            rank = todo.pop()
            i, end = pos[rank], ends[rank]
            while i < end:
                if missing[i]:
                    break
                blocker = next((j for j, _ in deps[i] if not done[j]), None)
                if blocker is not None:
                    parked.setdefault(blocker, []).append(rank)
                    break
                done[i] = 1
                order.append(i)
                if i in parked:
                    todo.extend(parked.pop(i))
                i += 1
            pos[rank] = i
        return order

    @property
    def preds(self) -> list[tuple[tuple[int, bool], ...]]:
        """Per action: (index of a predecessor, whether the edge crosses ranks), the
        previous action on its rank first."""
        rank_of = self.rank_of
        return [
            (((i - 1, False),) if i and rank_of[i - 1] == rank_of[i] else ()) + deps
            for i, deps in enumerate(self._deps)
        ]

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
        free = [0] * self.placement.ranks  # when each rank finishes its last action so far
        hop, deps, rank_of = times.p2p, self._deps, self.rank_of
        for i in self.order:
            rank = rank_of[i]
            start = free[rank]
            for j, crosses in deps[i]:
                ready = end[j] + hop if crosses else end[j]
                if ready > start:
                    start = ready
            end[i] = free[rank] = start + duration[i]
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
