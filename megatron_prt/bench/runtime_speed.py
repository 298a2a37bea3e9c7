"""Measured vs simulated speed of the runtime on this machine (CPU, gloo, one thread/rank).

    python benchmarks/runtime_speed.py                 # P=2, 8-layer MLP, hidden 768, mb 16, m=2
    python benchmarks/runtime_speed.py --microbatches 8 --reps 9   (make bench-runtime)

Configurations run interleaved (A B C A B C ...) in one launch; the table gives the median
iteration time, the ratio to R=1, the simulator's prediction from costs profiled in the same
run (per-stage forward/backward times from a traced R=1 step), and measured/predicted.
Also measures the executor's own cost per action with trivial compute. Prints its table
(no file is written).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..core import Placement, build_plan
from ..runtime import PipelineRuntime, build_stages
from ..runtime.cpu import keep_freed_memory
from ..runtime.local import all_ok, run_local
from ..sim.cost import CostModel, LayerCost
from ..sim.simulate import simulate


def _mlp(hidden):
    def make(i):
        torch.manual_seed(i)
        return torch.nn.Sequential(torch.nn.Linear(hidden, hidden), torch.nn.ReLU())

    return make


def _runtime(world, rank, reuse, placement, args, trace=False, layer=None):
    """A runtime for this configuration; with ``layer`` costs the plan is generated for them
    (what a user does after profiling), else for uniform stages with backward = 2 x forward."""
    pl = Placement(world, reuse, placement)
    times = CostModel(layers=(layer,) * args.layers).stage_times(pl) if layer else None
    plan = build_plan(pl, args.microbatches, times=times)
    stages = build_stages(plan.placement, rank, _mlp(args.hidden), args.layers)
    return PipelineRuntime(
        plan, stages, torch.nn.functional.mse_loss, trace=trace, transport=args.transport
    )


def _timed_step(runtime, xs, ys) -> float:
    dist.barrier()
    start = time.perf_counter()
    runtime.step(xs, ys)
    elapsed = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # an iteration ends when all ranks do
    return float(elapsed)


def _profile_layer_costs(world, rank, args, xs, ys) -> LayerCost:
    """Per-layer forward/backward seconds from a traced R=1 step (median over ranks)."""
    runtime = _runtime(world, rank, 1, "loop", args, trace=True)
    for _ in range(3):
        runtime.step(xs, ys)
    spans = runtime.trace()
    layers_per_stage = args.layers / world
    fwd = statistics.median(e - s for a, s, e in spans if a.op.value == "F")
    bwd = statistics.median(e - s for a, s, e in spans if a.op.value == "B")
    both = torch.tensor([fwd, bwd]) / layers_per_stage
    dist.all_reduce(both)
    fwd, bwd = (both / world).tolist()
    return LayerCost(fwd=fwd, bwd=bwd)


def _message_costs(rank, world, args) -> tuple[float, float]:
    """(latency, cpu) of one activation-sized message between ranks 0 and 1: one-way time
    of a ping-pong, and the process CPU time per message sent or received in a burst."""
    if world < 2 or rank > 1:
        dist.barrier()
        dist.barrier()
        return 0.0, 0.0
    peer = 1 - rank
    tensor = torch.randn(args.mb_size, args.hidden)
    burst = 64
    dist.barrier()
    cpu0 = time.process_time()
    recvs = [dist.irecv(torch.empty_like(tensor), peer) for _ in range(burst)]
    sends = [dist.isend(tensor, peer) for _ in range(burst)]
    for work in recvs + sends:
        work.wait()
    cpu = (time.process_time() - cpu0) / (2 * burst)
    samples = []
    for _ in range(50):
        start = time.perf_counter()
        if rank == 0:
            dist.send(tensor, peer)
            dist.recv(tensor, peer)
        else:
            dist.recv(tensor, peer)
            dist.send(tensor, peer)
        samples.append((time.perf_counter() - start) / 2)
    dist.barrier()
    return statistics.median(samples), cpu


def _worker(rank, world, args):
    if args.keep_freed_memory:
        keep_freed_memory()
    torch.manual_seed(0)
    xs = [torch.randn(args.mb_size, args.hidden) for _ in range(args.microbatches)]
    ys = [torch.randn(args.mb_size, args.hidden) for _ in range(args.microbatches)]
    configs = [(int(c.split(":")[0]), c.split(":")[1]) for c in args.configs.split(",")]
    profiled = _profile_layer_costs(world, rank, args, xs, ys) if args.profiled_plans else None
    runtimes = {c: _runtime(world, rank, c[0], c[1], args, layer=profiled) for c in configs}
    for runtime in runtimes.values():  # warm-up: shapes exchanged, allocator primed
        runtime.step(xs, ys)
    times = {c: [] for c in configs}
    for _ in range(args.reps):
        for c in configs:
            times[c].append(_timed_step(runtimes[c], xs, ys))
    layer = profiled or _profile_layer_costs(world, rank, args, xs, ys)
    hop = _message_costs(rank, world, args)
    overhead = _overhead() if args.overhead else None
    return {"times": times, "layer": layer, "hop": hop, "overhead": overhead}


def _overhead() -> dict:
    """Executor cost per action without communication: one rank, R=8 stages of a 1x1
    Linear, 32 micro-batches, vs the same forward/backward calls made directly."""

    class Args:
        microbatches, hidden, layers, transport = 32, 1, 8, "torch"

    group = dist.new_group([0])
    if dist.get_rank() != 0:
        return {}
    plan = build_plan(Placement(1, 8), Args.microbatches)
    stages = build_stages(plan.placement, 0, _mlp(1), Args.layers)
    runtime = PipelineRuntime(plan, stages, torch.nn.functional.mse_loss, group=group)
    xs = [torch.randn(1, 1) for _ in range(Args.microbatches)]
    direct = torch.nn.Sequential(*stages.values())
    steps, raws = [], []
    for _ in range(21):
        start = time.perf_counter()
        runtime.step(xs, xs)
        steps.append(time.perf_counter() - start)
        start = time.perf_counter()
        for x in xs:
            (torch.nn.functional.mse_loss(direct(x), x) / len(xs)).backward()
        raws.append(time.perf_counter() - start)
    actions = 2 * 8 * Args.microbatches
    return {
        "step_s": statistics.median(steps),
        "raw_s": statistics.median(raws),
        "actions": actions,
    }


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--mb-size", type=int, default=16)
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument(
        "--configs", default="1:loop,2:loop,4:loop,4:wave", help="comma-separated R:placement"
    )
    parser.add_argument("--transport", choices=("auto", "shm", "torch"), default="auto")
    parser.add_argument("--no-overhead", dest="overhead", action="store_false")
    parser.add_argument(
        "--profiled-plans",
        action="store_true",
        help="generate the plans from costs profiled first (default: uniform-cost plans)",
    )
    parser.add_argument(
        "--no-keep-freed-memory",
        dest="keep_freed_memory",
        action="store_false",
        help="leave glibc's default of returning large freed blocks to the OS",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run on ``--ranks`` forked gloo ranks and print the table; 0."""
    args = parse_args(argv)
    results = all_ok(run_local(args.ranks, _worker, args, deadline_s=3000))
    report(args, results)
    return 0


def report(args: argparse.Namespace, results: list[dict]) -> None:
    """Print measured vs simulated time per configuration and the executor's overhead."""
    res = results[0]
    layer = res["layer"]
    hop = max(r["hop"][0] for r in results)
    cpu = max(r["hop"][1] for r in results)
    no_comm = CostModel(layers=(layer,) * args.layers)
    with_comm = CostModel(layers=(layer,) * args.layers, p2p_latency=hop, p2p_cpu=cpu)
    print(
        f"transport={args.transport} P={args.ranks} layers={args.layers} "
        f"hidden={args.hidden} mb={args.mb_size} "
        f"m={args.microbatches} reps={args.reps}; profiled per layer: fwd {layer.fwd * 1e3:.2f} "
        f"ms, bwd {layer.bwd * 1e3:.2f} ms; per message: latency {hop * 1e3:.3f} ms, "
        f"cpu {cpu * 1e3:.3f} ms"
    )
    first = next(iter(res["times"]), (1, "loop"))[0]
    vs = f"vs R={first}"  # every ratio is to the first --configs entry
    print(
        f"{'config':<10} {'measured ms':>11} {vs:>7} | {'sim, no comm':>12} {vs:>7} "
        f"{'meas/sim':>8} | {'sim, comm':>9} {vs:>7} {'meas/sim':>8}"
    )
    base = None
    for (reuse, placement), samples in res["times"].items():
        measured = statistics.median(samples)
        pl = Placement(args.ranks, reuse, placement)
        times = no_comm.stage_times(pl) if args.profiled_plans else None
        plan = build_plan(pl, args.microbatches, times=times)  # the plan the run executed
        a, b = simulate(plan, no_comm).makespan, simulate(plan, with_comm).makespan
        if base is None:
            base, base_a, base_b = measured, a, b
        print(
            f"R={reuse} {placement:<6} {measured * 1e3:>11.1f} {measured / base:>7.3f} | "
            f"{a * 1e3:>12.1f} {a / base_a:>7.3f} {measured / a:>8.3f} | {b * 1e3:>9.1f} "
            f"{b / base_b:>7.3f} {measured / b:>8.3f}"
        )
    if res["overhead"]:
        o = res["overhead"]
        per_action = (o["step_s"] - o["raw_s"]) / o["actions"]
        print(
            f"executor overhead: {per_action * 1e6:.1f} us per compute action (1 rank, R=8, "
            f"m=32, 1x1 layers: {o['step_s'] * 1e3:.2f} ms per step vs {o['raw_s'] * 1e3:.2f} ms "
            "for the same forward/backward calls made directly)"
        )
