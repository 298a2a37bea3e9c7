"""The three layer stacks of the tuned grid and their profiled costs.

* ``equal``: ``layers`` equal Linear(h, h) + GELU layers;
* ``head``: the same with a heavy last layer, Linear(h, 1.5 h) + GELU + Linear(1.5 h, h)
  (three layers' work on the last stage, like BERT's pretraining head);
* ``wide``: per-channel scale + GELU layers over ``wide`` channels: large messages for
  little compute, like ResNet's early layers.

Costs are measured on the ranks that run the grid (:func:`profile_costs`): every layer in
its own stage (R = layers // P, loop) under a traced 1F1B-order step and a traced
split-backward step, F, B, I and W medians per layer (backward: the whole one, W its share
of the split one); one message of the stack's width timed on the shared-memory transport
(CPU per message; the latency is the one-way time less both ends' CPU: [Note: a hop's time
less its CPU] in :mod:`megatron_prt.tune.measured`); the bi replica-gradient sum calibrated
on a bi runtime at the stack's width and at an eighth of it. Then the stack's own layers run a
1F1B step (few messages), a step with every layer its own stage (many), an R = 1 loop/bi
step and an R = 1 split-backward step (:func:`split_reference`), at the grid's micro-batch
count, interleaved: the per-layer times are scaled so that the first comes out as measured,
the per-message CPU is fitted to the gap of the first two, the replica latency to the third
and the split form's scale to the fourth (:func:`megatron_prt.tune.measured.fit_in_place`,
[Note: compute fitted in place], [Note: the replica sum in place], [Note: the split form in
place]).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.nn.functional import mse_loss

from ...core import Placement, build_plan
from ...core.actions import Op
from ...core.plan import Plan
from ...runtime import PipelineRuntime, build_stages
from ...runtime.comm_timing import few_and_many_messages
from ...runtime.measured_pick import RuntimeRunner
from ...runtime.replica_timing import calibrate_replica_sync
from ...sim.cost import CostModel, LayerCost
from ...tune.measured import fit_in_place
from ...tune.search_plans import plan_for
from ..common import agreed, replica_cost_fields, replica_repeats, shm_costs, wire_fields

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
    """Per layer: F and B (whole), the split form's F and I + W (``split_fwd``,
    ``split_bwd``) with W as ``wgrad``, seconds; medians over the traced steps' actions,
    every layer in its own stage; identical on every rank."""
    if args.layers % world:
        raise ValueError(f"--layers {args.layers} must be a multiple of the {world} ranks")
    reuse = args.layers // world
    placement = Placement(world, reuse)
    whole, split = _spans(rank, placement, stack, args, ("1f1b" if reuse == 1 else "prt", "zb"))
    mine = torch.zeros(args.layers, 5, dtype=torch.float64)
    for k in range(args.layers):
        for column, (spans, op) in enumerate(
            ((whole, Op.F), (whole, Op.B), (split, Op.F), (split, Op.I), (split, Op.W))
        ):
            times = [e - s for a, s, e in spans if a.op is op and a.stage == k]
            mine[k, column] = statistics.median(times) if times else 0.0
    dist.all_reduce(mine)  # each layer is timed on the one rank that holds it
    grads = [_grad_bytes(layer_maker(stack, args)(k)) for k in range(args.layers)]
    # the split form's own F and I + W, W as the split step measured it ([Note: the split
    # form's own costs] in megatron_prt/sim/layer_cost.py)
    return [
        LayerCost(fwd=f, bwd=b, wgrad=w, split_fwd=sf, split_bwd=i + w, grad=g)
        for (f, b, sf, i, w), g in zip(mine.tolist(), grads, strict=True)
    ]


def _spans(rank: int, placement: Placement, stack: str, args, schedules) -> list[list]:
    """This rank's traced spans of ``args.profile_steps`` steps of each of ``schedules``,
    the steps interleaved (one of each in turn, after a warm-up step of each): the whole
    and the split form's times are compared with each other, so they must see the host
    alike (one after the other, a phase of the host moved one and not the other: the split
    form came out 25% fast in one launch and 8% slow in another)."""
    m = max(2, placement.ranks)
    xs, ys = batch(stack, args, m)
    runners = [
        RuntimeRunner(
            build_plan(placement, m, schedule),
            build_stages(placement, rank, layer_maker(stack, args), args.layers),
            mse_loss,
            xs,
            ys,
            trace=True,
            shm_capacity=shm_capacity(stack, args),
        )
        for schedule in schedules
    ]
    spans: list[list] = [[] for _ in runners]
    for step in range(args.profile_steps + 1):
        for runner, mine in zip(runners, spans, strict=True):
            runner.zero_grad()
            runner.step()
            mine += runner.runtime.trace() if step else []  # the first: a warm-up
    for runner in runners:
        runner.close()
    return spans


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


def split_reference(cost: CostModel, world: int, m: int) -> Plan:
    """The split-backward step the split form's scale is fitted to ([Note: the split form in
    place]): R = 1 uni in the zero-bubble order built for ``cost``'s split form, the plan
    the tuner and the grid run for that configuration. The order built for equal unit stages
    (W right after I on the last rank, where the plan for the traced costs defers every W to
    the end) measured 5-10% slower than that plan on the equal and head stacks (within 1%
    on the wide one) while the simulator priced the two within 0.4%
    (``benchmarks/split_orders.py``, docs/benchmarks/split_orders.md; mostly the actions
    themselves running slower in that order, not waits: its compute table): fitted to it, every
    split plan was predicted that much slow (the equal stack's picks 3-33% slow in eight
    launches)."""
    priced = cost.split_form()
    placement = Placement(world, 1)
    return plan_for(priced, placement, m, "zb", priced.stage_times(placement))


def profile_costs(rank: int, world: int, stack: str, args) -> tuple[CostModel, float, CostModel]:
    """The stack's cost model (module docstring), the compute scale fitted in place and the
    profiled model before the fit (the in-round fit starts from it: [Note: in-round fit] in
    :mod:`.in_round`), the same on every rank. The four fitted steps run at the grid's
    micro-batch count, ``args.fit_steps`` each, interleaved."""
    layers = profile_layers(rank, world, stack, args)
    wire = agreed(shm_costs(rank, (args.mb_size, width(stack, args)), args.burst))
    cost = CostModel(
        layers=tuple(layers),
        **wire_fields(wire),  # [Note: a hop's time less its CPU]
        **replica_fields(rank, world, stack, args),
    )
    xs, ys = batch(stack, args, args.microbatches)
    timed = few_and_many_messages(
        world,
        layer_maker(stack, args),
        args.layers,
        xs,
        ys,
        mse_loss,
        args.fit_steps,
        bi=True,
        split_plan=split_reference(cost, world, args.microbatches),
        warm_steps=args.warm_steps,
        shm_capacity=shm_capacity(stack, args),
    )
    shared = [(*fit_in_place(cost, timed, warn=rank == 0), cost)]  # rank 0's is kept
    dist.broadcast_object_list(shared, src=0)  # one model, bit for bit, on every rank
    return shared[0]
