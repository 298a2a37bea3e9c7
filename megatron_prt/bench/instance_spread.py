"""How far apart runtimes of one and the same plan time: N instances of each chosen tuned-grid
configuration (the same plan, the same layer split, the same stack), built as the grid builds
its rows (:class:`~megatron_prt.bench.tuned_grid.grid.GridRunner`) on 2 gloo ranks, timed in
the grid's interleaved shuffled rounds (:func:`~megatron_prt.bench.common.measure_runners`),
then timed again in a second phase of fresh rounds: is an instance's speed its own, and does
its rank among its twins hold?

Per instance and phase: the median step (the slowest rank's wall time), and per rank the
median main-thread CPU time and minor page faults of a step (:class:`Metered`), so a slow
instance shows whether it computes slower or waits longer. Per instance also where its
tensors lie (:func:`placement`). Each hypothesis is a flag (``--seeds``, ``--flush-denormal``,
``--reclone``, ``--transport``, ``--gc-freeze``, ``--keep-freed-memory``,
``--ballast-between``); ``--remedy``
builds a second group of N instances with a per-instance change, timed in the same rounds.

    python benchmarks/instance_spread.py            # out/bench/instance_spread.{md,json}
    python benchmarks/instance_spread.py --smoke    # tiny stack, seconds
"""

from __future__ import annotations

import argparse
import gc
import os
import resource
import statistics
import sys
import time
from collections.abc import Sequence

import torch
from torch.nn.functional import mse_loss

from ..runtime import PipelineRuntime
from ..runtime.cpu import keep_freed_memory
from ..runtime.local import all_ok, run_local
from ..sim.cost import CostModel, LayerCost
from .common import interleaved_times, measure_runners, say
from .flags import apply_smoke
from .report import launch, md_table, write_report
from .tuned_grid.grid import PREDICTED, TUNED, Entry, GridRunner, grid_entries, pick
from .tuned_grid.stacks import STACKS, shm_capacity

NAME = "instance_spread"
DEFAULT_OUT = "out/bench"
DEFAULT_PLANS = "R=1 loop/uni, even;R=2 wave/uni split, even"
REMEDIES = ("none", "reclone", "shared-batch", "torch", "keep-grads")
TRANSPORTS = ("grid", "auto", "torch", "shm")
CONTEXT = "context"  # the group of --context's other grid rows


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--stack", default="equal", choices=STACKS, help="tuned-grid stack")
    p.add_argument("--plans", default=DEFAULT_PLANS, help="';'-separated grid labels")
    p.add_argument("-n", "--instances", type=int, default=6, help="instances per plan")
    p.add_argument("--reps", type=int, default=21, help="timed rounds per phase (median)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per instance")
    p.add_argument("-m", "--microbatches", type=int, default=8)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--wide", type=int, default=8192)
    p.add_argument("--mb-size", type=int, default=32)
    p.add_argument(
        "--seeds", choices=("same", "different"), default="same", help="(a) parameter values"
    )
    p.add_argument("--flush-denormal", action="store_true", help="(a) torch.set_flush_denormal")
    p.add_argument("--reclone", action="store_true", help="(b) re-clone all tensors after build")
    p.add_argument(
        "--reclone-between",
        action="store_true",
        help="(b) re-clone every instance's tensors between the phases (do ranks reshuffle?)",
    )
    p.add_argument(
        "--rebuild-between",
        action="store_true",
        help="(c) a new runtime (new rings) for every instance between the phases",
    )
    p.add_argument("--transport", choices=TRANSPORTS, default="grid", help="(c) the wire")
    p.add_argument("--gc-freeze", action="store_true", help="(e) gc.freeze + disable after build")
    p.add_argument("--keep-freed-memory", action="store_true", help="(e) glibc keeps freed memory")
    p.add_argument(
        "--keep-freed-memory-between",
        action="store_true",
        help="(e) phase 1 as glibc comes, phase 2 with freed memory kept (one launch)",
    )
    p.add_argument(
        "--ballast-between",
        type=float,
        default=0.0,
        metavar="GIB",
        help="(f) between the phases, make GiB of 1 MiB tensors on the heap, touch them, free "
        "them (with --keep-freed-memory glibc keeps the heap they grew)",
    )
    p.add_argument("--remedy", choices=REMEDIES, default="none", help="a second group, changed")
    p.add_argument(
        "--context",
        action="store_true",
        help="also build every other grid row of the stack and time it in the same rounds "
        "(the grid's memory footprint and neighbours; not reported)",
    )
    p.add_argument(
        "--heap-first",
        action="store_true",
        help="(b) free a 4 MiB block before building, so glibc serves the parameters from "
        "its heap (as after the grid's profiling) instead of mmap",
    )
    p.add_argument(
        "--picked",
        action="store_true",
        help="instance 0 of the first plan goes through the grid's selection phase first, "
        "as the tuned pick does",
    )
    p.add_argument("--out", default=DEFAULT_OUT)
    p.add_argument("--smoke", action="store_true", help="tiny stack, 3 rounds: checks it runs")
    args = p.parse_args(argv)
    args.plans = [label.strip() for label in args.plans.split(";") if label.strip()]
    if args.smoke:
        smoke = {"hidden": 32, "wide": 64, "mb_size": 2, "reps": 3, "warmup": 1, "instances": 3}
        apply_smoke(args, p, smoke)
    if args.instances < 2 or args.reps < 1:
        p.error(f"--instances must be >= 2 and --reps >= 1, got {args.instances}, {args.reps}")
    if args.ballast_between < 0:
        p.error(f"--ballast-between must be >= 0 GiB, got {args.ballast_between}")
    return args


# -- the instances --------------------------------------------------------------------------
def chosen_entries(args) -> tuple[list[Entry], list[Entry]]:
    """The grid's entries named by ``args.plans`` and (``--context``) every other one,
    planned for uniform layer costs (the grid plans the equal stack from its profiled ones,
    which differ only by noise)."""
    cost = CostModel(layers=(LayerCost(1.0, 2.0, wgrad=1.0),) * args.layers)
    entries = {e.label: e for e in grid_entries(cost, 2, args.microbatches)}
    missing = [label for label in args.plans if label not in entries]
    if missing:
        raise ValueError(f"--plans: {missing} are no grid labels; choose from {sorted(entries)}")
    others = [e for label, e in entries.items() if label not in args.plans]
    return [entries[label] for label in args.plans], others


class Metered:
    """A runner (:class:`GridRunner`) whose steps also record this rank's main-thread CPU
    seconds and minor page faults (``cpu_s``, ``faults``)."""

    def __init__(self, runner: GridRunner, keep_grads: bool = False) -> None:
        self.runner = runner
        self.keep_grads = keep_grads  # zeroed in place, not freed and reallocated each step
        self.cpu_s: list[float] = []
        self.faults: list[int] = []

    def __getattr__(self, name: str):
        return getattr(self.runner, name)

    @property
    def wire(self) -> str:
        """The transport the runtime uses now (``--transport``, ``--remedy torch``)."""
        return type(self.runner.runtime.transport).__name__

    def zero_grad(self) -> None:
        for module in self.runner.modules.values():
            module.zero_grad(set_to_none=not self.keep_grads)

    def step(self) -> None:
        faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        cpu = time.thread_time()
        self.runner.step()
        self.cpu_s.append(time.thread_time() - cpu)
        self.faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - faults)


def build(entry: Entry, rank: int, args, instance: int, remedy: str, shared: dict) -> Metered:
    """One instance of ``entry`` as the grid builds it, then the flags' changes."""
    runner = GridRunner(entry, args.stack, rank, args, args.microbatches)
    if args.seeds == "different":  # other values, the same shapes and placement
        gen = torch.Generator().manual_seed(1000 + instance)
        with torch.no_grad():
            for module in runner.modules.values():
                for p in module.parameters():
                    p.copy_(0.05 * torch.randn(p.shape, generator=gen))
    transport = "torch" if remedy == "torch" else args.transport
    if transport != "grid":
        runner.runtime.close()
        capacity = None if transport == "torch" else shm_capacity(args.stack, args)
        runner.runtime = PipelineRuntime(
            entry.plan, runner.modules, mse_loss, transport=transport, shm_capacity=capacity
        )
    if remedy == "shared-batch":
        runner.xs, runner.ys = shared.setdefault(entry.label, (runner.xs, runner.ys))
    return Metered(runner, keep_grads=remedy == "keep-grads")


def reclone(runner: Metered) -> None:
    """Every parameter and batch tensor of ``runner`` copied to a fresh allocation."""
    with torch.no_grad():
        for module in runner.modules.values():
            for p in module.parameters():
                p.data = p.data.clone()
    runner.runner.xs = [x.clone() for x in runner.xs]
    runner.runner.ys = [y.clone() for y in runner.ys]


def ballast(gib: float) -> None:
    """``gib`` GiB of 1 MiB tensors made and written, every other one freed first, then the
    rest: the heap a grid of many runtimes leaves behind (holes, then all free)."""
    blocks = [torch.ones(1 << 18) for _ in range(round(gib * 1024))]
    del blocks[::2]
    del blocks


def rebuild(runner: Metered, args) -> None:
    """A new runtime of the same plan on the same modules, with the transport it had."""
    old = runner.runner.runtime
    transport = "torch" if type(old.transport).__name__ == "TorchTransport" else "auto"
    old.close()
    capacity = None if transport == "torch" else shm_capacity(args.stack, args)
    runner.runner.runtime = PipelineRuntime(
        runner.plan, runner.modules, mse_loss, transport=transport, shm_capacity=capacity
    )


def placement(runner: Metered) -> dict:
    """Where the instance's tensors lie on this rank: its weight matrices' and first batch
    tensor's addresses modulo 4096 and 64 (a weight served from glibc's heap lies at any
    offset; an mmap'd one at 64 past a page)."""
    params = [p for module in runner.modules.values() for p in module.parameters()]
    big = [p.data_ptr() for p in params if p.dim() > 1]
    batch = [x.data_ptr() for x in runner.xs]
    return {
        "param_mod4096": sorted({ptr % 4096 for ptr in big}),
        "param_mod64": sorted({ptr % 64 for ptr in big}),
        "params": len(big),
        "batch_mod4096": batch[0] % 4096 if batch else None,
    }


# -- one rank -------------------------------------------------------------------------------
def instances(rank: int, args) -> dict[str, Metered]:
    """Every instance, built plan after plan within each index (build order = key order);
    ``--remedy`` adds a second group of the same."""
    entries, others = chosen_entries(args)
    picked = picked_first(entries[0], others, rank, args) if args.picked else None
    groups = ["none"] + ([args.remedy] if args.remedy != "none" else [])
    built: dict[str, Metered] = {}
    shared: dict = {}
    if args.heap_first:  # glibc raises its mmap threshold to a freed mmap'd block's size
        torch.empty(1 << 20).fill_(0)  # 4 MiB, mmap'd, freed at once
    for i in range(args.instances):
        for group in groups:
            for entry in entries:
                name = key(entry.label, group, i)
                if picked is not None and (i, group, entry) == (0, "none", entries[0]):
                    built[name] = picked
                    continue
                built[name] = build(entry, rank, args, i, group, shared)
    for i, entry in enumerate(
        others if args.context else []
    ):  # built after the first instances, as grid rows are
        built[key(entry.label, CONTEXT, i)] = build(entry, rank, args, i, "none", shared)
    if args.reclone or args.remedy == "reclone":
        for name, runner in reversed(built.items()):
            if args.reclone or group_of(name) == "reclone":
                reclone(runner)
    return built


def picked_first(entry: Entry, others: list[Entry], rank: int, args) -> Metered:
    """``entry``'s runner as the tuned pick's comes to the grid: built among 5 other grid
    rows, all timed in the grid's selection phase (:func:`~.tuned_grid.grid.pick`), the
    others closed."""
    best = [entry, *others[:5]]
    pick_args = argparse.Namespace(**{**vars(args), "pick_reps": 15})
    kept, record = pick(best, args.stack, rank, pick_args, args.microbatches)
    mine = kept[TUNED] if record["index"] == 0 else kept[PREDICTED]
    for runner in kept.values():
        if runner is not mine:
            runner.close()
    return Metered(mine)


def key(label: str, group: str, instance: int) -> str:
    return f"{label} | {group} | #{instance}"


def group_of(name: str) -> str:
    return name.split(" | ")[1]


def worker(rank: int, world: int, args) -> dict:
    """Build, place, warm up, time two phases; per instance the samples of each."""
    torch.set_flush_denormal(args.flush_denormal)
    if args.keep_freed_memory:
        keep_freed_memory()
    built = instances(rank, args)
    where = {name: placement(runner) for name, runner in built.items()}
    if args.gc_freeze:
        gc.collect()
        gc.freeze()
        gc.disable()
    label = f"instance spread ({args.stack}):"
    marks: dict[str, int] = {}
    where_after: dict[str, dict] = {}

    def second_phase(runners: dict, times: dict) -> dict:
        marks.update({name: len(r.cpu_s) for name, r in runners.items()})
        if args.keep_freed_memory_between:
            keep_freed_memory()
        ballast(args.ballast_between)
        for name, runner in runners.items():  # the same order on every rank (collective)
            if args.rebuild_between:
                rebuild(runner, args)
            if args.reclone_between:
                reclone(runner)
                where_after[name] = placement(runner)
            if (
                args.rebuild_between
                or args.reclone_between
                or args.keep_freed_memory_between
                or args.ballast_between
            ):
                runner.step()  # untimed: the new pages touched
        say(f"{label} second phase")
        return {"phase2": interleaved_times(runners, args.reps, label)}

    say(f"{label} {len(built)} instances built")
    measured = measure_runners(built, args, label, second_phase)
    reps = args.reps
    return {
        "placement": where,
        "placement_after_reclone": where_after,
        "wire": measured["wire"],
        "phases": [measured["times"], measured["phase2"]],
        "cpu_s": {n: _split(r.cpu_s, marks[n], reps) for n, r in built.items()},
        "faults": {n: _split(r.faults, marks[n], reps) for n, r in built.items()},
    }


def _split(samples: list, mark: int, reps: int) -> list[list]:
    """A runner's per-step samples as (first phase, second phase): the ``reps`` before
    ``mark`` (the end of the first phase) and the last ``reps``; untimed steps dropped."""
    return [samples[mark - reps : mark], samples[-reps:]]


# -- the report -----------------------------------------------------------------------------
def ranks_of(values: Sequence[float]) -> list[int]:
    """0-based rank of each value (ties by position)."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0] * len(values)
    for r, i in enumerate(order):
        out[i] = r
    return out


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman's rank correlation of two equally long sequences (no ties assumed)."""
    n = len(a)
    if n < 2:
        return float("nan")
    d2 = sum((x - y) ** 2 for x, y in zip(ranks_of(a), ranks_of(b), strict=True))
    return 1 - 6 * d2 / (n * (n * n - 1))


def summarize(per_rank: list[dict]) -> dict:
    """Per (plan, group): every instance's medians and placement, the spread (max / min of
    the instances' medians) per phase, the rank correlation of the two phases and of build
    order with the first."""
    res = per_rank[0]
    groups: dict[tuple[str, str], list[str]] = {}
    for name in res["phases"][0]:
        label, group, _ = name.split(" | ")
        groups.setdefault((label, group), []).append(name)
    out = []
    for (label, group), names in groups.items():
        if group == CONTEXT:
            continue
        rows = [_instance_row(name, per_rank) for name in names]
        first = [r["median_s"][0] for r in rows]
        second = [r["median_s"][1] for r in rows]
        out.append(
            {
                "plan": label,
                "group": group,
                "wire": res["wire"][names[0]],
                "instances": rows,
                "spread": [_spread(first), _spread(second)],
                "spearman_phases": spearman(first, second),
                "spearman_build_order": spearman(list(range(len(first))), first),
                "spearman_faults": [
                    spearman([sum(r["faults"][k]) for r in rows], [r["median_s"][k] for r in rows])
                    for k in (0, 1)
                ],
                "cpu_spread": _spread([max(r["cpu_s"][0]) for r in rows]),
            }
        )
    return {"groups": out}


def _spread(values: Sequence[float]) -> float:
    return max(values) / min(values) - 1


def _instance_row(name: str, per_rank: list[dict]) -> dict:
    """One instance: median step per phase, per rank its median thread CPU and page faults
    per phase, and where its tensors lie on each rank."""
    res = per_rank[0]
    return {
        "instance": int(name.rsplit("#", 1)[1]),
        "median_s": [statistics.median(phase[name]) for phase in res["phases"]],
        "samples_s": [phase[name] for phase in res["phases"]],
        "cpu_s": [[statistics.median(r["cpu_s"][name][k]) for r in per_rank] for k in (0, 1)],
        "faults": [[statistics.median(r["faults"][name][k]) for r in per_rank] for k in (0, 1)],
        "placement": [r["placement"][name] for r in per_rank],
        "placement_after_reclone": [r["placement_after_reclone"].get(name) for r in per_rank],
    }


def markdown(summary: dict, info: dict, args) -> str:
    """One table per (plan, group) and the spreads."""
    lines = [
        "# Instance spread: runtimes of one plan timed side by side (CPU, 2 gloo ranks)",
        "",
        f"Command: `{info['command']}`; wall {info['wall_s']:.0f} s; load average "
        f"{info['load_start']:.2f} at start, {info['load_end']:.2f} at end; "
        f"THP_MEM_ALLOC_ENABLE={os.environ.get('THP_MEM_ALLOC_ENABLE', '')!r}. Medians of "
        f"{args.reps} interleaved shuffled rounds per phase; CPU = main-thread CPU per step "
        "(median), faults = minor page faults per step (median), per rank.",
    ]
    for g in summary["groups"]:
        lines += [
            "",
            f"## {g['plan']} ({g['group']}, wire {g['wire']})",
            "",
            f"Spread (max/min - 1): phase 1 {g['spread'][0]:+.1%}, phase 2 "
            f"{g['spread'][1]:+.1%}; Spearman phase 1 vs 2: {g['spearman_phases']:+.2f}; "
            f"build order vs phase 1: {g['spearman_build_order']:+.2f}; spread of the busier "
            f"rank's CPU, phase 1: {g['cpu_spread']:+.1%}; Spearman page faults (both ranks) "
            f"vs time, phase 1 / 2: {g['spearman_faults'][0]:+.2f} / "
            f"{g['spearman_faults'][1]:+.2f}.",
            "",
        ]
        rows = [_md_row(r) for r in g["instances"]]
        header = [
            "#",
            "phase 1 ms",
            "phase 2 ms",
            "CPU ms r0/r1",
            "faults r0/r1 phase 1",
            "phase 2",
            "placement",
        ]
        lines += md_table(header, "rrrrrrl", rows)
    return "\n".join(lines) + "\n"


def _md_row(r: dict) -> list[str]:
    def place(p: dict) -> str:
        return f"{p['params']} weights mod4096 {p['param_mod4096']} batch {p['batch_mod4096']}"

    return [
        str(r["instance"]),
        f"{1e3 * r['median_s'][0]:.2f}",
        f"{1e3 * r['median_s'][1]:.2f}",
        "/".join(f"{1e3 * c:.2f}" for c in r["cpu_s"][0]),
        "/".join(f"{f:g}" for f in r["faults"][0]),
        "/".join(f"{f:g}" for f in r["faults"][1]),
        "; ".join(place(p) for p in r["placement"]),
    ]


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    command = " ".join(["python benchmarks/instance_spread.py", *argv])
    per_rank, info = launch(command, lambda: all_ok(run_local(2, worker, args, deadline_s=900)))
    summary = summarize(per_rank)
    text = markdown(summary, info, args)
    write_report(args, NAME, text, summary, info)
    print(text)
    return 0
