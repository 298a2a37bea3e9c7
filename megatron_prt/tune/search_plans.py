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
  under the real costs of those within the budget is kept (of all when none fits), the
  equal-stage plan on a tie; split-backward plans for the costs are built twice, their
  memory cap in the stages' activation bytes and counted in micro-batches.

Every candidate is scored by :func:`megatron_prt.sim.simulate.simulate` under the full cost
model (messages, each cut's own where the layers give their ``out_bytes``, and, for
``bi``, the replica-gradient sum included); a ``price`` function gives the cost model of a
placement and partition where it depends on them. ``seeds`` (:class:`Seed`: any plan with its
partition, e.g. the plan a job runs today or a peer library's order) are scored beside the
search and win when they are faster, so the winner is never slower than a plan it was shown.
Memory is the simulator's per-rank peak activation bytes plus the rank's parameter bytes; a
candidate fits when its largest per-rank peak is at most the budget.

Ranking (deterministic, documented tie-break): :attr:`Candidate.key` = (predicted iteration
time, largest per-rank peak, p2p messages, enumeration order), times within
:data:`TIME_TIE` of each other counted equal (:func:`ranked`: each plan is replayed in ticks
of its own stage times, which moves its makespan by some 1e-5 relative, and that noise had
decided between plans of equal time before memory could). The enumeration order is
schedule family (1f1b, interleaved, prt, then split backward), R ascending, loop before wave,
uni before bi, uniform before balanced, seeds last in the order given. Same inputs give the
same winner.
"""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Callable, Iterator, Sequence
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
# the cost model of a placement and partition (stage_layers set); default: the given one
Pricing = Callable[[Placement, tuple[int, ...]], CostModel]


@dataclass(frozen=True)
class Family:
    """One schedule on one placement: what the partition and the plan are chosen for."""

    order: int  # enumeration order (the last tie-break)
    schedule: str
    placement: Placement
    name: str = ""  # a seed's own label

    @property
    def label(self) -> str:
        if self.name:
            return self.name
        c = self.placement
        if self.schedule == "1f1b":
            return "1F1B"
        if self.schedule == "interleaved":
            return f"interleaved R={c.reuse}"
        name = "PRT" if self.schedule == "prt" else self.schedule
        return f"{name} {c.placement}/{c.direction} R={c.reuse}"


@dataclass(frozen=True)
class Seed:
    """A plan scored beside the search: ``label`` names it in the ranking, ``stage_layers``
    is its partition (one count per model stage of ``plan``)."""

    label: str
    plan: Plan
    stage_layers: tuple[int, ...]


@dataclass(frozen=True)
class Candidate:
    """A scored plan: ``stage_layers`` its partition (``partition`` says which kind),
    ``planned_for`` ``"equal stages"``, ``"costs"`` or ``"seed"``, ``result`` its simulation."""

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
            "tied_sync_time": self.result.tied_sync_time,
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
    price: Pricing | None = None,
    seeds: Sequence[Seed] = (),
) -> TuneResult:
    """Score every candidate (module docstring) and pick the fastest that fits.

    ``cost`` needs per-layer costs (its ``stage_layers`` are ignored); ``price``, when
    given, prices each placement and partition instead (its per-layer costs must be
    ``cost``'s); ``seeds`` are scored beside the search (:func:`add_seeds`); ``reuse_limit``
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
    # full/uniform recomputation splits whole blocks: R*P beyond them left stages empty
    blocks = len(cost.folded_recompute()[0].layers)  # (and refuses a block that does not fit)
    todo = families(ranks, blocks, reuse_limit, split_backward)
    pricing = price or _Repricing(cost)
    found += seed_candidates(pricing, seeds, first_order=len(todo))
    for done, (family, scored) in enumerate(
        _scored(pricing, todo, num_microbatches, budget_bytes, jobs, len(cost.layers))
    ):
        if progress is not None:
            progress(done + 1, len(todo), family.label)
        if isinstance(scored, str):
            skipped.append((family.label, scored))
        else:
            found += scored
    ranked = rank(found)
    fits = [c for c in ranked if c.fits(budget_bytes)]
    if not fits:
        raise _nothing_fits(ranked, budget_bytes, skipped)
    seconds = time.perf_counter() - start
    return TuneResult(ranked, fits[0], budget_bytes, tuple(skipped), seconds)


class _Repricing:
    """The default :data:`Pricing`: ``cost`` with the partition's ``stage_layers``."""

    def __init__(self, cost: CostModel) -> None:
        self.cost = cost

    def __call__(self, placement: Placement, stage_layers: tuple[int, ...]) -> CostModel:
        return replace(self.cost, stage_layers=tuple(stage_layers))


def seed_candidates(price: Pricing, seeds: Sequence[Seed], first_order: int) -> list[Candidate]:
    """Each seed scored under ``price`` (its enumeration order after the searched
    families'). Raises :class:`ConfigError` naming a seed whose plan does not validate or
    whose partition does not give one count per model stage."""
    out = []
    for i, seed in enumerate(seeds):
        placement = seed.plan.placement
        if len(seed.stage_layers) != placement.depth:
            raise ConfigError(
                f"seed {seed.label!r}: {len(seed.stage_layers)} stage layer counts for "
                f"{placement.depth} model stages; give one count per model stage"
            )
        validate(seed.plan)
        family = Family(first_order + i, "seed", placement, seed.label)
        result = simulate(seed.plan, price(placement, tuple(seed.stage_layers)))
        out.append(Candidate(family, "given", "seed", tuple(seed.stage_layers), seed.plan, result))
    return out


def add_seeds(result: TuneResult, price: Pricing, seeds: Sequence[Seed]) -> TuneResult:
    """``result`` with ``seeds`` scored under ``price`` and ranked among its candidates
    (the same as passing them to :func:`tune`, without searching again)."""
    first = 1 + max((c.family.order for c in result.ranked), default=-1)
    ranked = rank((*result.ranked, *seed_candidates(price, seeds, first)))
    fits = [c for c in ranked if c.fits(result.budget_bytes)]
    return replace(result, ranked=ranked, winner=fits[0] if fits else result.winner)


TIME_TIE = 1e-4  # relative: predicted times this close rank as equal


def rank(candidates: Sequence[Candidate]) -> tuple[Candidate, ...]:
    """``candidates`` best first by :attr:`Candidate.key`, with predicted times within
    :data:`TIME_TIE` (relative) of the fastest of a run of them ranked as one time."""
    by_time = sorted(candidates, key=_key)
    out: list[Candidate] = []
    start = 0
    while start < len(by_time):
        limit, end = by_time[start].makespan * (1 + TIME_TIE), start + 1
        while end < len(by_time) and by_time[end].makespan <= limit:
            end += 1
        out += sorted(by_time[start:end], key=lambda c: c.key[1:])
        start = end
    return tuple(out)


def _key(candidate: Candidate) -> tuple:
    return candidate.key


def _scored(
    price, todo, num_microbatches, budget_bytes, jobs, num_layers
) -> Iterator[tuple[Family, object]]:
    """(family, its candidates or why it was skipped), in enumeration order."""
    args = [(price, family, num_microbatches, budget_bytes, num_layers) for family in todo]
    if jobs <= 1:
        yield from zip(todo, (_score_or_skip(*a) for a in args), strict=True)
        return
    context = multiprocessing.get_context("fork")
    with ProcessPoolExecutor(jobs, mp_context=context) as pool:
        futures = [pool.submit(_score_or_skip, *a) for a in args]
        for family, future in zip(todo, futures, strict=True):
            yield family, future.result()


def _score_or_skip(price, family, m, budget_bytes, num_layers) -> list[Candidate] | str:
    try:
        return _score_family(price, family, m, budget_bytes, num_layers)
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
    price: Pricing,
    family: Family,
    num_microbatches: int,
    budget_bytes: float | None,
    num_layers: int,
) -> list[Candidate]:
    placement, schedule = family.placement, family.schedule
    if schedule in SPLIT_BACKWARD_SCHEDULES:  # planned and priced in the split form's costs
        price = _split_form(price)
    cost = price(placement, even_layers(num_layers, placement.depth))
    equal_plan = plan_for(cost, placement, num_microbatches, schedule, None)
    validate(equal_plan)
    out = []
    for kind, counts in _partitions(cost, family, num_microbatches, budget_bytes):
        priced = price(placement, counts)
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
        if schedule in SPLIT_BACKWARD_SCHEDULES:
            variants += _count_capped(priced, family, kind, counts, num_microbatches)
        out.append(fastest_variant(variants, budget_bytes))
    return out


def fastest_variant(variants: Sequence[Candidate], budget_bytes: float | None) -> Candidate:
    """The variant :func:`rank` puts first among those that fit (among all when none
    does): times within :data:`TIME_TIE` tie, then less memory wins, then fewer messages,
    then the faster."""
    fitting = [c for c in variants if c.fits(budget_bytes)] or variants
    return rank(fitting)[0]


def _split_form(price: Pricing) -> Pricing:
    """``price`` in the split form's costs ([Note: the split form's own costs] in
    :mod:`megatron_prt.sim.layer_cost`)."""
    return lambda placement, stage_layers: price(placement, stage_layers).split_form()


def _count_capped(priced, family, kind, counts, num_microbatches) -> list[Candidate]:
    """The split-backward plan for the costs under a cap counted in micro-batches (equal
    activation bytes per stage, the planner's default) rather than in bytes: with unequal
    stages (a ResNet's large early activations) it may hold more than 1F1B's bytes and
    still fit the budget, and be faster; the budget decides."""
    placement = family.placement
    times = priced.stage_times(placement)
    plan = plan_for(priced, placement, num_microbatches, family.schedule, times, count_cap=True)
    validate(plan)
    return [Candidate(family, kind, "costs, count cap", counts, plan, simulate(plan, priced))]


def plan_for(
    cost: CostModel,
    placement: Placement,
    num_microbatches: int,
    schedule: str,
    times,
    count_cap: bool = False,
) -> Plan:
    """:func:`build_plan`; split-backward plans sized as ``megatron-prt plan --schedule zb
    --plan-from-costs`` sizes them (:func:`megatron_prt.cli.main.build`; without that flag
    the CLI builds the runtime's plan, equal bytes per stage): the cost's stage activation bytes and
    W's share of them per stage (``stage_wgrad_keep``) under the schedule's cap
    (``count_cap``: equal bytes per stage, the cap counted in micro-batches), equal stages
    with the cost's W share when ``times`` is None."""
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
        act=None if count_cap else cost.stage_activation_bytes(placement),
        keep=cost.wgrad_keep_fraction if count_cap else cost.stage_wgrad_keep(placement),
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


def tune_layout(
    cost: CostModel,
    placement: Placement,
    num_microbatches: int,
    *,
    split_backward: bool = False,
    budget_bytes: float | None = None,
    seeds: Sequence[Seed] = (),
) -> TuneResult:
    """The fastest plan for a layout that cannot change: ``placement`` and ``cost``'s
    ``stage_layers`` stay (the model chunks of a running job are built for them); the
    schedule (1F1B or megatron interleaved where the placement is theirs, PRT) and the
    plan (for equal stages or for ``cost``'s times) are chosen. ``split_backward`` True
    searches the split-backward schedules only (the chunks run I and W), False the others;
    ``seeds`` (e.g. the plan a job runs) are scored under ``cost`` beside them, so they
    stand even where no schedule builds. Ranked as :func:`tune`; raises
    :class:`ConfigError` when nothing fits the budget."""
    start = time.perf_counter()
    counts = cost.layer_counts(placement.depth)
    names = SPLIT_BACKWARD_SCHEDULES if split_backward else _whole_backward(placement)
    cost = cost.split_form() if split_backward else cost  # [Note: the split form's own costs]
    found, skipped = [], []
    for order, schedule in enumerate(names):
        family = Family(order, schedule, placement)
        try:
            plans = [("equal stages", plan_for(cost, placement, num_microbatches, schedule, None))]
            if schedule in TIME_AWARE_SCHEDULES:
                times = cost.stage_times(placement)
                plans.append(
                    ("costs", plan_for(cost, placement, num_microbatches, schedule, times))
                )
        except ConfigError as exc:
            skipped.append((family.label, str(exc).split(";")[0]))
            continue
        for planned_for, plan in plans:
            validate(plan)
            result = simulate(plan, cost)
            found.append(Candidate(family, "given", planned_for, counts, plan, result))
    found += seed_candidates(lambda placement, layers: cost, seeds, len(names))
    ranked = rank(found)
    fits = [c for c in ranked if c.fits(budget_bytes)]
    if not fits:
        raise _nothing_fits(ranked, budget_bytes, skipped)
    return TuneResult(ranked, fits[0], budget_bytes, tuple(skipped), time.perf_counter() - start)


def _whole_backward(placement: Placement) -> tuple[str, ...]:
    """The non-split schedules that run on ``placement``'s chunks."""
    if (placement.placement, placement.direction) != ("loop", "uni"):
        return ("prt",)
    return ("1f1b", "prt") if placement.reuse == 1 else ("interleaved", "prt")
