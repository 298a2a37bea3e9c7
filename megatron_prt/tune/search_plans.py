"""The tuner: the fastest plan that fits a memory budget, from measured costs.

Search space, for ``P`` ranks and ``m`` micro-batches over the cost model's ``L`` layers:

* schedule family: ``1f1b``; megatron-core's ``interleaved`` (R >= 2, where megatron-core
  accepts ``m``); ``prt`` for every placement (loop, wave) x direction (uni, bi) x reuse
  ``R = 1 .. L // P`` (every stage keeps a layer, the rule of the training flags); and, when
  :data:`~megatron_prt.core.schedules.SCHEDULES` has split-backward generators
  (:data:`SPLIT_BACKWARD_SCHEDULES`), those over the same placements;
* layer partition: ``uniform`` (the runtime's even split) and ``balanced``
  (:func:`megatron_prt.tune.partition.partition`: the fastest split within the budget, or
  the fastest found when there is none);
* the plan for that partition: built for equal stages and free messages (what
  :func:`~megatron_prt.core.schedules.build_plan` gives without times) and, for generators
  that read times, built for the partition's real stage and message times; the faster one
  under the real costs of those within the budget is kept (of both when neither fits), the
  equal-stage plan on a tie.

Every candidate is scored by :func:`megatron_prt.sim.simulate.simulate` under the full cost
model (messages and, for ``bi``, the replica-gradient sum included). Memory is the simulator's
per-rank peak activation bytes plus the rank's parameter bytes; a candidate fits when its
largest per-rank peak is at most the budget.

Ranking (deterministic, documented tie-break): :attr:`Candidate.key` = (predicted iteration
time, largest per-rank peak, p2p messages, enumeration order). The enumeration order is
schedule family (1f1b, interleaved, prt, then split backward), R ascending, loop before wave,
uni before bi, uniform before balanced. Same inputs give the same winner.
"""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace

from ..core.layers import even_layers
from ..core.placement import ConfigError, Placement
from ..core.plan import Plan
from ..core.schedules import SCHEDULES, build_plan
from ..core.timing import StageTimes
from ..core.validate import validate
from ..core.zerobubble import zero_bubble
from ..sim.cost import CostModel
from ..sim.simulate import SimResult, simulate
from .memory import format_bytes
from .partition import partition

# split-backward generators, used when the planner has them (absent names are skipped)
SPLIT_BACKWARD_SCHEDULES = tuple(name for name in ("zb", "zb-h2") if name in SCHEDULES)
# generators whose order depends on the stage times they are given
TIME_AWARE_SCHEDULES = ("prt", "gpipe", *SPLIT_BACKWARD_SCHEDULES)

# the partitioner's slack that makes its no-budget answer the least memory at any speed
LEAST_MEMORY_SLACK = 1e9

Progress = Callable[[int, int, str], None]


@dataclass(frozen=True)
class Family:
    """One schedule on one placement: what the partition and the plan are chosen for."""

    order: int  # enumeration order (the last tie-break)
    schedule: str
    placement: Placement

    @property
    def label(self) -> str:
        c = self.placement
        if self.schedule == "1f1b":
            return "1F1B"
        if self.schedule == "interleaved":
            return f"interleaved R={c.reuse}"
        name = "PRT" if self.schedule == "prt" else self.schedule
        return f"{name} {c.placement}/{c.direction} R={c.reuse}"


@dataclass(frozen=True)
class Candidate:
    """A scored plan: ``stage_layers`` its partition (``partition`` says which kind),
    ``planned_for`` ``"equal stages"`` or ``"costs"``, ``result`` its simulation."""

    family: Family
    partition: str
    planned_for: str
    stage_layers: tuple[int, ...]
    plan: Plan
    result: SimResult

    @property
    def label(self) -> str:
        return self.family.label

    @property
    def makespan(self) -> float:
        return self.result.makespan

    @property
    def rank_peaks(self) -> tuple[float, ...]:
        return tuple(r.peak_activation_bytes + r.param_bytes for r in self.result.per_rank)

    @property
    def peak_bytes(self) -> float:
        return max(self.rank_peaks)

    @property
    def key(self) -> tuple:
        """The ranking key (module docstring)."""
        part = 0 if self.partition == "uniform" else 1
        return (self.makespan, self.peak_bytes, self.result.p2p_messages, self.family.order, part)

    def fits(self, budget_bytes: float | None) -> bool:
        return budget_bytes is None or self.peak_bytes <= budget_bytes

    def to_dict(self) -> dict:
        return {
            "label": self.label,
            "schedule": self.family.schedule,
            **self.family.placement.to_dict(),
            "partition": self.partition,
            "planned_for": self.planned_for,
            "stage_layers": list(self.stage_layers),
            "makespan": self.makespan,
            "bubble_fraction": self.result.bubble_fraction,
            "peak_bytes": self.peak_bytes,
            "rank_peak_bytes": list(self.rank_peaks),
            "p2p_messages": self.result.p2p_messages,
            "p2p_bytes": self.result.p2p_bytes,
            "replica_sync_time": self.result.replica_sync_time,
        }


@dataclass(frozen=True)
class TuneResult:
    """``ranked``: every candidate, best first by :attr:`Candidate.key`; ``winner``: the
    first that fits ``budget_bytes``; ``skipped``: (family label, reason) not built."""

    ranked: tuple[Candidate, ...]
    winner: Candidate
    budget_bytes: float | None
    skipped: tuple[tuple[str, str], ...]
    seconds: float

    def fitting(self) -> list[Candidate]:
        return [c for c in self.ranked if c.fits(self.budget_bytes)]


def max_reuse(num_layers: int, ranks: int) -> int:
    """Largest R giving every one of the R*P stages a layer."""
    return max(1, num_layers // ranks)


def families(
    ranks: int, num_layers: int, reuse_limit: int | None = None, split_backward: bool = True
) -> list[Family]:
    """The schedule families searched, in enumeration order (module docstring); R at most
    ``reuse_limit`` when given; the split-backward ones only with ``split_backward``."""
    top = max_reuse(num_layers, ranks)
    top = top if reuse_limit is None else min(top, reuse_limit)
    rows = [("1f1b", Placement(ranks, 1))]
    rows += [("interleaved", Placement(ranks, r)) for r in range(2, top + 1)]
    split = SPLIT_BACKWARD_SCHEDULES if split_backward else ()
    for schedule in ("prt", *split):
        for r in range(1, top + 1):
            for where in ("loop", "wave"):
                if where == "wave" and r == 1:
                    continue  # one pass: wave is loop
                for direction in ("uni", "bi"):
                    rows.append((schedule, Placement(ranks, r, where, direction)))
    return [Family(i, schedule, placement) for i, (schedule, placement) in enumerate(rows)]


def tune(
    cost: CostModel,
    ranks: int,
    num_microbatches: int,
    *,
    budget_bytes: float | None = None,
    reuse_limit: int | None = None,
    split_backward: bool = True,
    jobs: int = 1,
    progress: Progress | None = None,
) -> TuneResult:
    """Score every candidate (module docstring) and pick the fastest that fits.

    ``cost`` needs per-layer costs (its ``stage_layers`` are ignored); ``reuse_limit``
    caps R below what the layers allow (a shorter search); ``split_backward`` False leaves
    the split-backward generators out; ``jobs`` > 1 scores the
    families in that many forked processes (same result: the ranking is by key). Raises
    :class:`ConfigError` when nothing fits ``budget_bytes``, naming the smallest peak found."""
    if not cost.layers:
        raise ConfigError(
            'tuning needs per-layer costs: give a "layers" list in the cost model '
            "(`megatron-prt profile` writes one)"
        )
    if budget_bytes is not None and not budget_bytes > 0:
        raise ConfigError(f"--memory-budget must be > 0 bytes, got {budget_bytes!r}")
    start = time.perf_counter()
    found, skipped = [], []
    todo = families(ranks, len(cost.layers), reuse_limit, split_backward)
    for done, (family, scored) in enumerate(
        _scored(cost, todo, num_microbatches, budget_bytes, jobs)
    ):
        if progress is not None:
            progress(done + 1, len(todo), family.label)
        if isinstance(scored, str):
            skipped.append((family.label, scored))
        else:
            found += scored
    ranked = tuple(sorted(found, key=lambda c: c.key))
    fits = [c for c in ranked if c.fits(budget_bytes)]
    if not fits:
        raise _nothing_fits(ranked, budget_bytes, skipped)
    seconds = time.perf_counter() - start
    return TuneResult(ranked, fits[0], budget_bytes, tuple(skipped), seconds)


def _scored(cost, todo, num_microbatches, budget_bytes, jobs) -> Iterator[tuple[Family, object]]:
    """(family, its candidates or why it was skipped), in enumeration order."""
    args = [(cost, family, num_microbatches, budget_bytes) for family in todo]
    if jobs <= 1:
        yield from zip(todo, (_score_or_skip(*a) for a in args), strict=True)
        return
    context = multiprocessing.get_context("fork")
    with ProcessPoolExecutor(jobs, mp_context=context) as pool:
        futures = [pool.submit(_score_or_skip, *a) for a in args]
        for family, future in zip(todo, futures, strict=True):
            yield family, future.result()


def _score_or_skip(cost, family, num_microbatches, budget_bytes) -> list[Candidate] | str:
    try:
        return _score_family(cost, family, num_microbatches, budget_bytes)
    except ConfigError as exc:
        return str(exc).split(";")[0]


def _nothing_fits(ranked, budget_bytes, skipped) -> ConfigError:
    if not ranked:
        why = "; ".join(f"{label}: {reason}" for label, reason in skipped[:3])
        return ConfigError(f"no schedule could be built for these settings ({why})")
    least = min(ranked, key=lambda c: (c.peak_bytes, c.key))
    rank = least.rank_peaks.index(least.peak_bytes)
    return ConfigError(
        f"no plan fits the memory budget of {format_bytes(budget_bytes)} per rank: the "
        f"smallest peak found is {format_bytes(least.peak_bytes)} ({least.label}, "
        f"{least.partition} partition, rank {rank}); raise --memory-budget, add ranks "
        "(--pp) or lower activation memory (smaller micro-batches, recomputation)"
    )


def _score_family(
    cost: CostModel, family: Family, num_microbatches: int, budget_bytes: float | None
) -> list[Candidate]:
    placement, schedule = family.placement, family.schedule
    equal_plan = plan_for(cost, placement, num_microbatches, schedule, None)
    validate(equal_plan)
    out = []
    for kind, counts in _partitions(cost, family, num_microbatches, budget_bytes):
        priced = replace(cost, stage_layers=counts)
        variants = [
            Candidate(
                family, kind, "equal stages", counts, equal_plan, simulate(equal_plan, priced)
            )
        ]
        if schedule in TIME_AWARE_SCHEDULES:
            plan = plan_for(
                priced, placement, num_microbatches, schedule, priced.stage_times(placement)
            )
            if plan != equal_plan:
                validate(plan)
                variants.append(
                    Candidate(family, kind, "costs", counts, plan, simulate(plan, priced))
                )
        # the faster plan of those that fit (of all when none does); a tie keeps equal stages
        fitting = [c for c in variants if c.fits(budget_bytes)] or variants
        out.append(min(fitting, key=lambda c: c.makespan))
    return out


def plan_for(
    cost: CostModel, placement: Placement, num_microbatches: int, schedule: str, times
) -> Plan:
    """:func:`build_plan`; split-backward plans sized as ``megatron-prt plan --schedule zb``
    sizes them (:func:`megatron_prt.cli.main.build`): the cost's stage activation bytes and
    W's share of them under the schedule's cap, equal stages with the cost's W share when
    ``times`` is None."""
    if schedule not in SPLIT_BACKWARD_SCHEDULES:
        return build_plan(placement, num_microbatches, schedule, times)
    if times is None:
        times = StageTimes.uniform(placement.depth)
        if cost.wgrad_fraction is not None:
            times = times.with_wgrad_fraction(cost.wgrad_fraction)
    return zero_bubble(
        placement,
        num_microbatches,
        times,
        mem_cap="zb-h2" if schedule == "zb-h2" else "1f1b",
        act=cost.stage_activation_bytes(placement),
        keep=cost.wgrad_keep_fraction,
    )


def _partitions(
    cost: CostModel, family: Family, num_microbatches: int, budget_bytes: float | None
) -> Iterator[tuple[str, tuple[int, ...]]]:
    """``uniform``, then ``balanced`` when the partitioner finds a different split: the
    fastest within the budget or, when none is, the least memory it finds (so a refusal
    names the smallest peak there is)."""
    uniform = even_layers(len(cost.layers), family.placement.depth)
    if cost.runs_whole_blocks(uniform):  # else megatron's uniform recompute cannot run it
        yield "uniform", uniform
    args = (cost, family.placement, num_microbatches)
    try:
        # without a budget: the fastest split the partitioner finds (an infinite budget)
        budget = budget_bytes or float("inf")
        result = partition(*args, budget_bytes=budget, schedule=family.schedule)
    except ConfigError:  # no split within the budget
        result = partition(*args, slack=LEAST_MEMORY_SLACK, schedule=family.schedule)
    if result.stage_layers != uniform:
        yield "balanced", result.stage_layers
