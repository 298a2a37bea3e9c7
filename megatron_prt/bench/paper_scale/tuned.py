"""paper_scale's tuned row: what ``megatron-prt tune`` picks for every model, link and m of
the split-backward tables, timed under the same costs as every row there.

The tuner (:func:`megatron_prt.tune.search_plans.tune`) searches its own space (1F1B,
megatron interleaved, PRT loop/wave x uni/bi, split backward, R up to :data:`TUNE_REUSE`,
the even and the partitioner's split) under the costs of the rows: the FLOP model's
messages sized by the cuts that cross ranks for the placement and split at hand
(:func:`price`), W half of every backward, the bi replica-gradient sum where the rows pay
it, a memory budget of the GPU's memory. Every row of the same model, link and m that is
faster than the search's pick is then shown to the tuner as a seed
(:func:`megatron_prt.tune.search_plans.add_seeds`), so the tuned row is never slower than a
row; the row says which rows beat the search (a gap in its search space, e.g. torch's own
orders or R beyond ``layers // P``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from functools import partial

from ...core import Placement
from ...sim.analytic import GIB, H200_MEMORY, V100_MEMORY
from ...sim.cost import CostModel
from ...tune.search_plans import Candidate, Seed, add_seeds, tune
from .jobs import RANKS, Job, Outcome, Results, Variant, candidate_plans, job_cost
from .profiles import PROFILES

TUNE_REUSE = 4  # the rows' largest R: the tuner searches R = 1 .. min(4, layers // P)
TUNED = "tuned"  # the role of a tuned row


@dataclass(frozen=True)
class TuneJob:
    """One tuned row: the key of the rows it must match and those rows (their outcomes)."""

    model: str
    link: str
    microbatches: int
    replica_sum: bool
    rows: tuple[Outcome, ...]


def price(
    model: str, link: str, replica_sum: bool, placement: Placement, stage_layers: Sequence[int]
) -> CostModel:
    """The rows' costs (:func:`.jobs.job_cost` of a split-backward row) for ``placement``
    and ``stage_layers`` (the FLOP model prices each cut on its own message)."""
    job = Job(model, link, 1, Variant(TUNED, placement, "zb", "zb"), replica_sum)
    return replace(job_cost(job), stage_layers=tuple(stage_layers))


def memory_budget(model: str) -> float:
    return H200_MEMORY if model in PROFILES else V100_MEMORY


def tune_jobs(results: Results) -> list[TuneJob]:
    """One per (model, link, m, replica_sum) of the split-backward rows, with every finite
    row of that key (even and balanced splits; a split row that only repeats a non-split
    one is left out, the non-split row is there)."""
    keys = sorted(
        {
            (j.model, j.link, j.microbatches, j.replica_sum)
            for j in results
            if j.variant.label == "ZB-H1" and j.partition == "even"
        }
    )
    return [
        TuneJob(
            *key,
            tuple(
                o
                for j, o in results.items()
                if (j.model, j.link, j.microbatches, j.replica_sum) == key
                and j.variant.role != TUNED
                and math.isfinite(o.ms)
                and not o.plan.startswith("non-split")
            ),
        )
        for key in keys
    ]


def run_tuned(tj: TuneJob) -> tuple[Job, Outcome]:
    """The tuner's pick for ``tj``: its own search, then seeded with the rows faster than
    that (their kept plans rebuilt), as an :class:`Outcome` of role :data:`TUNED`."""
    pricing = partial(price, tj.model, tj.link, tj.replica_sum)
    one = Placement(RANKS, 1)
    base = pricing(one, job_cost(_row_job(tj, one)).layer_counts(RANKS))
    result = tune(
        base,
        RANKS,
        tj.microbatches,
        budget_bytes=memory_budget(tj.model),
        reuse_limit=TUNE_REUSE,
        price=pricing,
    )
    searched = result.winner
    faster = [o for o in tj.rows if o.ms < searched.makespan * (1 - 1e-9)]
    if faster:
        result = add_seeds(result, pricing, [row_seed(o) for o in faster])
    winner = result.winner
    beaten = sorted({_row_label(o) for o in faster})
    how = f"search beaten by {', '.join(beaten)}: seeded" if beaten else "search"
    return outcome(tj, winner, base, how)


def _row_job(tj: TuneJob, placement: Placement) -> Job:
    return Job(tj.model, tj.link, tj.microbatches, Variant(TUNED, placement, "zb", "zb"))


def _row_label(o: Outcome) -> str:
    v = o.job.variant
    return f"{v.label} ({o.job.partition})" if o.job.partition != "even" else v.label


def row_seed(o: Outcome) -> Seed:
    """The plan a row kept, rebuilt as the row built it, with the row's split."""
    cost = job_cost(o.job)
    if o.stage_layers:
        cost = replace(cost, stage_layers=o.stage_layers)
    plans = dict(candidate_plans(o.job, cost))
    return Seed(_row_label(o), plans[o.plan], cost.layer_counts(o.job.variant.placement.depth))


def outcome(tj: TuneJob, winner: Candidate, base: CostModel, how: str) -> tuple[Job, Outcome]:
    r = winner.result
    label = f"{winner.label}, {winner.partition} split"
    job = Job(
        tj.model,
        tj.link,
        tj.microbatches,
        Variant(label, winner.family.placement, winner.family.schedule, TUNED),
        tj.replica_sum,
    )
    peaks = winner.rank_peaks
    return job, Outcome(
        job,
        r.makespan,
        r.bubble_fraction,
        max(peaks) / GIB,
        max(peaks) / min(peaks) if min(peaks) > 0 else math.inf,
        base.hop_time,
        winner.stage_layers.count(0),
        f"tuner ({how})",
        r.makespan,
        r.replica_sync_time,
        winner.stage_layers,
        how,
        max(x.busy for x in r.per_rank) / r.makespan,
    )


def run_tuned_all(results: Results, workers: int) -> Results:
    """``results`` with a tuned row per key of :func:`tune_jobs`, on ``workers`` processes."""
    todo = tune_jobs(results)
    if workers <= 1:
        done = [run_tuned(tj) for tj in todo]
    else:
        with ProcessPoolExecutor(workers) as pool:
            done = list(pool.map(run_tuned, todo))
    out = Results(results)
    out.update(done)
    return out


def tuned_row(results: Results, key: Sequence) -> Outcome | None:
    """The tuned row of (model, link, m, replica_sum), if it was run."""
    return next(
        (
            o
            for j, o in results.items()
            if j.variant.role == TUNED and (j.model, j.link, j.microbatches, j.replica_sum) == key
        ),
        None,
    )
