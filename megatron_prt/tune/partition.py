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
runs on the same plan (unless ``--plan-from-costs``). The sums after the step (the bi
replica-gradient sum and the tied embedding sum, priced by the ``replica_*`` costs) are left
out, of the search and of the makespans reported: they come after the step and depend on
the partition only through the gradient bytes per rank (the tied sum not at all).

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

Recomputation. A cost model with megatron's ``recompute_granularity`` is partitioned by
what recomputed layers keep and cost (:mod:`megatron_prt.sim.cost`): ``selective`` and
``full``/``uniform`` are folded into plain per-layer costs first
(:meth:`~megatron_prt.sim.cost.CostModel.folded_recompute`; uniform blocks of
``recompute_num_layers`` layers move between stages whole, so the uniform split is in
blocks too); ``full``/``block`` recomputes the first layers of each stage, so its stage
costs come from the cost model for each candidate and the search's per-layer surrogate
uses the layers' plain costs (it only ranks moves; every answer is simulated).

Guarantees. Exhaustive: optimal (ties within float noise). Heuristic: the answer is a
simulated partition; the uniform one is simulated too, so the answer never loses to it on
the objective (with a budget the uniform fits, the answer is at least as fast; without,
if the uniform is within the slack, the answer peaks no higher); no screened single move
improves it; there is no global-optimality guarantee. Forced onto the small cases of
``tests/tune/test_partition.py`` it comes within 1% of brute force.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from ..core.layers import even_layers
from ..core.placement import ConfigError, Placement
from ..core.plan import Plan
from ..core.schedules import build_plan
from ..sim.cost import CostModel
from ..sim.simulate import RankStats, simulate
from .evaluate import Pool, choose
from .memory import format_bytes
from .problem import Problem, count_partitions, min_stage_layers, partitions
from .search import search

__all__ = [
    "DEFAULT_SLACK",
    "EXHAUSTIVE_LIMIT",
    "PartitionResult",
    "PartitionStats",
    "format_bytes",
    "min_stage_layers",
    "partition",
    "uniform_layers",
]

DEFAULT_SLACK = 0.03  # fraction of the fastest makespan given up for memory
EXHAUSTIVE_LIMIT = 2000  # simulate every partition when there are at most this many ...
_EXHAUSTIVE_WORK = 4_000_000  # ... and simulating them all replays at most this many actions

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
    if plan.split_backward:  # [Note: the split form's own costs] in sim/layer_cost.py
        cost = cost.split_form()
    folded, unit = cost.folded_recompute()  # see "Recomputation" above
    problem = Problem(folded, plan)
    pool = Pool(problem)
    uniform = uniform_layers(problem.num_layers, problem.depth)
    admissible = count_partitions(problem.num_layers, problem.lows)
    exact = (
        admissible <= EXHAUSTIVE_LIMIT
        and admissible * len(problem.replayer.actions) <= _EXHAUSTIVE_WORK
    )
    if exact:
        for counts in partitions(problem.num_layers, problem.lows):
            pool.add(counts)
    else:
        search(pool, problem, uniform, budget_bytes, slack)
    best = choose(pool, budget_bytes, slack)
    return PartitionResult(
        balanced=_stats(plan, cost, [n * unit for n in best.counts]),
        uniform=_stats(plan, cost, [n * unit for n in uniform]),
        objective="memory" if budget_bytes is None else "time",
        budget_bytes=budget_bytes,
        slack=slack,
        fastest_makespan=pool.fastest().makespan,
        exact=exact,
        simulated=len(pool.points),
    )


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
