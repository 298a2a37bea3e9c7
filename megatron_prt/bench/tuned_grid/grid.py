"""The measured grid and the tuner's pick, on one rank: every configuration of a stack is
planned on rank 0 (the same plans reach every rank), built as a megatron-prt runtime over
shared memory, and timed with the layer-stack bench's interleaved repetitions
(:func:`megatron_prt.bench.common.measure_runners`).

The tuned pick is the library's measured final pick
(:func:`megatron_prt.runtime.measured_pick.measured_pick`): the tuner's top ``--top``
candidates by predicted time are timed in a selection phase of their own (``--pick-reps``
interleaved steps each) and the fastest median wins. The winner's reported time comes from
the grid's repetitions that follow, not from the ones that chose it; the tuner's predicted
best runs there too when the clock picked another plan."""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, replace

import torch.distributed as dist
from torch.nn.functional import mse_loss

from ...core import Placement
from ...core.layers import even_layers
from ...core.placement import ConfigError
from ...core.plan import Plan
from ...runtime import PipelineRuntime, build_stages, sync_replicas
from ...runtime.cpu import keep_freed_memory
from ...runtime.measured_pick import measured_pick
from ...sim.cost import CostModel
from ...tune.measured import top_candidates
from ...tune.partition import partition
from ...tune.search_plans import Candidate, plan_for, tune
from ..common import interleaved_times, measure_runners, say
from .stacks import STACKS, batch, layer_maker, profile_costs, shm_capacity

REUSES = (1, 2, 3, 4)
TUNED = "tuned"  # the measured pick among the tuner's top candidates
PREDICTED = "tuner's predicted best"  # its first candidate, when the clock chose another


@dataclass(frozen=True)
class Entry:
    """One planned configuration: ``label``, its plan and layer split."""

    label: str
    plan: Plan
    stage_layers: tuple[int, ...]


def grid_entries(cost: CostModel, ranks: int, m: int) -> list[Entry]:
    """R in :data:`REUSES` (R * P <= layers), loop/wave (wave needs R >= 2), uni/bi,
    split backward off/on, the even and the partitioner's fastest split (when it differs);
    each plan built for its split's costs. Configurations that cannot exist are left out."""
    out = []
    layers = len(cost.layers)
    for reuse in REUSES:
        if reuse * ranks > layers:
            continue
        for where in ("loop", "wave") if reuse > 1 else ("loop",):
            for direction in ("uni", "bi"):
                placement = Placement(ranks, reuse, where, direction)
                for split in (False, True):
                    out += _entries(cost, placement, m, split)
    return out


def _entries(cost: CostModel, placement: Placement, m: int, split: bool) -> list[Entry]:
    one_f_one_b = (placement.reuse, placement.placement, placement.direction) == (1, "loop", "uni")
    schedule = "zb" if split else ("1f1b" if one_f_one_b else "prt")
    even = even_layers(len(cost.layers), placement.depth)
    found = partition(cost, placement, m, budget_bytes=math.inf, schedule=schedule)
    splits = {
        "even": even,
        **({"balanced": found.stage_layers} if found.stage_layers != even else {}),
    }
    name = f"R={placement.reuse} {placement.placement}/{placement.direction}"
    name += " split" if split else ""
    out = []
    for kind, counts in splits.items():
        priced = replace(cost, stage_layers=counts)
        priced = priced.split_form() if split else priced  # as the tuner plans split rows
        try:
            plan = plan_for(priced, placement, m, schedule, priced.stage_times(placement))
        except ConfigError:  # e.g. bi with fewer micro-batches than pipelines
            continue
        out.append(Entry(f"{name}, {kind}", plan.compute_only(), counts))
    return out


def tuned_entries(cost: CostModel, ranks: int, m: int, top: int) -> tuple[list[Entry], dict]:
    """The tuner's ``top`` best predicted candidates (R up to max(:data:`REUSES`)), one per
    configuration (:func:`~megatron_prt.tune.measured.top_candidates`), best first, and what
    the tuner said (``predicted_s`` per candidate)."""
    start = time.process_time()
    result = tune(cost, ranks, m, reuse_limit=max(REUSES))
    tune_cpu_s = time.process_time() - start
    best = top_candidates(result, top, per_configuration=True)
    info = {
        "tune_cpu_s": tune_cpu_s,
        "candidates": len(result.ranked),
        "top": [{"label": _label(c), "predicted_s": c.makespan} for c in best],
    }
    return [Entry(_label(c), c.plan.compute_only(), c.stage_layers) for c in best], info


def _label(c: Candidate) -> str:
    return f"{c.label}, {c.partition} split, plan for {c.planned_for}"


class GridRunner:
    """A megatron-prt runtime running one entry's plan on its split (the runner protocol of
    :func:`megatron_prt.bench.common.measure_runners`)."""

    def __init__(
        self, entry: Entry, stack: str, rank: int, args, m: int, trace: bool = False
    ) -> None:
        self.plan = entry.plan
        placement = entry.plan.placement
        self.placement = placement
        self.modules = build_stages(
            placement, rank, layer_maker(stack, args), args.layers, entry.stage_layers
        )
        sync_replicas(placement, self.modules)
        self.runtime = PipelineRuntime(
            entry.plan,
            self.modules,
            mse_loss,
            shm_capacity=shm_capacity(stack, args),
            trace=trace,
        )
        self.wire = type(self.runtime.transport).__name__
        self.replica_sum_s: list[float] = []
        self.xs, self.ys = batch(stack, args, m)

    def zero_grad(self) -> None:
        for module in self.modules.values():
            module.zero_grad(set_to_none=True)

    def step(self) -> None:
        self.runtime.step(self.xs, self.ys)
        if self.placement.direction == "bi":  # a bi training step sums the replicas
            start = time.perf_counter()
            self.runtime.reduce_replica_grads()
            self.replica_sum_s.append(time.perf_counter() - start)

    def peak_bytes(self) -> int:
        return 0  # not reported: the grid compares time

    def close(self) -> None:
        self.runtime.close()


def planned(cost: CostModel, ranks: int, m: int, top: int) -> tuple[list[Entry], list, dict]:
    """Rank 0 plans the grid and tunes; every rank gets the same entries (collective)."""
    shared: list = [None]
    if dist.get_rank() == 0:
        best, info = tuned_entries(cost, ranks, m, top)
        shared = [(grid_entries(cost, ranks, m), best, info)]
    dist.broadcast_object_list(shared, src=0)
    return shared[0]


def pick(best: list[Entry], stack: str, rank: int, args, m: int) -> tuple[dict, dict]:
    """The measured pick among ``best`` (module docstring): the runners to time again in the
    grid (:data:`TUNED`, and :data:`PREDICTED` when it lost) and the selection's record."""
    runners = [GridRunner(e, stack, rank, args, m) for e in best]
    picked = measured_pick(
        best, runners, reps=args.pick_reps, warmup=args.warmup, warm_steps=args.warm_steps
    )
    kept = {TUNED: runners[picked.index]}
    if picked.index != 0:
        kept[PREDICTED] = runners[0]
    for i, runner in enumerate(runners):
        if i not in (0, picked.index):
            runner.close()
    record = {
        "index": picked.index,
        "reps": args.pick_reps,
        "selection_s": [list(s) for s in picked.seconds],
        "selection_median_s": list(picked.medians),
    }
    return kept, record


def measure_stack(rank: int, world: int, stack: str, args) -> dict:
    """Profile ``stack``, plan the grid and tune on rank 0, pick among the tuner's top
    candidates by the clock, time every entry and the pick."""
    say(f"tuned grid, {stack}: profiling costs")
    cost, compute_scale, profiled = profile_costs(rank, world, stack, args)
    m = args.microbatches
    entries, best, info = planned(cost, world, m, args.top)
    say(f"tuned grid, {stack}: timing the tuner's top {len(best)} to pick one")
    kept, record = pick(best, stack, rank, args, m)
    say(f"tuned grid, {stack}: {len(entries)} grid configurations + the tuned pick")
    built = {e.label: GridRunner(e, stack, rank, args, m) for e in entries}
    twins = grid_twins(entries, {TUNED: best[record["index"]], PREDICTED: best[0]})
    for key, runner in kept.items():
        if key in twins:  # the grid's own row times it: [Note: grid twins]
            runner.close()
        else:
            built[key] = runner
    label = f"tuned grid, {stack}:"
    measured = measure_runners(
        built,
        args,
        label,
        lambda runners, times: rematch(runners, times, args, label, twins),
        warm_steps=args.warm_steps,
    )
    for key, row in twins.items():
        measured["times"][key] = measured["times"][row]
    return {
        "cost": cost,
        "compute_scale": compute_scale,
        "profiled_cost": profiled,
        "entries": [_row(e) for e in entries],
        "tuned": _row(best[record["index"]]),
        "predicted_best": _row(best[0]),
        "tune": {**info, "pick": record},
        "times": measured["times"],
        "rematch": measured["rematch"],
        "twins": twins,
    }


def grid_twins(entries: list[Entry], picks: dict[str, Entry]) -> dict[str, str]:
    """For each of ``picks`` (key -> entry) that runs the very plan of a grid entry on the
    same layer split: key -> that entry's label.

    [Note: grid twins] The tuner's pick is often a grid configuration itself (the same
    plan, the same split). Timed as two runtimes in the same interleaved rounds, such twins
    measured up to 19% apart on the 2-core machine (medians of 21 steps each; 12% apart
    again in the held-out rematch), which says nothing about the plan; on a quiet host
    twins measured 1-8% apart and none kept its rank from one phase of rounds to the next
    (benchmarks/instance_spread.py, docs/instance_spread.md). A twin is therefore
    timed once, as its grid row, and the report says so; a pick that is no grid row gets
    its own runtime, as before."""
    twins = {}
    for key, pick in picks.items():
        run = (pick.plan, tuple(pick.stage_layers))
        row = next((e.label for e in entries if (e.plan, tuple(e.stage_layers)) == run), None)
        if row is not None:
            twins[key] = row
    return twins


def rematch(runners: dict, times: dict, args, label: str, twins: dict | None = None) -> dict:
    """The grid's fastest row and the tuned pick again, on their own, ``args.reps``
    interleaved repetitions each (every rank holds the same times: the grid's best is the
    same row on every rank); a pick that is a grid row's twin ([Note: grid twins]) is
    timed by that row's runtime, and once when it is the grid's best itself.

    [Note: held-out rematch] The grid's best is the smallest of some 45 noisy medians, so
    its own median is biased low (the winner's curse), while the tuned pick's median in the
    same repetitions is not (it was chosen in a selection phase of its own). Timing the two
    again, apart from the repetitions that chose either, compares them without that bias;
    the report gives it beside the in-grid comparison the target names."""
    grid = [key for key in runners if key not in (TUNED, PREDICTED)]
    best = min(grid, key=lambda key: statistics.median(times[key]))
    tuned = (twins or {}).get(TUNED, TUNED)
    pair = {best: runners[best], **({TUNED: runners[tuned]} if tuned != best else {})}
    timed = interleaved_times(pair, args.reps, label, warm_steps=args.warm_steps)
    timed.setdefault(TUNED, timed[best])
    return {"rematch": {"grid_best": best, "times": timed}}


def _row(entry: Entry) -> tuple:
    return entry.label, entry.plan, entry.stage_layers


def worker(rank: int, world: int, args) -> dict:
    """One rank: every stack of ``args.stacks`` in turn, glibc keeping freed memory
    (:func:`~megatron_prt.runtime.cpu.keep_freed_memory`) unless ``--no-keep-freed-memory``.

    [Note: freed memory kept] Without it, a step's minor page faults depended on the state
    of the heap the other rows' steps left: 0 to ~4000 a step for one and the same plan of
    the wide stack, different from phase to phase, some 7% of its step time
    (benchmarks/instance_spread.py, docs/instance_spread.md); kept, they are 0."""
    if args.keep_freed_memory:
        keep_freed_memory()
    return {stack: measure_stack(rank, world, stack, args) for stack in args.stacks}


__all__ = ["STACKS", "worker"]
