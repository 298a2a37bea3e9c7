"""Memory-balanced layer partition: how many transformer layers each model stage gets.

Problem. ``D = R*P`` model stages in flow order share ``L`` transformer layers; model stage
``k`` gets the contiguous run ``stage_layers[k]`` (the embedding always sits on stage 0 and
the head on stage ``D-1``, see :mod:`megatron_prt.sim.cost`). The memory of a rank is its
peak of in-flight activation bytes plus the parameter bytes of its stages (both replicas
for ``bi``), in bytes; time is the simulated makespan of one iteration, in the cost
model's time unit. :func:`partition` solves one of two problems:

* ``budget_bytes`` given: the fastest partition whose every rank peaks at or below the
  budget (:class:`ConfigError` naming the smallest peak found if none does);
* no budget: among partitions at most ``1 + slack`` times slower than the fastest one
  found, the one whose largest per-rank peak is smallest. ``slack`` (default
  :data:`DEFAULT_SLACK`, 3%) is the time we may give up for memory: a few percent is
  within the error of the simulator against measured steps (see README "Measured
  speed"), so a plan 3% slower on paper is not reliably slower, while the memory it
  saves is exact accounting.

Which plan. A partition is timed on the plan the runtime executes for it:
``build_plan(placement, m, schedule)`` with uniform stage times (the megatron-core
integration and the plain-PyTorch runtime build exactly this plan whatever the layer
counts). The action *order* is therefore fixed and only durations and activation sizes
change with the partition: the plan is built once and replayed with each candidate's stage
costs. On one rank the order also fixes which (stage, micro-batch) activations are alive
after every forward, so a rank's peak is the largest of a few in-flight count vectors
dotted with its stages' activation sizes: the simulator's accounting (a forward allocates
at its start, a backward frees at its end), without re-simulating. Every answer is checked
with :func:`megatron_prt.sim.simulate.simulate`, which ``megatron-prt simulate --costs``
runs on the same plan (unless ``--plan-from-costs``). The bi replica-gradient sum
(``replica_*`` costs) is left out, of the search and of the makespans reported: it comes
after the step and depends on the partition only through the gradient bytes per rank.

Zero-layer stages. With ``L >= D`` every stage keeps at least one layer, except that the
embedding stage 0 and the head stage ``D-1`` may hold no transformer layer (the embedding
or the head is then the whole stage). With ``L < D`` some stages must be empty and any
stage may be; an empty stage without embedding or head only forwards tensors.

Algorithm. If there are at most :data:`EXHAUSTIVE_LIMIT` admissible partitions (fewer for
long plans), all are simulated: the answer is exact. Otherwise a local search moves one
layer at a time from a stage of one of the worst ranks to another stage (the stages in
between shift by one layer, keeping their counts). A surrogate ranks the moves: memory
exactly as above, time as the larger of a per-rank lower bound (the forward and backward
fill before the rank's first stage plus all its work) and the critical paths of the latest
simulated partitions (each a linear function of stage times, exact where it came from).
The best-ranked moves are simulated and the first that improves the simulated score is
taken; at a local optimum, pairs of moves are tried. Phases: the fastest partition; the
least memory at any speed; then, without a budget, the least memory under the time cap,
searched from the fastest partition, from the least-memory one and from the best mix of
the two; with a budget that the fastest partitions exceed, the same under time caps
bisected between the two ends, then the fastest within the budget.

Guarantees. Exhaustive: optimal (ties within float noise). Heuristic: the answer is a
simulated partition; the uniform one is simulated too, so the answer never loses to it on
the objective (with a budget the uniform fits, the answer is at least as fast; without,
if the uniform is within the slack, the answer peaks no higher); no screened single move
improves it; there is no global-optimality guarantee. Forced onto the small cases of
``tests/test_partition.py`` it comes within 1% of brute force.
"""

from __future__ import annotations

import math
import operator
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from itertools import accumulate, combinations, count, pairwise

from ..core.actions import Action, Op
from ..core.deps import producers
from ..core.layers import even_layers
from ..core.placement import ConfigError, Placement
from ..core.plan import Plan
from ..core.replay import PlanError
from ..core.schedules import build_plan
from ..core.timing import StageTimes
from ..sim.cost import CostModel
from ..sim.simulate import RankStats, simulate

DEFAULT_SLACK = 0.03  # fraction of the fastest makespan given up for memory
EXHAUSTIVE_LIMIT = 2000  # simulate every partition when there are at most this many ...
_EXHAUSTIVE_WORK = 4_000_000  # ... and simulating them all replays at most this many actions
_TRIES = 4  # best-screened moves judged per step, at least ...
_STEP_WORK = 50_000  # ... or as many as this many simulated actions allow
_ESCAPES = 8  # least-bad first moves tried for an improving pair at a local optimum
_HOT_RANKS = 2  # donors come from at least this many worst ranks ...
_SCREEN_PAIRS = 3_000  # ... or from as many as keep the screened moves per step near this
_KEPT_CUTS = 24  # critical paths the surrogate keeps (the most recent)
_BLENDS = 8  # mixes of the fastest and the least-memory partition tried as starts
_FAR_WORK = 1_000_000  # walks from far starts take this / (actions in the plan) steps ...
_FAR_STEPS = 32  # ... or at least this many; with fewer, the least-memory start is skipped
_RECAPS = 4  # memory searches rerun when one of them finds a faster partition
_BISECTIONS = 6  # time caps tried when the fastest partitions exceed the budget
_REL = 1e-9  # relative tolerance of score comparisons and of the budget

uniform_layers = even_layers  # the runtime's default split, the partitioner's baseline


# -- results -------------------------------------------------------------------------------
@dataclass(frozen=True)
class PartitionStats:
    """One partition simulated on the runtime's plan. ``stage_layers``: transformer layers of
    model stages ``0..D-1``; ``makespan``: one iteration, cost-model time unit;
    ``per_rank``: the simulator's busy time, peak activation bytes and parameter bytes."""

    stage_layers: tuple[int, ...]
    makespan: float
    per_rank: tuple[RankStats, ...]

    @property
    def rank_peak_bytes(self) -> tuple[float, ...]:
        """Per rank: peak activation bytes + parameter bytes."""
        return tuple(r.peak_activation_bytes + r.param_bytes for r in self.per_rank)

    @property
    def peak_bytes(self) -> float:
        """The largest per-rank peak (activations + parameters), bytes."""
        return max(self.rank_peak_bytes)

    def to_dict(self) -> dict:
        return {
            "stage_layers": list(self.stage_layers),
            "makespan": self.makespan,
            "peak_bytes": self.peak_bytes,
            "per_rank": [r.to_dict() for r in self.per_rank],
        }


@dataclass(frozen=True)
class PartitionResult:
    """``balanced``: the chosen partition; ``uniform``: the even split, for comparison.
    ``objective``: ``"time"`` (fastest within ``budget_bytes``) or ``"memory"`` (smallest
    peak within ``slack`` of ``fastest_makespan``, the fastest partition found). ``exact``:
    every admissible partition was simulated. ``simulated``: how many were."""

    balanced: PartitionStats
    uniform: PartitionStats
    objective: str
    budget_bytes: float | None
    slack: float
    fastest_makespan: float
    exact: bool
    simulated: int

    @property
    def stage_layers(self) -> tuple[int, ...]:
        return self.balanced.stage_layers

    @property
    def makespan(self) -> float:
        return self.balanced.makespan

    def to_dict(self) -> dict:
        return {
            "objective": self.objective,
            "budget_bytes": self.budget_bytes,
            "slack": self.slack,
            "fastest_makespan": self.fastest_makespan,
            "exact": self.exact,
            "simulated": self.simulated,
            "balanced": self.balanced.to_dict(),
            "uniform": self.uniform.to_dict(),
        }


# -- public entry points ---------------------------------------------------------------------
def partition(
    cost: CostModel,
    placement: Placement,
    num_microbatches: int,
    *,
    budget_bytes: float | None = None,
    slack: float = DEFAULT_SLACK,
    schedule: str = "prt",
) -> PartitionResult:
    """Choose ``stage_layers`` for ``cost.layers`` (its own ``stage_layers`` are ignored).

    ``budget_bytes``: per-rank limit on peak activation + parameter bytes; the answer is
    the fastest partition within it. Without it: the smallest largest per-rank peak among
    partitions whose makespan is within ``slack`` (a fraction, >= 0) of the fastest found.
    Deterministic. Raises :class:`ConfigError` for bad input or an unreachable budget."""
    _check_request(cost, budget_bytes, slack)
    plan = build_plan(placement, num_microbatches, schedule)
    problem = _Problem(cost, plan)
    pool = _Pool(problem)
    uniform = uniform_layers(problem.num_layers, problem.depth)
    admissible = _count_partitions(problem.num_layers, problem.lows)
    exact = (
        admissible <= EXHAUSTIVE_LIMIT and admissible * problem.replayer.size <= _EXHAUSTIVE_WORK
    )
    if exact:
        for counts in _partitions(problem.num_layers, problem.lows):
            pool.add(counts)
    else:
        _search(pool, problem, uniform, budget_bytes, slack)
    best = _choose(pool, budget_bytes, slack)
    return PartitionResult(
        balanced=_stats(plan, cost, best.counts),
        uniform=_stats(plan, cost, uniform),
        objective="memory" if budget_bytes is None else "time",
        budget_bytes=budget_bytes,
        slack=slack,
        fastest_makespan=pool.fastest().makespan,
        exact=exact,
        simulated=len(pool.points),
    )


def min_stage_layers(cost: CostModel, depth: int) -> tuple[int, ...]:
    """Fewest layers each model stage may get (see "Zero-layer stages" above)."""
    if len(cost.layers) < depth:
        return (0,) * depth
    lows = [1] * depth
    if cost.embedding is not None:
        lows[0] = 0
    if cost.head is not None:
        lows[-1] = 0
    return tuple(lows)


def format_bytes(value: float) -> str:
    """``value`` bytes in binary units, 3 significant digits: ``'47.3 GiB'``."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(value) >= size:
            return f"{value / size:.3g} {unit}"
    return f"{value:.3g} B"


def _check_request(cost: CostModel, budget_bytes: float | None, slack: float) -> None:
    if not cost.layers:
        raise ConfigError(
            'partitioning needs per-layer costs: give a "layers" list in the cost model '
            "(see megatron_prt/sim/cost.py)"
        )
    if budget_bytes is not None and not budget_bytes > 0:
        raise ConfigError(f"budget must be > 0 bytes, got {budget_bytes!r}")
    if not (isinstance(slack, (int, float)) and 0 <= slack < math.inf):
        raise ConfigError(f"slack must be a fraction >= 0 (0.03 = 3%), got {slack!r}")


def _stats(plan: Plan, cost: CostModel, counts: Sequence[int]) -> PartitionStats:
    """Simulated without the bi replica-gradient sum, like the search (module docstring)."""
    result = simulate(plan, replace(cost.without_replica_sync(), stage_layers=tuple(counts)))
    return PartitionStats(tuple(counts), result.makespan, result.per_rank)


# -- the fixed part: plan shape and layer costs ------------------------------------------------
@dataclass(frozen=True)
class _Costs:
    """Per model stage: forward and backward time, activation and parameter bytes."""

    fwd: list[float]
    bwd: list[float]
    act: list[float]
    param: list[float]


class _Problem:
    """Everything that does not change with the partition: the plan (compiled for replay)
    and what its order says about memory, per-layer prefix sums, admissible counts."""

    def __init__(self, cost: CostModel, plan: Plan) -> None:
        placement = plan.placement
        self.cost, self.plan, self.placement = cost, plan, placement
        self.depth = placement.depth
        self.num_layers = len(cost.layers)
        self.lows = min_stage_layers(cost, self.depth)
        self.layer_costs = [(c.fwd, c.bwd, c.act, c.param) for c in cost.layers]
        self.prefix = {
            attr: (0.0, *accumulate(getattr(layer, attr) for layer in cost.layers))
            for attr in ("fwd", "bwd", "act", "param")
        }
        ends = (cost.embedding, cost.head)
        self.ends = {
            attr: tuple(getattr(e, attr) if e is not None else 0.0 for e in ends)
            for attr in ("fwd", "bwd", "act", "param")
        }
        mbs_of_pipeline = [plan.mb_pipeline.count(p) for p in range(placement.num_pipelines)]
        self.slots = [[placement.model_stage(s) for s in st] for st in placement.rank_stages]
        self.slot_mbs = [
            [mbs_of_pipeline[placement.pipeline_of(s)] for s in st] for st in placement.rank_stages
        ]
        self.holders: list[list[tuple[int, int]]] = [[] for _ in range(self.depth)]
        for rank, slots in enumerate(self.slots):
            for slot, k in enumerate(slots):
                self.holders[k].append((rank, slot))
        self.first = [
            min((k for k, n in zip(slots, mbs, strict=True) if n), default=self.depth)
            for slots, mbs in zip(self.slots, self.slot_mbs, strict=True)
        ]
        self.vectors = [_inflight_vectors(plan, rank) for rank in range(placement.ranks)]
        self.message_busy = _message_busy(plan, cost.p2p_cpu)
        self.replayer = _Replayer(plan)

    def stage_costs(self, counts: Sequence[int]) -> _Costs:
        starts = [0, *accumulate(counts)]
        out = {}
        for attr, prefix in self.prefix.items():
            values = [prefix[starts[k + 1]] - prefix[starts[k]] for k in range(self.depth)]
            values[0] += self.ends[attr][0]
            values[-1] += self.ends[attr][1]
            if attr == "act":
                values = [
                    v + self.cost.empty_stage_act(k, counts[k], self.depth)
                    for k, v in enumerate(values)
                ]
            out[attr] = values
        return _Costs(out["fwd"], out["bwd"], out["act"], out["param"])

    def stage_times(self, counts: Sequence[int]) -> StageTimes:
        """The simulator's stage times for ``counts`` (same sums, same rounding)."""
        return replace(self.cost, stage_layers=tuple(counts)).stage_times(self.placement)

    def rank_memory(self, costs: _Costs) -> list[float]:
        """Per rank: peak activation bytes + parameter bytes."""
        out = []
        for rank, slots in enumerate(self.slots):
            sizes = [costs.act[k] for k in slots]
            peak_act = max((_dot(v, sizes) for v in self.vectors[rank]), default=0.0)
            out.append(peak_act + sum(costs.param[k] for k in slots))
        return out


def _dot(counts: Sequence[float], sizes: Sequence[float]) -> float:
    return sum(n * s for n, s in zip(counts, sizes, strict=True) if n)


def _inflight_vectors(plan: Plan, rank: int) -> list[tuple[int, ...]]:
    """Activations alive on ``rank`` right after each forward, per slot (the rank's stages
    in chunk order), keeping only vectors no other one dominates. The rank runs its actions
    one after the other, so the plan's order is the order of allocations (forward start)
    and frees (backward end). (Exact unless a zero-time backward frees bytes at the very
    instant of a later forward, which no real cost model has.)"""
    slot_of = {stage: i for i, stage in enumerate(plan.placement.rank_stages[rank])}
    alive = [0] * len(slot_of)
    seen: set[tuple[int, ...]] = set()
    for action in plan.compute_actions(rank):
        if action.op is Op.F:
            alive[slot_of[action.stage]] += 1
            seen.add(tuple(alive))
        elif action.op in (Op.B, Op.W):
            alive[slot_of[action.stage]] -= 1
    kept: list[tuple[int, ...]] = []
    for v in sorted(seen, key=lambda v: (-sum(v), v)):  # a dominating vector comes first
        if not any(all(a >= b for a, b in zip(k, v, strict=True)) for k in kept):
            kept.append(v)
    return kept


def _message_busy(plan: Plan, p2p_cpu: float) -> list[float]:
    """Per rank: compute time its messages cost it (``p2p_cpu`` each), fixed by the plan."""
    if not p2p_cpu:
        return [0.0] * plan.placement.ranks
    zeros = (0.0,) * plan.placement.depth
    times = StageTimes(zeros, zeros, 0.0, p2p_cpu)
    return [
        sum(times.busy(a, plan.placement) for a in plan.compute_actions(rank))
        for rank in range(plan.placement.ranks)
    ]


class _Replayer:
    """The plan compiled for fast replays: its actions in a dependency order, each with its
    predecessors (the previous action on its rank, then its producers from
    :func:`megatron_prt.core.deps.producers`). :meth:`run` computes what
    :func:`megatron_prt.core.replay.replay` computes, in the same integer ticks, so the
    makespan is bit-identical, about five times faster."""

    def __init__(self, plan: Plan) -> None:
        placement = plan.placement
        self.placement = placement
        actions = [a for rank in range(placement.ranks) for a in plan.compute_actions(rank)]
        index = {a: i for i, a in enumerate(actions)}
        rank_of = placement.stage_to_rank
        preds: list[list[tuple[int, bool]]] = [[] for _ in actions]
        for rank in range(placement.ranks):
            for prev, action in pairwise(plan.compute_actions(rank)):
                preds[index[action]].append((index[prev], False))
        split = plan.split_backward  # a scan of the whole plan: once
        for i, action in enumerate(actions):
            for dep in producers(action, placement, split):
                preds[i].append((index[dep], rank_of[dep.stage] != rank_of[action.stage]))
        self.actions = actions
        self.size = len(actions)
        self.preds = [tuple(p) for p in preds]
        self.order = _dependency_order(self.preds)
        self.kinds = sorted({(a.stage, a.op) for a in actions})
        kind_index = {kind: i for i, kind in enumerate(self.kinds)}
        self.kind_of = [kind_index[(a.stage, a.op)] for a in actions]

    def run(self, times: StageTimes) -> tuple[float, list[float], list[float]]:
        """(makespan, and one critical path as per-model-stage counts of forwards and of
        backwards on it; I and W count half a backward each)."""
        ticks, tick = times.in_ticks()
        busy = [ticks.busy(Action(stage, op, 0), self.placement) for stage, op in self.kinds]
        duration = [busy[k] for k in self.kind_of]
        end = [0] * len(duration)
        hop = ticks.p2p
        for i in self.order:
            start = 0
            for j, crosses in self.preds[i]:
                ready = end[j] + hop if crosses else end[j]
                if ready > start:
                    start = ready
            end[i] = start + duration[i]
        last = max(range(len(end)), key=end.__getitem__, default=None)
        if last is None:
            return 0.0, [], []
        fwd_coef, bwd_coef = self._critical_path(last, end, duration, hop)
        return end[last] * tick, fwd_coef, bwd_coef

    def _critical_path(self, last: int, end, duration, hop) -> tuple[list[float], list[float]]:
        """Walk back along predecessors that finished exactly when their successor began."""
        depth = self.placement.depth
        fwd_coef, bwd_coef = [0.0] * depth, [0.0] * depth
        i: int | None = last
        while i is not None:
            action = self.actions[i]
            k = self.placement.model_stage(action.stage)
            if action.op is Op.F:
                fwd_coef[k] += 1
            else:
                bwd_coef[k] += 1 if action.op is Op.B else 0.5
            begin = end[i] - duration[i]
            i = next(
                (j for j, crosses in self.preds[i] if end[j] + (hop if crosses else 0) == begin),
                None,
            )
        return fwd_coef, bwd_coef


def _dependency_order(preds: Sequence[Sequence[tuple[int, bool]]]) -> list[int]:
    waiting = [len(p) for p in preds]
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
    if len(order) != len(preds):  # build_plan's plans are valid; a foreign one may not be
        raise PlanError("plan deadlocks: its ranks wait on each other in a cycle")
    return order


# -- exact evaluation ----------------------------------------------------------------------
@dataclass(frozen=True)
class _Point:
    """A simulated partition: makespan (time unit) and per-rank peak bytes."""

    counts: tuple[int, ...]
    makespan: float
    rank_peaks: tuple[float, ...]

    @property
    def peak(self) -> float:
        return max(self.rank_peaks)


@dataclass(frozen=True)
class _Cut:
    """A critical path of a simulated partition as a function of stage times:
    ``const + sum_k fwd_coef[k]*fwd[k] + bwd_coef[k]*bwd[k]``. It is the length of a path
    of the plan, so it is at most the makespan of any partition (up to tick rounding)."""

    const: float
    fwd_coef: list[float]
    bwd_coef: list[float]

    def value(self, costs: _Costs) -> float:
        return self.const + _dot(self.fwd_coef, costs.fwd) + _dot(self.bwd_coef, costs.bwd)


class _Pool:
    """Every partition simulated so far, and the critical paths of the latest ones."""

    def __init__(self, problem: _Problem) -> None:
        self.problem = problem
        self.points: dict[tuple[int, ...], _Point] = {}
        self.cuts: list[_Cut] = []

    def add(self, counts: Sequence[int]) -> _Point:
        counts = tuple(counts)
        if counts not in self.points:
            pr = self.problem
            makespan, fwd_coef, bwd_coef = pr.replayer.run(pr.stage_times(counts))
            costs = pr.stage_costs(counts)
            self.points[counts] = _Point(counts, makespan, tuple(pr.rank_memory(costs)))
            length = _dot(fwd_coef, costs.fwd) + _dot(bwd_coef, costs.bwd)
            self.cuts = [*self.cuts[1 - _KEPT_CUTS :], _Cut(makespan - length, fwd_coef, bwd_coef)]
        return self.points[counts]

    def fastest(self) -> _Point:
        return min(self.points.values(), key=lambda p: (p.makespan, p.peak, p.counts))

    def best(self, spec: _Spec) -> _Point:
        return min(self.points.values(), key=spec.exact_key)


# -- objectives ------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Spec:
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

    def exact_key(self, point: _Point) -> tuple:
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


def _better(a: tuple, b: tuple) -> bool:
    """Lexicographic ``a < b`` that treats float noise as a tie."""
    for x, y in zip(a, b, strict=True):
        eps = _REL * max(1.0, abs(x), abs(y))
        if x < y - eps:
            return True
        if x > y + eps:
            return False
    return False


def _choose(pool: _Pool, budget: float | None, slack: float) -> _Point:
    points = list(pool.points.values())
    if budget is None:
        cap = pool.fastest().makespan * (1 + slack) * (1 + _REL)
        return min((p for p in points if p.makespan <= cap), key=_Spec("memory", cap).exact_key)
    fits = [p for p in points if p.peak <= budget * (1 + _REL)]
    if not fits:
        least = min(points, key=lambda p: (p.peak, p.makespan, p.counts))
        rank = least.rank_peaks.index(least.peak)
        raise ConfigError(
            f"no layer partition fits the budget of {format_bytes(budget)} per rank: the "
            f"smallest peak found is {format_bytes(least.peak)} (rank {rank}, stage layers "
            f"{','.join(map(str, least.counts))}); raise the budget or lower activation "
            "memory (fewer micro-batches in flight, recomputation, more ranks)"
        )
    return min(fits, key=_Spec("time", budget * (1 + _REL)).exact_key)


# -- exhaustive enumeration ------------------------------------------------------------------
def _count_partitions(num_layers: int, lows: Sequence[int]) -> int:
    free = num_layers - sum(lows)
    return math.comb(free + len(lows) - 1, len(lows) - 1) if free >= 0 else 0


def _partitions(num_layers: int, lows: Sequence[int]) -> Iterator[tuple[int, ...]]:
    """Every admissible partition (stars and bars over the layers above the minimums)."""
    free, depth = num_layers - sum(lows), len(lows)
    for bars in combinations(range(free + depth - 1), depth - 1):
        edges = (-1, *bars, free + depth - 1)
        yield tuple(lows[k] + edges[k + 1] - edges[k] - 1 for k in range(depth))


# -- the heuristic search --------------------------------------------------------------------
def _search(
    pool: _Pool, problem: _Problem, uniform: tuple[int, ...], budget: float | None, slack: float
) -> None:
    """Fill ``pool`` with simulated partitions, ending at local optima of the objective."""
    for start in _starts(problem, uniform):
        pool.add(start)
    _improve(pool, problem, _Spec("time"))
    # the other end of the trade-off: the constrained searches start from both ends
    least = _improve(pool, problem, _Spec("memory"))
    if budget is None:
        cap = pool.fastest().makespan * (1 + slack)
        _improve_from_both_ends(pool, problem, _Spec("memory", cap), least)
        for _ in range(_RECAPS):  # a faster partition found on the way tightens the cap
            if pool.fastest().makespan * (1 + slack) == cap:
                return
            cap = pool.fastest().makespan * (1 + slack)
            _improve(pool, problem, _Spec("memory", cap))
        return
    fits = _Spec("time", budget * (1 + _REL))
    if pool.best(fits).peak > fits.limit and pool.points[least].peak <= fits.limit:
        _trade_time_for_memory(pool, problem, fits.limit, least)
    if pool.best(fits).peak <= fits.limit:
        _improve(pool, problem, fits)


def _trade_time_for_memory(
    pool: _Pool, problem: _Problem, budget: float, least: tuple[int, ...]
) -> None:
    """Reach the budget from the memory side: least memory under a time cap, bisecting
    on the cap between the fastest and the least-memory partition (``least``). Searching
    time under the memory limit straight away stalls more often: the feasible set is
    narrow, and memory is what the surrogate knows exactly."""
    low, high = pool.fastest().makespan, pool.points[least].makespan
    for _ in range(_BISECTIONS):
        cap = (low + high) / 2
        spec = _Spec("memory", cap)
        _improve_from_both_ends(pool, problem, spec, least)
        best = pool.best(spec)
        if best.peak <= budget and best.makespan <= cap:
            high = best.makespan
        else:
            low = cap


def _improve_from_both_ends(
    pool: _Pool, problem: _Problem, spec: _Spec, least: tuple[int, ...]
) -> None:
    """Least memory under a time cap from three starts that reach different local optima:
    the best partition so far (usually fast), the least-memory one (usually too slow) and
    the best mix of the two. The last two walk a bounded number of steps, and on long plans
    the least-memory start is skipped: the way back under the cap is long there and every
    step simulates."""
    fast = _improve(pool, problem, spec)
    steps = _FAR_WORK // problem.replayer.size
    if steps >= _FAR_STEPS:
        _improve(pool, problem, spec, least, steps)
    mixes = [_mix(fast, least, i / _BLENDS) for i in range(1, _BLENDS)]
    for counts in mixes:
        pool.add(counts)
    best_mix = min(mixes, key=lambda c: spec.exact_key(pool.points[c]))
    _improve(pool, problem, spec, best_mix, max(steps, _FAR_STEPS))


def _mix(a: Sequence[int], b: Sequence[int], weight: float) -> tuple[int, ...]:
    """Counts ``weight`` of the way from ``a`` to ``b``, rounded by largest remainder: they
    sum to the same layers and, like ``a`` and ``b``, respect the minimums."""
    target = [(1 - weight) * x + weight * y for x, y in zip(a, b, strict=True)]
    counts = [math.floor(t) for t in target]
    by_remainder = sorted(range(len(counts)), key=lambda k: (counts[k] - target[k], k))
    for k in by_remainder[: sum(a) - sum(counts)]:
        counts[k] += 1
    return tuple(counts)


def _starts(problem: _Problem, uniform: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Uniform, evenly spread (remainder spread out, not at the front) and time-balanced."""
    layers, depth = problem.num_layers, problem.depth
    spread = tuple((k + 1) * layers // depth - k * layers // depth for k in range(depth))
    starts = [uniform, spread, _time_balanced(problem)]
    return [s for i, s in enumerate(starts) if s not in starts[:i]]


def _time_balanced(problem: _Problem) -> tuple[int, ...]:
    """Contiguous counts minimising the largest stage time (forward + backward, with the
    embedding and the head): bisection on the limit, greedy fill per limit."""
    high = sum(_run_time(problem, k, 0, 0) for k in (0, problem.depth - 1))
    high = 2 * (high + problem.prefix["fwd"][-1] + problem.prefix["bwd"][-1])  # fits all
    low, best = 0.0, _greedy_fill(problem, high)
    for _ in range(50):
        mid = (low + high) / 2
        counts = _greedy_fill(problem, mid)
        if counts is None:
            low = mid
        else:
            high, best = mid, counts
    return best or uniform_layers(problem.num_layers, problem.depth)


def _greedy_fill(problem: _Problem, limit: float) -> tuple[int, ...] | None:
    """Each stage takes as many layers as fit under ``limit`` (leaving the later stages
    their minimums); None if some stage cannot stay under it."""
    lows, depth, layers = problem.lows, problem.depth, problem.num_layers
    counts, first = [], 0
    for k in range(depth):
        most = layers - first - sum(lows[k + 1 :])
        take = lows[k] if k < depth - 1 else most
        while take < most and _run_time(problem, k, first, take + 1) <= limit:
            take += 1
        if take < lows[k] or take > most or _run_time(problem, k, first, take) > limit:
            return None
        counts.append(take)
        first += take
    return tuple(counts)


def _run_time(problem: _Problem, stage: int, first: int, count: int) -> float:
    """Forward + backward time of ``stage`` holding layers ``first .. first+count-1``."""
    fwd, bwd, ends = problem.prefix["fwd"], problem.prefix["bwd"], problem.ends
    total = fwd[first + count] - fwd[first] + bwd[first + count] - bwd[first]
    if stage == 0:
        total += ends["fwd"][0] + ends["bwd"][0]
    if stage == problem.depth - 1:
        total += ends["fwd"][1] + ends["bwd"][1]
    return total


def _improve(
    pool: _Pool,
    problem: _Problem,
    spec: _Spec,
    start: tuple[int, ...] | None = None,
    max_steps: int | None = None,
) -> tuple[int, ...]:
    """Local search from ``start`` (default: the best simulated partition) for at most
    ``max_steps`` moves; returns where it stops, simulated. Each step simulates the moves
    the surrogate likes best and takes the first whose simulated score is better. When
    time does not matter the surrogate alone judges (it is exact on memory)."""
    counts = start or pool.best(spec).counts
    if spec.needs_time:  # small plans simulate fast: judge more of the screened moves
        judge = _State.simulated_score_for(spec, pool)
        tries = max(_TRIES, _STEP_WORK // problem.replayer.size)
    else:
        judge, tries = _State.score_for(spec), _TRIES
    descent = _Descent(spec, judge, lambda: pool.cuts, tries)
    counts = descent.run(_State(problem, pool.cuts, counts), max_steps).counts
    pool.add(counts)
    return counts


@dataclass(frozen=True)
class _Descent:
    """Local search judged by ``judge`` (state -> score, smaller is better), trying the
    ``tries`` best-screened moves per step; ``cuts()`` gives the critical paths the states
    it creates use (simulating adds some)."""

    spec: _Spec
    judge: Callable[[_State], tuple]
    cuts: Callable[[], Sequence[_Cut]]
    tries: int

    def run(self, state: _State, max_steps: int | None) -> _State:
        """Single-layer moves, then pairs, while the score improves (strictly, so it ends)."""
        current = self.judge(state)
        for _ in range(max_steps) if max_steps is not None else count():
            step = self._improving_move(state, current) or self._improving_pair(state, current)
            if step is None:
                break
            state, current = _State(state.problem, self.cuts(), step[0].counts), step[1]
        return state

    def _improving_move(self, state: _State, current: tuple) -> tuple[_State, tuple] | None:
        for _, donor, receiver in state.screened_moves(self.spec, current)[: self.tries]:
            moved = state.moved(donor, receiver, self.cuts())
            score = self.judge(moved)
            if _better(score, current):
                return moved, score
        return None

    def _improving_pair(self, state: _State, current: tuple) -> tuple[_State, tuple] | None:
        """Two moves that improve together although no single one does (a minimax
        objective often needs two ranks to change at once)."""
        for _, donor, receiver in state.screened_moves(self.spec, None)[:_ESCAPES]:
            step = self._improving_move(state.moved(donor, receiver, self.cuts()), current)
            if step is not None:
                return step
        return None


class _State:
    """One partition under the surrogate: exact stage costs and memory; time as the larger
    of per-rank lower bounds and the known critical paths."""

    def __init__(self, problem: _Problem, cuts: Sequence[_Cut], counts: Sequence[int]) -> None:
        self.problem, self.cuts = problem, list(cuts)
        self.counts = tuple(counts)
        self.starts = [0, *accumulate(self.counts)]
        costs = self.costs = problem.stage_costs(self.counts)
        fwd_before = [0.0, *accumulate(costs.fwd)]
        bwd_before = [0.0, *accumulate(costs.bwd)]
        self.lbs, self.dots, self.acts, self.params = [], [], [], []
        for rank, slots in enumerate(problem.slots):
            work = problem.message_busy[rank] + sum(
                n * (costs.fwd[k] + costs.bwd[k])
                for k, n in zip(slots, problem.slot_mbs[rank], strict=True)
            )
            first = problem.first[rank]
            self.lbs.append(fwd_before[first] + bwd_before[first] + work)
            sizes = [costs.act[k] for k in slots]
            self.dots.append([_dot(v, sizes) for v in problem.vectors[rank]])
            self.acts.append(max(self.dots[-1], default=0.0))
            self.params.append(sum(costs.param[k] for k in slots))
        self.mems = [a + p for a, p in zip(self.acts, self.params, strict=True)]
        self.cut_values = [cut.value(costs) for cut in self.cuts]
        self.time = max(max(self.lbs), max(self.cut_values, default=0.0))
        self.lb_order = sorted(range(len(self.lbs)), key=lambda r: -self.lbs[r])
        self.mem_order = sorted(range(len(self.mems)), key=lambda r: -self.mems[r])
        # screening evaluates the same (rank, slot, layer) changes over and over
        self._act_cache: dict[tuple, float] = {}
        self._cut_cache: dict[tuple, list[float]] = {}

    def score(self, spec: _Spec) -> tuple:
        return spec.score(self.time, self.lbs, self.mems)

    @staticmethod
    def score_for(spec: _Spec):
        """Judge states by the surrogate."""
        return lambda state: state.score(spec)

    @staticmethod
    def simulated_score_for(spec: _Spec, pool: _Pool):
        """Judge states by simulation (pooled): the simulated makespan replaces the
        surrogate's."""

        def judge(state: _State) -> tuple:
            point = pool.add(state.counts)
            return spec.score(point.makespan, state.lbs, point.rank_peaks)

        return judge

    def moved(self, donor: int, receiver: int, cuts: Sequence[_Cut]) -> _State:
        counts = list(self.counts)
        counts[donor] -= 1
        counts[receiver] += 1
        return _State(self.problem, cuts, counts)

    # -- screening: score every move of one layer off a hot rank ----------------------------
    def screened_moves(self, spec: _Spec, current: tuple | None) -> list[tuple[tuple, int, int]]:
        """Moves (score, donor stage, receiver stage) whose screened score beats
        ``current`` (all moves if None), best first. Screening counts only the moved
        layer's cost on the donor and the receiver (exact for identical layers; the stages
        in between shift by one layer each) and keeps each rank's fill and drain as they
        are (the critical paths see them); the caller simulates before accepting."""
        out = []
        base = self._base_sums(spec)
        donors = self._donors(spec)
        receivers = self._receivers(spec, donors)
        for donor in donors:
            for receiver in receivers:
                if receiver != donor:
                    score = self._move_score(spec, base, donor, receiver)
                    if current is None or _better(score, current):
                        out.append((score, donor, receiver))
        out.sort(key=lambda m: (*m[0], m[1], m[2]))
        return out

    def _rank_order(self, spec: _Spec) -> list[int]:
        """Ranks, worst first, by the binding part of the score."""
        by_memory = spec.hot_by_memory(self.score(spec)[0])
        return self.mem_order if by_memory else self.lb_order

    def _receivers(self, spec: _Spec, donors: list[int]) -> list[int]:
        """Stages that may take a layer: on the donors' ranks and on the best ranks, as
        many as keep the screened moves near :data:`_SCREEN_PAIRS`."""
        pr = self.problem
        per_rank = len(pr.slots[0])
        cold = max(_HOT_RANKS, _SCREEN_PAIRS // max(1, len(donors) * per_rank))
        if cold >= len(pr.slots):
            return list(range(pr.depth))
        ranks = {r for k in donors for r, _ in pr.holders[k]} | set(self._rank_order(spec)[-cold:])
        return sorted({k for r in ranks for k in pr.slots[r]})

    def _donors(self, spec: _Spec) -> list[int]:
        """Stages that may give a layer: those on the worst ranks for the binding part of
        the score, plus the heaviest stages of the critical path when one binds."""
        pr = self.problem
        hot = max(_HOT_RANKS, _SCREEN_PAIRS // (pr.depth * len(pr.slots[0])))
        stages = [k for r in self._rank_order(spec)[:hot] for k in pr.slots[r]]
        path_binds = self.cut_values and max(self.cut_values) >= self.lbs[self.lb_order[0]]
        if path_binds and not spec.hot_by_memory(self.score(spec)[0]):
            cut = self.cuts[self.cut_values.index(max(self.cut_values))]
            weight = [
                cut.fwd_coef[k] * self.costs.fwd[k] + cut.bwd_coef[k] * self.costs.bwd[k]
                for k in range(pr.depth)
            ]
            heavy = sorted(range(pr.depth), key=lambda k: -weight[k])
            stages += heavy[: 2 * len(pr.slots[0])]
        return sorted({k for k in stages if self.counts[k] > pr.lows[k]})

    def _moved_layers(self, donor: int, receiver: int) -> tuple[int, int]:
        """(layer the donor gives up, layer the receiver gains): the run between them shifts."""
        if receiver < donor:
            return self.starts[donor], self.starts[receiver + 1]
        return self.starts[donor + 1] - 1, self.starts[receiver] - 1

    def _base_sums(self, spec: _Spec) -> tuple[float, float]:
        """(memory excess over the limit, sum of squares of the tie-break) of this state."""
        if spec.kind == "time":
            excess = sum(max(0.0, m - spec.limit) for m in self.mems)
            return excess, sum(x * x for x in self.lbs)
        return 0.0, sum(x * x for x in self.mems)

    def _move_score(self, spec: _Spec, base: tuple, donor: int, receiver: int) -> tuple:
        pr = self.problem
        lost_index, gained_index = self._moved_layers(donor, receiver)
        lost, gained = pr.layer_costs[lost_index], pr.layer_costs[gained_index]
        lb_delta: dict[int, float] = {}
        param_delta: dict[int, float] = {}
        act_terms: dict[int, list[tuple[int, float]]] = {}
        for stage, sign, layer in ((donor, -1.0, lost), (receiver, 1.0, gained)):
            for rank, slot in pr.holders[stage]:
                mbs = pr.slot_mbs[rank][slot]
                lb_delta[rank] = lb_delta.get(rank, 0.0) + sign * mbs * (layer[0] + layer[1])
                param_delta[rank] = param_delta.get(rank, 0.0) + sign * layer[3]
                act_terms.setdefault(rank, []).append((slot, sign * layer[2]))
        new_lbs = {r: self.lbs[r] + d for r, d in lb_delta.items()}
        new_mems = {
            r: self.params[r] + param_delta[r] + self._act_after(r, terms)
            for r, terms in act_terms.items()
        }
        cut_max = self._cut_max(donor, receiver, lost, gained)
        time = max(_max_with(self.lbs, self.lb_order, new_lbs), cut_max)
        return self._aggregate(spec, base, time, new_lbs, new_mems)

    def _act_after(self, rank: int, terms: list[tuple[int, float]]) -> float:
        key = (rank, *terms)
        if key not in self._act_cache:
            vectors = self.problem.vectors[rank]
            self._act_cache[key] = max(
                (
                    dot + sum(v[slot] * delta for slot, delta in terms)
                    for v, dot in zip(vectors, self.dots[rank], strict=True)
                ),
                default=0.0,
            )
        return self._act_cache[key]

    def _cut_max(self, donor: int, receiver: int, lost: tuple, gained: tuple) -> float:
        if not self.cuts:
            return 0.0
        with_loss = self._cut_terms(donor, lost, -1.0, self.cut_values)
        return max(map(operator.add, with_loss, self._cut_terms(receiver, gained, 1.0, None)))

    def _cut_terms(self, stage: int, layer: tuple, sign: float, base) -> list[float]:
        """Per cut: ``sign`` times the layer's time on ``stage`` (plus ``base``)."""
        key = (stage, layer, sign, base is None)
        if key not in self._cut_cache:
            terms = [
                sign * (cut.fwd_coef[stage] * layer[0] + cut.bwd_coef[stage] * layer[1])
                for cut in self.cuts
            ]
            self._cut_cache[key] = terms if base is None else list(map(operator.add, base, terms))
        return self._cut_cache[key]

    def _aggregate(self, spec: _Spec, base: tuple, time: float, new_lbs, new_mems) -> tuple:
        """``spec.score`` of the moved state from the changed ranks only."""
        top_mem = _max_with(self.mems, self.mem_order, new_mems)
        excess, squares = base
        if spec.kind == "time":
            excess += sum(
                max(0.0, new - spec.limit) - max(0.0, self.mems[r] - spec.limit)
                for r, new in new_mems.items()
            )
            squares += sum(new * new - self.lbs[r] ** 2 for r, new in new_lbs.items())
            return (max(0.0, excess), time, squares, top_mem)
        squares += sum(new * new - self.mems[r] ** 2 for r, new in new_mems.items())
        return (max(0.0, time - spec.limit), top_mem, squares, time)


def _max_with(values: Sequence[float], order: Sequence[int], changed: dict[int, float]) -> float:
    """max over ranks of ``values`` with ``changed`` overriding; ``order`` sorts ranks by
    value, largest first."""
    best = max(changed.values(), default=-math.inf)
    for rank in order:
        if rank not in changed:
            return max(best, values[rank])
    return best
