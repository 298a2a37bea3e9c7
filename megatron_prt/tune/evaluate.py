"""Judging partitions exactly: the pool of simulated ones (makespan by replay, memory by the
memory model), the critical paths the surrogate learns from, and the objectives."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from ..core.actions import Op
from ..core.placement import ConfigError, cut_index
from ..core.replay import Replayer, Ticks
from .memory import dot, format_bytes
from .problem import Problem, StageCosts

KEPT_CUTS = 24  # critical paths the surrogate keeps (the most recent)
REL = 1e-9  # relative tolerance of score comparisons and of the budget


@dataclass(frozen=True)
class Point:
    """A simulated partition: makespan (time unit) and per-rank peak bytes."""

    counts: tuple[int, ...]
    makespan: float
    rank_peaks: tuple[float, ...]

    @property
    def peak(self) -> float:
        return max(self.rank_peaks)


@dataclass(frozen=True)
class Cut:
    """A critical path of a simulated partition as a function of stage and hop times:
    ``const + sum_k fwd_coef[k]*fwd[k] + bwd_coef[k]*bwd[k] + sum_c hop_coef[c]*hop[c]``
    (``hop[c]``: cut c's hop, which moves with the split where each cut sends its own
    message). It is the length of a path of the plan, so it is at most the makespan of any
    partition (up to tick rounding)."""

    const: float
    fwd_coef: list[float]
    bwd_coef: list[float]
    hop_coef: list[float]

    def value(self, costs: StageCosts) -> float:
        stages = dot(self.fwd_coef, costs.fwd) + dot(self.bwd_coef, costs.bwd)
        return self.const + stages + dot(self.hop_coef, costs.hop)


class Pool:
    """Every partition simulated so far, and the critical paths of the latest ones."""

    def __init__(self, problem: Problem) -> None:
        self.problem = problem
        self.points: dict[tuple[int, ...], Point] = {}
        self.cuts: list[Cut] = []

    def add(self, counts: Sequence[int]) -> Point:
        counts = tuple(counts)
        if counts not in self.points:
            pr = self.problem
            ticks = pr.replayer.run_ticks(pr.stage_times(counts))
            makespan = ticks.makespan
            fwd_coef, bwd_coef, hop_coef = critical_path(pr.replayer, ticks)
            costs = pr.stage_costs(counts)
            self.points[counts] = Point(counts, makespan, tuple(pr.rank_memory(costs)))
            cut = Cut(0.0, fwd_coef, bwd_coef, hop_coef)
            cut = replace(cut, const=makespan - cut.value(costs))
            self.cuts = [*self.cuts[1 - KEPT_CUTS :], cut]
        return self.points[counts]

    def fastest(self) -> Point:
        return min(self.points.values(), key=lambda p: (p.makespan, p.peak, p.counts))

    def best(self, spec: Spec) -> Point:
        return min(self.points.values(), key=spec.exact_key)


def critical_path(replayer: Replayer, ticks: Ticks) -> tuple[list[float], list[float], list[float]]:
    """One critical path of a replay as per-model-stage counts of forwards and of backwards
    on it (I and W count half a backward each), and per cut the hops it waits for: from the
    last action to end, walk back along predecessors that finished exactly when their
    successor began (a producer on another rank one hop earlier)."""
    placement, end, duration = replayer.placement, ticks.end, ticks.duration
    fwd_coef, bwd_coef = [0.0] * placement.depth, [0.0] * placement.depth
    hop_coef = [0.0] * (placement.depth - 1)
    i: int | None = max(range(len(end)), key=end.__getitem__, default=None)
    while i is not None:
        action = replayer.actions[i]
        k = placement.model_stage(action.stage)
        if action.op is Op.F:
            fwd_coef[k] += 1
        else:
            bwd_coef[k] += 1 if action.op is Op.B else 0.5
        begin = end[i] - duration[i]
        stage, actions = action.stage, replayer.actions
        i, crosses = next(
            (
                (j, crosses)
                for j, crosses in replayer.preds[i]
                if end[j] + (ticks.cut_hop(actions[j].stage, stage) if crosses else 0) == begin
            ),
            (None, False),
        )
        if crosses:
            hop_coef[cut_index(actions[i].stage, stage, placement.depth)] += 1
    return fwd_coef, bwd_coef, hop_coef


@dataclass(frozen=True)
class Spec:
    """``time``: minimise makespan with every rank's peak <= ``limit`` bytes. ``memory``:
    minimise the largest peak with makespan <= ``limit`` (time unit). Scores are tuples,
    smaller is better: (constraint excess, objective, a tie-break that spreads the load,
    the other quantity)."""

    kind: str
    limit: float = math.inf

    def score(self, time: float, lbs: Sequence[float], mems: Sequence[float]) -> tuple:
        if self.kind == "time":
            excess = sum(max(0.0, m - self.limit) for m in mems)
            return (excess, time, sum(x * x for x in lbs), max(mems))
        return (max(0.0, time - self.limit), max(mems), sum(x * x for x in mems), time)

    def exact_key(self, point: Point) -> tuple:
        if self.kind == "time":
            excess = sum(max(0.0, m - self.limit) for m in point.rank_peaks)
            return (excess, point.makespan, point.peak, point.counts)
        return (max(0.0, point.makespan - self.limit), point.peak, point.makespan, point.counts)

    @property
    def needs_time(self) -> bool:
        """Whether the makespan decides more than the last tie-break."""
        return self.kind == "time" or self.limit < math.inf

    def hot_by_memory(self, excess: float) -> bool:
        """Whether the worst ranks are the memory-heaviest (else the slowest)."""
        return (self.kind == "time") == (excess > 0)


def better(a: tuple, b: tuple) -> bool:
    """Lexicographic ``a < b`` that treats float noise as a tie."""
    for x, y in zip(a, b, strict=True):
        eps = REL * max(1.0, abs(x), abs(y))
        if x < y - eps:
            return True
        if x > y + eps:
            return False
    return False


def choose(pool: Pool, budget: float | None, slack: float) -> Point:
    points = list(pool.points.values())
    if budget is None:
        cap = pool.fastest().makespan * (1 + slack) * (1 + REL)
        return min((p for p in points if p.makespan <= cap), key=Spec("memory", cap).exact_key)
    fits = [p for p in points if p.peak <= budget * (1 + REL)]
    if not fits:
        least = min(points, key=lambda p: (p.peak, p.makespan, p.counts))
        rank = least.rank_peaks.index(least.peak)
        raise ConfigError(
            f"no layer partition fits the budget of {format_bytes(budget)} per rank: the "
            f"smallest peak found is {format_bytes(least.peak)} (rank {rank}, stage layers "
            f"{','.join(map(str, least.counts))}); raise the budget or lower activation "
            "memory (fewer micro-batches in flight, recomputation, more ranks)"
        )
    return min(fits, key=Spec("time", budget * (1 + REL)).exact_key)
