"""The three layer stacks of the tuned grid and their profiled costs.

* ``equal``: ``layers`` equal Linear(h, h) + GELU layers;
* ``head``: the same with a heavy last layer, Linear(h, 1.5 h) + GELU + Linear(1.5 h, h)
  (three layers' work on the last stage, like BERT's pretraining head);
* ``wide``: per-channel scale + GELU layers over ``wide`` channels: large messages for
  little compute, like ResNet's early layers.

Costs are measured on the ranks that run the grid (:func:`profile_costs`): every layer in
its own stage (R = layers // P, loop) under a traced 1F1B-order step and a traced
split-backward step, F, B, I and W medians per layer (backward: the whole one, W its share
of the split one); one message of the stack's width
timed on the shared-memory transport; the bi replica-gradient sum calibrated on a bi
runtime at the stack's width and at an eighth of it.

[Note: per-message CPU in place] A message timed alone costs its ranks less CPU than one
sent while both ranks compute (2 ranks on 2 cores: the transport's work competes with the
compute for the core). So the per-message CPU is fitted in place: the traced many-message
step (every layer its own stage) and an untraced 1F1B step (R = 1), both timed, give the
extra CPU per message that makes the simulated difference of the two equal the measured
one (never below the isolated figure; a per-step constant cancels out).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import replace

import torch
import torch.distributed as dist
from torch.nn.functional import mse_loss

from ...core import Placement, build_plan
from ...core.actions import Op
from ...core.plan import Plan
from ...runtime import PipelineRuntime, build_stages
from ...runtime.replica_timing import calibrate_replica_sync
from ...sim.cost import CostModel, LayerCost
from ...sim.simulate import simulate
from ..common import agreed, replica_cost_fields, replica_repeats, shm_costs

STACKS = ("equal", "head", "wide")
HEAD_EXPANSION = 1.5  # the head's inner width over h: 3 layers' multiply-adds


class Scale(torch.nn.Module):
    """Per-channel scale and shift, then GELU: little compute per byte it passes on."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(1 + 0.01 * torch.randn(width))
        self.bias = torch.nn.Parameter(0.01 * torch.randn(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(x * self.weight + self.bias)


def width(stack: str, args) -> int:
    """Features a micro-batch carries between layers (its message is mb_size x width)."""
    return args.wide if stack == "wide" else args.hidden


def layer_maker(stack: str, args, features: int | None = None) -> Callable[[int], torch.nn.Module]:
    """``make(i)``: layer ``i`` of ``stack``, the same on every rank (seeded by ``i``);
    ``features`` overrides the width (the replica-sum calibration's small model)."""
    n = features or width(stack, args)
    last = args.layers - 1

    def make(i: int) -> torch.nn.Module:
        torch.manual_seed(i)
        if stack == "wide":
            return Scale(n)
        if stack == "head" and i == last:
            inner = int(HEAD_EXPANSION * n)
            return torch.nn.Sequential(
                torch.nn.Linear(n, inner), torch.nn.GELU(), torch.nn.Linear(inner, n)
            )
        return torch.nn.Sequential(torch.nn.Linear(n, n), torch.nn.GELU())

    return make


def batch(stack: str, args, m: int, features: int | None = None):
    """Inputs and targets of ``m`` micro-batches, as lists (the same on every rank)."""
    gen = torch.Generator().manual_seed(2000 + m)
    n = features or width(stack, args)
    x = torch.randn(m * args.mb_size, n, generator=gen)
    y = torch.randn(m * args.mb_size, n, generator=gen)
    return list(x.tensor_split(m)), list(y.tensor_split(m))


def shm_capacity(stack: str, args) -> int:
    """Ring bytes: room for 8 messages, at least 1 MiB (many runtimes live at once)."""
    return max(1 << 20, 8 * 4 * args.mb_size * width(stack, args) + 4096)


def profile_layers(rank: int, world: int, stack: str, args) -> list[LayerCost]:
    """Per layer: F, B (whole), and I + W with W as ``wgrad``, seconds; medians over the
    traced steps' actions, every layer in its own stage; identical on every rank."""
    if args.layers % world:
        raise ValueError(f"--layers {args.layers} must be a multiple of the {world} ranks")
    reuse = args.layers // world
    placement = Placement(world, reuse)
    whole, _ = _spans(rank, placement, stack, args, "1f1b" if reuse == 1 else "prt")
    split, _ = _spans(rank, placement, stack, args, "zb")
    mine = torch.zeros(args.layers, 4, dtype=torch.float64)
    for k in range(args.layers):
        for column, (spans, op) in enumerate(
            ((whole, Op.F), (whole, Op.B), (split, Op.I), (split, Op.W))
        ):
            times = [e - s for a, s, e in spans if a.op is op and a.stage == k]
            mine[k, column] = statistics.median(times) if times else 0.0
    dist.all_reduce(mine)  # each layer is timed on the one rank that holds it
    grads = [_grad_bytes(layer_maker(stack, args)(k)) for k in range(args.layers)]
    # bwd: the whole backward; W its share as the split step measured it
    return [
        LayerCost(fwd=f, bwd=b, wgrad=b * w / (i + w) if i + w else 0.0, grad=g)
        for (f, b, i, w), g in zip(mine.tolist(), grads, strict=True)
    ]


def _spans(
    rank: int, placement: Placement, stack: str, args, schedule: str, trace: bool = True
) -> tuple[list, float]:
    """(the traced actions' spans, the median step time in seconds, the slowest rank's)."""
    m = max(2, placement.ranks)
    plan = build_plan(placement, m, schedule)
    stages = build_stages(placement, rank, layer_maker(stack, args), args.layers)
    runtime = PipelineRuntime(
        plan, stages, mse_loss, trace=trace, shm_capacity=shm_capacity(stack, args)
    )
    xs, ys = batch(stack, args, m)
    runtime.step(xs, ys)  # warm-up: shapes exchanged, allocator primed (not timed)
    spans, steps = [], []
    for _ in range(args.profile_steps):
        dist.barrier()
        start = time.perf_counter()
        runtime.step(xs, ys)
        steps.append(time.perf_counter() - start)
        if trace:
            spans += runtime.trace()
    runtime.close()
    step = torch.tensor([statistics.median(steps)], dtype=torch.float64)
    dist.all_reduce(step, op=dist.ReduceOp.MAX)
    return spans, float(step)


def message_cpu_in_place(cost: CostModel, timed: list[tuple[Plan, float]]) -> float:
    """[Note: per-message CPU in place]: the ``p2p_cpu`` (>= ``cost.p2p_cpu``) at which the
    simulated difference of the two ``(plan, measured seconds)`` in ``timed`` (fewest
    messages first) equals the measured one; bisection (the difference grows with it)."""
    (few, few_s), (many, many_s) = timed

    def gap(cpu: float) -> float:
        priced = replace(cost, p2p_cpu=cpu)
        return simulate(many, priced).makespan - simulate(few, priced).makespan

    low, high = cost.p2p_cpu, cost.p2p_cpu + many_s
    if gap(low) >= many_s - few_s:
        return low
    for _ in range(40):
        mid = (low + high) / 2
        low, high = (mid, high) if gap(mid) < many_s - few_s else (low, mid)
    return (low + high) / 2


def _grad_bytes(layer: torch.nn.Module) -> float:
    return float(sum(4 * p.numel() for p in layer.parameters()))


def replica_fields(rank: int, world: int, stack: str, args) -> dict:
    """The bi replica-gradient sum's cost fields, calibrated on this stack (collective)."""
    placement = Placement(world, 2, "wave", "bi")
    plan = build_plan(placement, 2)
    runtimes = [
        PipelineRuntime(
            plan,
            build_stages(placement, rank, layer_maker(stack, args, n), args.layers),
            mse_loss,
            shm_capacity=shm_capacity(stack, args),
        )
        for n in (max(4, width(stack, args) // 8), width(stack, args))
    ]
    fit = calibrate_replica_sync(*runtimes, repeats=replica_repeats(args))
    for runtime in runtimes:
        runtime.close()
    return replica_cost_fields(fit)


def profile_costs(rank: int, world: int, stack: str, args) -> CostModel:
    """The stack's cost model (module docstring), the same on every rank."""
    layers = profile_layers(rank, world, stack, args)
    latency, cpu = agreed(shm_costs(rank, (args.mb_size, width(stack, args)), args.burst))
    cost = CostModel(
        layers=tuple(layers),
        p2p_latency=latency,
        p2p_cpu=cpu,
        **replica_fields(rank, world, stack, args),
    )
    timed = []
    for reuse, schedule in ((1, "1f1b"), (args.layers // world, "prt")):
        placement = Placement(world, reuse)
        _, step_s = _spans(rank, placement, stack, args, schedule, trace=False)
        timed.append((build_plan(placement, max(2, world), schedule), step_s))
    cost = replace(cost, p2p_cpu=message_cpu_in_place(cost, timed))
    shared = [cost]
    dist.broadcast_object_list(shared, src=0)  # one model, bit for bit, on every rank
    return shared[0]
