"""Replay a plan's compute actions in time: the shared engine of validation, lowering and
simulation. Dependencies come only from :func:`megatron_prt.core.deps.producers`."""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from operator import itemgetter

from .actions import Action, Op
from .deps import producers
from .grid import format_grid
from .placement import cut_index
from .plan import Plan
from .timing import StageTimes

_COMPUTE = frozenset(op for op in Op if op.is_compute)
_KIND = itemgetter(0, 1)  # action -> (stage, op)
_COMPILED = "_compiled_replayer"  # where compiled() keeps a plan's Replayer
_MB = itemgetter(2)


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
    ticks one cross-rank edge adds (per cut where the cuts differ: :attr:`StageTimes.p2p`).
    Exact, so a caller may compare ends for equality."""

    end: list[int]
    duration: list[int]
    hop: int | tuple[int, ...]
    tick: float

    @property
    def makespan(self) -> float:
        return max(self.end, default=0) * self.tick

    def cut_hop(self, stage: int, other: int) -> int:
        """Ticks the edge between neighbouring stages ``stage`` and ``other`` adds when it
        crosses ranks (:meth:`StageTimes.cut_hop`)."""
        if isinstance(self.hop, tuple):
            return self.hop[cut_index(stage, other, len(self.hop) + 1)]
        return self.hop


class Replayer:
    """A plan compiled for replay: its compute actions in one dependency order, each with
    its predecessors (the previous action on its rank, then its producers from
    :func:`megatron_prt.core.deps.producers`). Compile once, then :meth:`run` with as many
    stage times as needed. Raises :class:`PlanError` if the ranks block each other (a cyclic
    wait, i.e. a deadlock) or an action waits on one no rank runs.

    Compiling is linear in the plan with a small constant: the producers of each kind of
    action (stage, op) are asked of the dependency rule once and shifted to every
    micro-batch (the rule never crosses micro-batches); actions are found by
    ``kind * m + mb``; every action has two producer slots, pointing at index ``n`` (a
    placeholder that is always done) when it has fewer producers and at ``n + 1`` (never
    done) when no rank runs the producer."""

    def __init__(self, plan: Plan) -> None:
        self.placement, self._num_microbatches = plan.placement, plan.num_microbatches
        orders = [[a for a in acts if a[1] in _COMPUTE] for acts in plan.ranks]
        self.actions = actions = [a for acts in orders for a in acts]
        self.rank_of = [r for r, acts in enumerate(orders) for _ in acts]
        kinds_of = list(map(_KIND, actions))
        self.kinds = sorted(set(kinds_of))
        kind_index = {kind: i for i, kind in enumerate(self.kinds)}
        self.kind_of = list(map(kind_index.__getitem__, kinds_of))
        self._compile_deps(kind_index)
        self.order = self._dependency_order([len(acts) for acts in orders])
        if len(self.order) < len(actions):
            raise PlanError(_deadlock_message(plan, orders, self._done(orders)))

    @classmethod
    def from_tables(cls, plan: Plan, tables: dict) -> Replayer:
        """A Replayer of ``plan`` from tables its producer already holds (the list scheduler:
        :func:`megatron_prt.core.compiled.compiled_schedule`), skipping the derivation and the
        dependency walk. ``tables``: ``kinds``, ``kind_of`` as :meth:`__init__` would make
        them for a plan that passes it; ``actions``, ``rank_of``, ``dep`` and ``crosses``
        (two slots each), ``order`` (a dependency order; the producer vouches for it) and
        ``remote`` (:meth:`remote_producers`) as functions of no argument, called on first
        use; ``known``: ``{(stage times in ticks, tick): Ticks}`` that :meth:`run_ticks`
        returns without replaying (the producer's own timeline)."""
        replayer = cls.__new__(cls)
        replayer.placement, replayer._num_microbatches = plan.placement, plan.num_microbatches
        replayer.kinds, replayer.kind_of = tables["kinds"], tables["kind_of"]
        replayer._lazy, replayer._known = tables, tables["known"]
        return replayer

    @staticmethod
    def by_rows(where: list[int], width: int, lanes: list, shifts: list) -> list[int]:
        """A per-action table of a plan whose actions are the ids of a scheduler's graph
        (:func:`megatron_prt.core.compiled.compiled_schedule`; ``where[id]``: the action's
        index, ``n`` for an id the plan lacks, ``-1`` past ``n``), written one row of ids
        at a time: the ids of graph kind ``g = pipe * width + j`` are ``mb * width + j``
        over the pipeline's micro-batches, a strided slice when they are evenly spaced
        (``lanes``, :attr:`Plan.lanes`), so no id is looked up one by one. Per action: the
        index of its id ``+ shifts[g]`` (-1 past ``n``, where no row writes)."""
        n = len(where) // 2 - 1
        out = [-1] * (n + 1)  # out[n]: where the ids the plan lacks land
        for pipe, (first, step) in enumerate(lanes):
            for g in range(pipe * width, (pipe + 1) * width):
                start, stride, shift = first * width + g % width, step * width, shifts[g]
                if shift <= n:
                    values = where[start + shift : n + shift : stride]
                    deque(map(out.__setitem__, where[start:n:stride], values), maxlen=0)
        del out[n:]
        return out

    # made by __init__, or on first use from the tables of from_tables
    actions = functools.cached_property(lambda self: self._lazy["actions"]())
    rank_of = functools.cached_property(lambda self: self._lazy["rank_of"]())
    _dep = functools.cached_property(lambda self: self._lazy["dep"]())
    _crosses = functools.cached_property(lambda self: self._lazy["crosses"]())
    order = functools.cached_property(lambda self: self._lazy["order"]())
    _known: dict = {}  # noqa: RUF012 - read-only default: no timelines known

    def _compile_deps(self, kind_index: dict) -> None:
        """``dep[0][i]``, ``dep[1][i]``: action i's producer slots; ``crosses[0][i]``,
        ``crosses[1][i]``: whether that edge crosses ranks."""
        actions, n, placement = self.actions, len(self.actions), self.placement
        mb_of = list(map(_MB, actions))
        mbs = self._num_microbatches
        if mb_of and not (0 <= min(mb_of) and max(mb_of) < mbs):
            bad = next(a for a in actions if not 0 <= a[2] < mbs)
            raise PlanError(f"{bad} (mb {bad[2]}): no such micro-batch (m={mbs})")
        split = any(op is Op.I for _, op in self.kinds)
        rank_of = placement.stage_to_rank
        # where[kind * m + mb]: the action's index; two more blocks of m after the kinds':
        # n (no producer, always done) and n + 1 (a producer no rank runs, never done)
        none, nobody = len(self.kinds) * mbs, (len(self.kinds) + 1) * mbs
        where = [n + 1] * none + [n] * mbs + [n + 1] * mbs
        for i in range(n - 1, -1, -1):  # the first of any repeat wins
            where[self.kind_of[i] * mbs + mb_of[i]] = i
        # per kind and slot: (the producer's block in where, whether the edge crosses ranks)
        slots: list[list[tuple[int, bool]]] = [[], []]
        for stage, op in self.kinds:
            deps = producers(Action(stage, op, 0), placement, split)
            for slot in (0, 1):
                if slot >= len(deps):
                    slots[slot].append((none, False))
                    continue
                dep_kind = kind_index.get((deps[slot].stage, deps[slot].op))
                block = nobody if dep_kind is None else dep_kind * mbs
                slots[slot].append((block, rank_of[deps[slot].stage] != rank_of[stage]))
        self._dep, self._crosses = [], []
        for per_kind in slots:
            blocks = [block for block, _ in per_kind]
            starts = map(blocks.__getitem__, self.kind_of)
            self._dep.append([where[block + mb] for block, mb in zip(starts, mb_of, strict=True)])
            flags = [crosses for _, crosses in per_kind]
            self._crosses.append(list(map(flags.__getitem__, self.kind_of)))

    def _dependency_order(self, lengths: list[int]) -> list[int]:
        """Every rank runs its actions in order while their producers are done; a rank that
        waits parks on the producer it waits for. The actions that ran, in the order they
        ran (a dependency order); those waiting on a cycle or a missing producer are left
        out. One tight loop over all actions: this is most of validating a plan."""
        n = len(self.actions)
        first_dep, second_dep = self._dep
        done = bytearray(n + 2)
        done[n] = 1  # the placeholder for "no producer"
        parked: list[list[int] | None] = [None] * (n + 2)
        order: list[int] = []
        pos, ends, start = [], [], 0
        for length in lengths:
            pos.append(start)
            start += length
            ends.append(start)
        todo = list(range(len(lengths)))
        while todo:
            rank = todo.pop()
            i, end = pos[rank], ends[rank]
            while i < end:
                blocker = first_dep[i] if not done[first_dep[i]] else second_dep[i]
                if not done[blocker]:
                    if parked[blocker] is None:
                        parked[blocker] = [rank]
                    else:
                        parked[blocker].append(rank)
                    break
                done[i] = 1
                order.append(i)
                if parked[i] is not None:
                    todo += parked[i]
                i += 1
            pos[rank] = i
        return order

    @functools.cached_property
    def preds(self) -> list[tuple[tuple[int, bool], ...]]:
        """Per action: (index of a predecessor, whether the edge crosses ranks), the
        previous action on its rank first (built once: the partitioner walks it for every
        critical path)."""
        n, rank_of, out = len(self.actions), self.rank_of, []
        deps = zip(*self._dep, *self._crosses, strict=True)
        for i, (first, second, first_crosses, second_crosses) in enumerate(deps):
            mine = [(i - 1, False)] if i and rank_of[i - 1] == rank_of[i] else []
            mine += [(j, c) for j, c in ((first, first_crosses), (second, second_crosses)) if j < n]
            out.append(tuple(mine))
        return out

    def remote_producers(self) -> list[int]:
        """Per action: the index of its producer on another rank, or -1 (the dependency
        rule gives an action at most one producer on another rank: the tensor it
        receives)."""
        if "remote" in self.__dict__.get("_lazy", {}):
            return self._lazy["remote"]()
        n = len(self.actions)
        (first, second), (first_crosses, second_crosses) = self._dep, self._crosses
        if any(a and b for a, b in zip(first_crosses, second_crosses, strict=True)):
            raise ValueError("an action with two producers on other ranks: lowering needs one")
        return [
            a if ca and a < n else b if cb and b < n else -1
            for a, b, ca, cb in zip(first, second, first_crosses, second_crosses, strict=True)
        ]

    def _done(self, orders) -> tuple[list[int], set[Action]]:
        """At a deadlock: per rank the actions that ran, and the set of them."""
        ran = {self.actions[i] for i in self.order}
        return [sum(1 for a in acts if a in ran) for acts in orders], ran

    def run_ticks(self, times: StageTimes | None = None) -> Ticks:
        """Every action as soon as its rank is free and its producers are done (plus
        ``times.p2p`` per cross-rank hop); default times: :meth:`StageTimes.uniform`."""
        times, tick = (times or StageTimes.uniform(self.placement.depth)).in_ticks()
        known = self._known.get((times, tick))
        if known is not None:
            return known
        busy = [times.busy(Action(stage, op, 0), self.placement) for stage, op in self.kinds]
        duration = list(map(busy.__getitem__, self.kind_of))
        if times.per_cut:
            return self._run_per_cut(times, tick, duration)
        end = [0] * (len(duration) + 2)
        free = [0] * self.placement.ranks  # when each rank finishes its last action so far
        hop, rank_of = times.p2p, self.rank_of
        (first_dep, second_dep), (first_crosses, second_crosses) = self._dep, self._crosses
        for i in self.order:
            rank = rank_of[i]
            start = free[rank]
            ready = end[first_dep[i]] + (hop if first_crosses[i] else 0)
            if ready > start:
                start = ready
            ready = end[second_dep[i]] + (hop if second_crosses[i] else 0)
            if ready > start:
                start = ready
            end[i] = free[rank] = start + duration[i]
        del end[len(duration) :]
        return Ticks(end, duration, hop, tick)

    def _run_per_cut(self, times: StageTimes, tick: float, duration: list[int]) -> Ticks:
        """:meth:`run_ticks` where the cuts' hops differ: each edge adds its own cut's hop
        (the uniform loop stays free of the per-edge lookups)."""
        first_hop, second_hop = self._edge_hops(times)
        (first_dep, second_dep), rank_of = self._dep, self.rank_of
        end = [0] * (len(duration) + 2)
        free = [0] * self.placement.ranks
        for i in self.order:
            rank = rank_of[i]
            start = max(free[rank], end[first_dep[i]] + first_hop[i])
            start = max(start, end[second_dep[i]] + second_hop[i])
            end[i] = free[rank] = start + duration[i]
        del end[len(duration) :]
        return Ticks(end, duration, times.p2p, tick)

    def _edge_hops(self, times: StageTimes) -> tuple[list, list]:
        """Per action, for its two producer slots: the hop that edge adds under ``times``
        (0 on one rank; :meth:`StageTimes.cut_hop` across ranks)."""
        split = any(op is Op.I for _, op in self.kinds)
        out: tuple[list, list] = ([], [])
        for slot, crosses in enumerate(self._crosses):
            per_kind = []
            for stage, op in self.kinds:
                deps = producers(Action(stage, op, 0), self.placement, split)
                other = deps[slot].stage if slot < len(deps) else stage
                per_kind.append(times.cut_hop(stage, other) if other != stage else 0)
            hops = map(per_kind.__getitem__, self.kind_of)
            out[slot].extend(h if c else 0 for h, c in zip(hops, crosses, strict=True))
        return out

    def run(self, times: StageTimes | None = None) -> Timeline:
        """:meth:`run_ticks` as start and end times per action, in ``times`` units."""
        ticks = self.run_ticks(times)
        tick = ticks.tick
        start, end = {}, {}
        for action, e, d in zip(self.actions, ticks.end, ticks.duration, strict=True):
            start[action] = (e - d) * tick
            end[action] = e * tick
        return Timeline(start, end)


def compiled(plan: Plan, fresh: bool = False) -> Replayer:
    """``plan``'s :class:`Replayer`, compiled on first use and kept with the plan (plans are
    immutable; :meth:`Plan.__getstate__` leaves it out of pickles). Validation, lowering
    and replays of one plan share it; raises :class:`PlanError` like :class:`Replayer`.
    ``fresh``: compile from the actions even if one is kept (a full validation's walk)."""
    replayer = plan.__dict__.get(_COMPILED)
    if replayer is None or fresh:
        replayer = Replayer(plan)
        keep_compiled(plan, replayer)
    elif not isinstance(replayer, Replayer):  # a maker kept by the plan's producer
        replayer = replayer(plan)
        keep_compiled(plan, replayer)
    return replayer


def keep_compiled(plan: Plan, replayer: Replayer | Callable[[Plan], Replayer]) -> None:
    """Keep ``replayer`` with ``plan``: it must be a compiled plan with the same compute
    actions (e.g. the plan ``plan`` was lowered from), or a function of the plan that makes
    one on first use (a producer that holds the tables cheaply, when a caller may never
    replay; a function of the plan rather than one holding it, so no cycle keeps it)."""
    object.__setattr__(plan, _COMPILED, replayer)


def replay(plan: Plan, times: StageTimes | None = None) -> Timeline:
    """Run every rank's compute actions in order, each as soon as its rank is free and its
    producers are done (plus ``times.p2p`` per cross-rank hop). Raises :class:`PlanError` if
    the ranks block each other (a cyclic wait, i.e. a deadlock). The compiled plan is kept
    with the plan (:func:`compiled`), so replaying one plan under many stage times compiles
    it once."""
    return compiled(plan).run(times)


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
