"""megatron-prt's 1F1B against torch.distributed.pipelining's Schedule1F1B over gloo, side
by side on the layer stack: the per-step overhead of the message path, alone.

Both run the same stage modules (:func:`ranks.layer_maker`), the same batch, the same loss
and the same wire (gloo, ``transport="torch"``), built by the layer-stack bench's own
runners (:class:`ranks.PrtRunner`, :class:`ranks.TorchRunner`), each step timed the same way
(gradients zeroed, a barrier, the step, the slowest rank's wall time:
:func:`megatron_prt.bench.common.timed_step`) in interleaved repetitions. Per rank it also
records the process and main-thread CPU time of every step (gloo's I/O threads count in the
process time), which load from other processes does not inflate as it does wall time.
Optionally, with ``--zb``, megatron-prt's split-backward plan (``PRT zb (R=1)``) runs as a
third configuration, from a fixed cost model (I and W each half of the backward).

    python benchmarks/gloo_1f1b.py --microbatches 4,8 --reps 41

prints one table per m: medians of wall time and of CPU time per step (max over ranks),
and megatron-prt's ratios to torch's: of the medians, and (``paired``) the median of the
per-round ratios. Under load from other processes trust the CPU columns and ``paired``;
the wall-clock columns are for a quiet machine.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from ...runtime.cpu import keep_freed_memory
from ...runtime.local import all_ok, run_local
from ...sim.cost import CostModel, LayerCost
from ...tune.measured import interleaved_rounds
from ..report import md_table
from .configs import GLOO, Config
from .ranks import PrtRunner, TorchRunner

OURS, TORCH, ZB = "PRT 1F1B (R=1)", "torch Schedule1F1B", "PRT zb (R=1)"


def configs(zb: bool) -> dict[str, Config]:
    chosen = {
        OURS: Config(OURS, GLOO),
        TORCH: Config("torch Schedule1F1B (1/rank)", GLOO, schedule="Schedule1F1B"),
    }
    if zb:
        chosen[ZB] = Config(ZB, GLOO, split=True)
    return chosen


def _timed(runner) -> tuple[float, float, float]:
    """One step: (slowest rank's wall s, this rank's process CPU s, main-thread CPU s)."""
    runner.zero_grad()
    dist.barrier()
    wall, cpu, thread = time.perf_counter(), time.process_time(), time.thread_time()
    runner.step()
    cpu, thread = time.process_time() - cpu, time.thread_time() - thread
    elapsed = torch.tensor([time.perf_counter() - wall])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed), cpu, thread


def worker(rank: int, world: int, args) -> dict:
    """Every configuration at every m on this rank: per key, the per-step samples."""
    if args.keep_freed_memory:
        keep_freed_memory()
    layer = LayerCost(fwd=1.0, bwd=2.0, grad=float((args.hidden + 1) * args.hidden * 4))
    cost = CostModel(layers=(layer,) * args.layers, wgrad_fraction=0.5)
    out = {}
    for m in args.microbatches:
        runners = {}
        for key, cfg in configs(args.zb).items():
            if cfg.family == "torch":
                runners[key] = TorchRunner(cfg, rank, world, args, m)
            else:
                runners[key] = PrtRunner(cfg, rank, world, args, m, cost)
        for runner in runners.values():
            for _ in range(args.warmup):
                runner.step()
        keys = list(runners)
        samples: dict[str, list] = {key: [] for key in keys}
        for order in interleaved_rounds(len(keys), args.reps):  # [Note: shuffled rounds]
            for i in order:
                samples[keys[i]].append(_timed(runners[keys[i]]))
        for runner in runners.values():
            runner.close()
        out[m] = samples
    return out


def _medians(per_rank: list[dict], m: int, key: str) -> tuple[float, float, float]:
    """Median wall (slowest rank), and the largest per-rank median process and thread CPU."""
    wall = statistics.median(s[0] for s in per_rank[0][m][key])
    cpu = max(statistics.median(s[1] for s in rank[m][key]) for rank in per_rank)
    thread = max(statistics.median(s[2] for s in rank[m][key]) for rank in per_rank)
    return wall, cpu, thread


def _paired(per_rank: list[dict], m: int, key: str) -> float:
    """Median over rounds of torch's wall time / this one's in the same round (the two ran
    a few steps apart, so a drift in load cancels)."""
    pairs = zip(per_rank[0][m][TORCH], per_rank[0][m][key], strict=True)
    return statistics.median(theirs[0] / ours[0] for theirs, ours in pairs)


def table(per_rank: list[dict], m: int, zb: bool) -> list[str]:
    ref = _medians(per_rank, m, TORCH)
    rows = []
    for key in configs(zb):
        wall, cpu, thread = _medians(per_rank, m, key)
        rows.append(
            [
                key,
                f"{wall * 1e3:.2f}",
                f"{ref[0] / wall:.3f}",
                f"{_paired(per_rank, m, key):.3f}",
                f"{cpu * 1e3:.2f}",
                f"{ref[1] / cpu:.3f}",
                f"{thread * 1e3:.2f}",
                f"{ref[2] / thread:.3f}",
            ]
        )
    header = [
        f"m={m}",
        "wall ms",
        "torch/this",
        "paired",
        "process CPU ms",
        "torch/this",
        "thread CPU ms",
        "torch/this",
    ]
    return md_table(header, "lrrrrrrr", rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--microbatches", default="4,8", help="comma-separated m values")
    parser.add_argument("--reps", type=int, default=41, help="interleaved timed repetitions")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per configuration")
    parser.add_argument("--ranks", type=int, default=2, help="pipeline ranks (local gloo)")
    parser.add_argument("--layers", type=int, default=8, help="Linear+GELU layers")
    parser.add_argument("--hidden", type=int, default=768, help="layer width")
    parser.add_argument("--mb-size", type=int, default=16, help="rows per micro-batch")
    parser.add_argument("--zb", action="store_true", help="also megatron-prt's split-backward")
    parser.add_argument("--no-keep-freed-memory", dest="keep_freed_memory", action="store_false")
    args = parser.parse_args(argv)
    args.microbatches = [int(m) for m in args.microbatches.split(",")]
    per_rank = all_ok(run_local(args.ranks, worker, args, deadline_s=3000))
    print(
        f"{args.ranks} gloo ranks, {args.layers} x Linear({args.hidden})+GELU, micro-batch "
        f"{args.mb_size}; medians of {args.reps} interleaved steps (CPU: max over ranks)"
    )
    for m in args.microbatches:
        print("\n".join(["", *table(per_rank, m, args.zb)]))
    return 0
