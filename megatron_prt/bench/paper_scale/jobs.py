"""What paper_scale simulates: the variants, one job per model, link, m and variant, its
outcome, and the results the report looks up (:class:`Results`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from functools import cache
from itertools import pairwise

from ...core import Placement, build_plan
from ...core.placement import ConfigError
from ...core.plan import Plan
from ...sim.analytic import GIB, H200_LINKS, H200_MEMORY, LINKS, cost_model, models
from ...sim.cost import CostModel
from ...sim.simulate import simulate
from ...tune.partition import (
    partition,
)
from .profiles import PROFILES, profiled_cost
from .split import split_plans

RANKS = 8  # the paper used 8 GPUs; we put all of them in one pipeline
DEFAULT_OUT = "out/bench/paper_scale.md"
MICROBATCHES = (8, 16, 32)
CURVE_MICROBATCHES = (2, 4, 6, 8, 12, 16, 32)  # where "our gain = the paper's" is sought
REUSES = (2, 4)
PLACEMENTS = ("loop", "wave")

# Throughput gains of PRT reported in the paper's abstract: uni over 1F1B, bi over Chimera.
PAPER_GAINS = {
    ("BERT", "uni"): 0.5478,
    ("BERT", "bi"): 0.3038,
    ("ResNet", "uni"): 0.7659,
    ("ResNet", "bi"): 0.2645,
}

MAIN_LINK = "nvlink"
SENSITIVITY_LINKS = ("free", "nvswitch", "nvlink", "pcie")
V100_LINKS = ("nvlink", "nvswitch", "pcie", "free")
H200_MAIN_LINK = "nvlink4"
# -- variants and one simulation -----------------------------------------------------------------
IDEAL = "uniform stages"  # pseudo-model: D equal stages, forward 1, backward 2 (whole model)
IDEAL_LINK = "free"


@dataclass(frozen=True)
class Variant:
    """A schedule to time. ``role``: ``baseline`` (1F1B, Chimera-style bi), ``prt`` (R > 1)
    or ``reference`` (the PRT generator at R = 1, uni: a 1F1B order that knows the costs)."""

    label: str
    placement: Placement
    schedule: str
    role: str

    @property
    def direction(self) -> str:
        return self.placement.direction


def baselines() -> list[Variant]:
    return [
        Variant("1F1B", Placement(RANKS, 1), "1f1b", "baseline"),
        Variant("Chimera-style bi R=1", Placement(RANKS, 1, "loop", "bi"), "prt", "baseline"),
    ]


REFERENCE = Variant("R=1 loop/uni", Placement(RANKS, 1), "prt", "reference")


def prt_variants(reuses: Sequence[int]) -> list[Variant]:
    return [
        Variant(f"R={r} {pl}/{d}", Placement(RANKS, r, pl, d), "prt", "prt")
        for d in ("uni", "bi")
        for r in reuses
        for pl in PLACEMENTS
    ]


@dataclass(frozen=True)
class Job:
    """One simulation: a model name (:func:`models`, :data:`PROFILES` or :data:`IDEAL`), a
    :data:`LINKS` key, m, a variant; ``replica_sum``: bi pays the replica-gradient sum
    (profiled models only); ``partition``: ``even`` (the runtime's default split of the
    layers) or ``balanced`` (the partitioner's fastest split, profiled models only: see
    :func:`balanced_cost`)."""

    model: str
    link: str
    microbatches: int
    variant: Variant
    replica_sum: bool = False
    partition: str = "even"
    stage_layers: tuple[int, ...] = ()  # given split (split-backward rows on a balanced one)


@dataclass(frozen=True)
class Outcome:
    """One simulated iteration: ``ms`` makespan, ``bubble`` idle fraction of P x makespan,
    ``peak_gib`` the largest per-rank peak (activations + training state), ``balance``
    largest over smallest per-rank peak, ``hop_ms`` the time of one p2p hop, ``empty``
    model stages holding no layer, ``plan`` which plan was kept (see
    :func:`candidate_plans`), ``cost_aware_ms`` the makespan of the plan built for the real
    costs (equal to ``ms`` unless the runtime's default plan was faster), ``replica_ms``
    what the bi replica-gradient sum adds to ``ms``, ``stage_layers`` the layers of model
    stages 0..D-1 (empty for the whole-model :data:`IDEAL`), ``search`` how the
    partitioner found a balanced split (empty for the even one)."""

    job: Job
    ms: float
    bubble: float
    peak_gib: float
    balance: float
    hop_ms: float
    empty: int
    plan: str
    cost_aware_ms: float
    replica_ms: float = 0.0
    stage_layers: tuple[int, ...] = ()
    search: str = ""
    busiest: float = 0.0  # the busiest rank's compute over the makespan (1.0: no bubble)


@cache
def runtime_plan(placement: Placement, microbatches: int) -> Plan:
    """The plan the runtime executes: built for uniform stage times, whatever the costs."""
    return build_plan(placement, microbatches, "prt")


def job_cost(job: Job) -> CostModel:
    """The job's costs; split-backward jobs (:data:`SPLIT_ROLES`) also give W's share of
    every backward, :data:`WGRAD_FRACTION`, and a job's own ``stage_layers`` replace the
    even split."""
    cost = _model_cost(job)
    if job.variant.role in SPLIT_ROLES:
        cost = replace(cost, wgrad_fraction=WGRAD_FRACTION)
    if job.stage_layers:
        cost = replace(cost, stage_layers=job.stage_layers)
    return cost


def _model_cost(job: Job) -> CostModel:
    if job.model == IDEAL:
        return CostModel()
    if job.model in PROFILES:
        link = LINKS[job.link]
        return profiled_cost(job.model, job.variant.placement, link, job.replica_sum)
    return cost_model(models()[job.model], job.variant.placement, LINKS[job.link])


# W's share of backward in the split-backward rows. The FLOP model prices a backward as twice
# its forward: one GEMM of the forward's FLOPs for the input gradient, one for the weight
# gradient, so W is half (attention's score products have no weights, which this ignores);
# the H200 profiles time backward whole, and take the same half.
WGRAD_FRACTION = 0.5
SPLIT_ROLES = ("zb", "peer")


def rank_loads(cost: CostModel, placement: Placement) -> list[float]:
    """Per rank: forward + backward time of its stages for one micro-batch each."""
    times = cost.stage_times(placement)
    return [
        sum(times.fwd[placement.model_stage(k)] + times.bwd[placement.model_stage(k)] for k in ks)
        for ks in placement.rank_stages
    ]


def candidate_plans(job: Job, cost: CostModel) -> list[tuple[str, Plan]]:
    """(name, plan) pairs worth timing. The PRT generator is greedy list scheduling: given
    the real stage and hop times it usually does best, but not always (with a hop time its
    greedy choices can cascade into a worse order), so its plan for uniform stages, the one
    the runtime executes by default, is timed too and the faster one kept."""
    placement, m = job.variant.placement, job.microbatches
    if job.variant.role in SPLIT_ROLES:
        return split_plans(placement, m, job.variant.schedule, cost)
    if job.variant.schedule != "prt":
        return [("textbook", build_plan(placement, m, job.variant.schedule))]
    plans = [("cost-aware", build_plan(placement, m, "prt", cost.stage_times(placement)))]
    if job.model != IDEAL:
        plans.append(("runtime default", runtime_plan(placement, m)))
    return plans


def balanced_cost(job: Job, cost: CostModel) -> tuple[CostModel, str]:
    """``cost`` with the stage layers of the fastest partition the partitioner finds for the
    job's placement, m and schedule within an H200's memory (its time objective; every
    split here peaks far below it, so: the fastest found), and how it searched. The
    partitioner times partitions on the runtime's plan without the bi replica sum; the
    job's rows then time the split like every other (:func:`candidate_plans`)."""
    found = partition(
        cost.without_replica_sync(),
        job.variant.placement,
        job.microbatches,
        budget_bytes=H200_MEMORY,
        schedule=job.variant.schedule,
    )
    search = "exact" if found.exact else f"local search, {found.simulated} simulated"
    return replace(cost, stage_layers=found.stage_layers), search


def run_job(job: Job) -> list[tuple[Job, Outcome]]:
    """The job's outcome; a bi job that pays the replica-gradient sum also gives the same
    job without it, from the same plans (the sum changes no stage time, so no plan)."""
    cost, search = job_cost(job), ""
    if job.partition == "balanced" and not job.stage_layers:
        cost, search = balanced_cost(job, cost)
    try:
        plans = candidate_plans(job, cost)
    except ConfigError as exc:  # torch refuses the configuration
        return [(job, refused(job, str(exc)))]
    out = [(job, best_outcome(job, cost, plans, search))]
    free = cost.without_replica_sync()
    if job.variant.direction == "bi" and free != cost:
        unpaid = replace(job, replica_sum=False)
        out.append((unpaid, best_outcome(unpaid, free, plans, search)))
    return out


def best_outcome(
    job: Job, cost: CostModel, plans: list[tuple[str, Plan]], search: str = ""
) -> Outcome:
    timed = [(simulate(plan, cost), name) for name, plan in plans]
    result, plan_name = min(timed, key=lambda t: t[0].makespan)
    peaks = [r.peak_activation_bytes + r.param_bytes for r in result.per_rank]
    cost_aware = timed[0][0].makespan  # the first candidate: textbook or cost-aware
    return Outcome(
        job,
        result.makespan,
        result.bubble_fraction,
        max(peaks) / GIB,
        max(peaks) / min(peaks) if min(peaks) > 0 else math.inf,
        cost.hop_time,
        cost.layer_counts(job.variant.placement.depth).count(0) if cost.layers else 0,
        plan_name,
        cost_aware,
        result.replica_sync_time,
        cost.layer_counts(job.variant.placement.depth) if cost.layers else (),
        search,
        max(r.busy for r in result.per_rank) / result.makespan,
    )


def refused(job: Job, why: str) -> Outcome:
    """A torch schedule torch refuses for the job's configuration: no time (``inf``),
    ``plan`` says why."""
    return Outcome(
        job, math.inf, math.nan, math.nan, math.nan, math.nan, 0, f"refused: {why}", math.inf
    )


def job_weight(job: Job) -> float:
    """Rough relative CPU time of :func:`run_job`: the PRT planner runs a portfolio of list
    schedules over all 2 D m actions two or three times per plan (once per competing set of
    stage times, see :func:`megatron_prt.core.schedules.prt`), the textbook 1F1B plan is
    written down directly; a balanced split first searches partitions."""
    placement = job.variant.placement
    size = placement.depth * job.microbatches
    weight = 3.0 * size if job.variant.schedule == "prt" else 0.1 * size
    if job.variant.schedule == "zb":  # a portfolio of list schedules with memory caps
        weight = 8.0 * size
    return weight + (5.0 * size if job.partition == "balanced" else 0.0)


def run_all(jobs: list[Job], workers: int) -> dict[Job, Outcome]:
    """Simulate every job, on ``workers`` processes (1: in this process). The pool gets
    the heaviest jobs first, one at a time, so that both processes finish together; the
    outcomes come back in the order of ``jobs`` (ties between equally fast variants go to
    the first, see :meth:`Results.compare`)."""
    if workers <= 1:
        return {j: o for job in jobs for j, o in run_job(job)}
    heaviest_first = sorted(jobs, key=job_weight, reverse=True)
    with ProcessPoolExecutor(workers) as pool:
        done = dict(zip(heaviest_first, pool.map(run_job, heaviest_first), strict=True))
    return {j: o for job in jobs for j, o in done[job]}


# -- what the report asks for --------------------------------------------------------------------
@dataclass(frozen=True)
class Comparison:
    """For one model, link, m and direction: the baseline, the fastest PRT variant and the
    PRT generator's own R = 1 order (uni: :data:`REFERENCE`; bi: the baseline itself)."""

    baseline: Outcome
    best: Outcome
    reference: Outcome
    candidates: tuple[Outcome, ...]

    @property
    def gain(self) -> float:
        """Throughput gain of the best PRT variant over the baseline (0.5 = +50%)."""
        return self.baseline.ms / self.best.ms - 1

    @property
    def reuse_gain(self) -> float:
        """Gain over the same generator at R = 1: what reuse adds on its own."""
        return self.reference.ms / self.best.ms - 1


class Results(dict):
    """Job -> Outcome, looked up by what the tables ask for."""

    def at(
        self, name: str, link: str, m: int, variant: Variant, replica_sum=False, split="even"
    ) -> Outcome:
        return self[Job(name, link, m, variant, replica_sum, split)]

    def compare(
        self,
        name: str,
        link: str,
        m: int,
        direction: str,
        replica_sum: bool = False,
        split: str = "even",
    ) -> Comparison:
        key = (name, link, m, replica_sum, split)
        here = [
            o
            for j, o in self.items()
            if (j.model, j.link, j.microbatches, j.replica_sum, j.partition) == key
            and j.variant.direction == direction
        ]
        base = next(o for o in here if o.job.variant.role == "baseline")
        prts = tuple(o for o in here if o.job.variant.role == "prt")
        ref = next((o for o in here if o.job.variant.role == "reference"), base)
        return Comparison(base, min(prts, key=lambda o: o.ms), ref, prts)

    def gains(
        self, name: str, link: str, ms_: Sequence[int], direction: str, replica_sum=False
    ) -> dict[int, float]:
        return {m: self.compare(name, link, m, direction, replica_sum).gain for m in ms_}


def crossings(gains: dict[int, float], target: float) -> list[float]:
    """The m at which the gain curve crosses ``target``, interpolated linearly in log m
    between neighbouring simulated m."""
    points = sorted(gains.items())
    out = []
    for (m0, g0), (m1, g1) in pairwise(points):
        if g0 != g1 and min(g0, g1) <= target <= max(g0, g1):
            x = math.log(m0) + (target - g0) / (g1 - g0) * (math.log(m1) - math.log(m0))
            out.append(math.exp(x))
    return out


def matching_m(gains: dict[int, float], target: float) -> str:
    found = crossings(gains, target)
    if found:
        return " and ".join(f"m ≈ {x:.1f}" for x in found)
    top_m, top = max(gains.items(), key=lambda p: p[1])
    return f"never (largest {top:+.1%}, at m = {top_m})"


def all_variants(reuses: Sequence[int]) -> list[Variant]:
    uni = [v for v in prt_variants(reuses) if v.direction == "uni"]
    bi = [v for v in prt_variants(reuses) if v.direction == "bi"]
    first, chimera = baselines()
    return [first, REFERENCE, *uni, chimera, *bi]


@dataclass(frozen=True)
class Settings:
    names: tuple[str, ...]
    microbatches: tuple[int, ...]
    curve: tuple[int, ...]
    reuses: tuple[int, ...]
    sensitivity_links: tuple[str, ...]
    sensitivity_m: int
    h200_names: tuple[str, ...] = tuple(PROFILES)
    h200_links: tuple[str, ...] = H200_LINKS


def settings_of(args) -> Settings:
    names = tuple(models())
    if args.quick:
        return Settings(names, (8,), (8,), args.reuses, (), 8, h200_links=(H200_MAIN_LINK,))
    curve = tuple(sorted(set(CURVE_MICROBATCHES) | set(args.microbatches)))
    return Settings(names, tuple(args.microbatches), curve, args.reuses, SENSITIVITY_LINKS, 8)


def all_jobs(s: Settings) -> list[Job]:
    variants = all_variants(s.reuses)
    jobs = [Job(n, MAIN_LINK, m, v) for n in s.names for m in s.curve for v in variants]
    jobs += [Job(IDEAL, IDEAL_LINK, m, v) for m in s.curve for v in variants]
    for link in s.sensitivity_links:
        if link != MAIN_LINK:
            jobs += [Job(n, link, s.sensitivity_m, v) for n in s.names for v in variants]
    return jobs + h200_jobs(s)


# -- the H200 section: the profiled BERTs beside the FLOP model -----------------------------------
def h200_jobs(s: Settings) -> list[Job]:
    """Every variant on every H200 link with the replica-gradient sum (:func:`run_job` adds
    the bi jobs without it)."""
    variants = all_variants(s.reuses)
    even = [
        Job(n, k, m, v, True)
        for n in s.h200_names
        for k in s.h200_links
        for m in s.microbatches
        for v in variants
    ]
    balanced = [
        Job(n, H200_MAIN_LINK, m, v, True, "balanced")
        for n in s.h200_names
        for m in s.microbatches
        for v in balanced_variants(s.reuses)
    ]
    return even + balanced


def keep_faster_split(results: Results) -> Results:
    """A balanced row keeps the even split when that is faster. The partitioner times
    splits on the runtime's plan (built for uniform stages); the rows time each split on
    the plan built for its own costs as well, and for the even split that plan can beat
    the partitioner's pick on the runtime's plan."""
    out = Results()
    for job, o in results.items():
        even = results.get(replace(job, partition="even"))
        if job.partition == "balanced" and even is not None and even.ms < o.ms:
            o = replace(even, job=job, search=f"even split kept ({o.ms:.1f} ms balanced)")
        out[job] = o
    return out


def balanced_variants(reuses: Sequence[int]) -> list[Variant]:
    """What gets a balanced split: 1F1B and every PRT uni variant."""
    return [baselines()[0], *(v for v in prt_variants(reuses) if v.direction == "uni")]
