"""The layer stack on one gloo rank: the model and data, a runner per configuration,
the profiling of per-layer, per-message and replica-sum costs, and the timed
repetitions (:func:`worker`)."""

from __future__ import annotations

import inspect
import statistics
import time
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.distributed.pipelining as pipelining
from torch.nn.functional import mse_loss

from ...core import Placement, build_plan
from ...core.actions import Op
from ...core.placement import ConfigError
from ...core.plan import Plan
from ...core.zerobubble import zero_bubble
from ...runtime import PipelineRuntime, build_stages, sync_replicas
from ...runtime.cpu import keep_freed_memory
from ...runtime.memory import ActivationMeter, saved_activation_bytes
from ...runtime.peers import Peer, peer_plan
from ...runtime.replica_timing import calibrate_replica_sync
from ...runtime.wgrad import measure_split_memory, measure_split_overhead
from ...sim.cost import CostModel, LayerCost
from ..common import (
    agreed,
    measure_runners,
    replica_cost_fields,
    replica_repeats,
    say,
    shm_costs,
    time_wire,
    wire_fields,
)
from .configs import GLOO, PRT_TRANSPORT_ARG, PRT_VARIANTS, SHM, Config, all_configs, twin_key


# -- model and data ----------------------------------------------------------------------
def layer_maker(hidden: int):
    def make(i: int) -> torch.nn.Module:
        torch.manual_seed(i)  # layer i is the same on every rank and for every schedule
        return torch.nn.Sequential(torch.nn.Linear(hidden, hidden), torch.nn.GELU())

    return make


def batch(args, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole batch of ``m`` micro-batches. Both sides get views of these two tensors
    (torch's schedules split the batch into views), so the input and the target count alike
    in the activation meter (one storage each, at full size, while any micro-batch saves it)."""
    gen = torch.Generator().manual_seed(1000 + m)
    x = torch.randn(m * args.mb_size, args.hidden, generator=gen)
    y = torch.randn(m * args.mb_size, args.hidden, generator=gen)
    return x, y


# -- runners: one configuration built on this rank ------------------------------------------
class PrtRunner:
    """megatron-prt's PipelineRuntime running its 1F1B plan (R=1), a PRT plan or (split
    rows) a split-backward ``zb`` plan generated from the profiled costs, under 1F1B's
    activation peak by the profiled bytes (``act`` until I, ``wact`` from I until W); a
    split plan makes the runtime defer the linear layers' weight GEMMs to W."""

    def __init__(self, cfg: Config, rank: int, world: int, args, m: int, cost: CostModel):
        self.placement = cfg.placement_for(world)
        times = cost.stage_times(self.placement)
        if cfg.split:
            act = cost.stage_activation_bytes(self.placement)
            keep = cost.stage_wgrad_keep(self.placement)
            self.plan = zero_bubble(self.placement, m, times, act=act, keep=keep)
        else:  # R=1 is the baseline: megatron-prt's 1F1B (PipeDream-Flush), not a PRT search
            schedule = "1f1b" if self.placement.chunks_per_rank == 1 else "prt"
            self.plan = build_plan(self.placement, m, schedule, times=times)
        self.cfg = cfg
        self.modules = build_stages(self.placement, rank, layer_maker(args.hidden), args.layers)
        sync_replicas(self.placement, self.modules)
        self.runtime = PipelineRuntime(
            self.plan, self.modules, mse_loss, transport=PRT_TRANSPORT_ARG[cfg.transport]
        )
        self.replica_sum_s: list[float] = []  # bi: time spent summing replica gradients
        x, y = batch(args, m)
        self.xs, self.ys = list(x.tensor_split(m)), list(y.tensor_split(m))

    @property
    def wire(self) -> str:
        """What ``auto`` really chose (shared memory takes over after the first step)."""
        return type(self.runtime.transport).__name__

    def zero_grad(self) -> None:
        for module in self.modules.values():
            module.zero_grad(set_to_none=True)

    def step(self) -> None:
        self.runtime.step(self.xs, self.ys)
        if self.placement.direction == "bi":  # part of a bi training step: sum the replicas
            start = time.perf_counter()
            self.runtime.reduce_replica_grads()  # over the runtime's own transport
            self.replica_sum_s.append(time.perf_counter() - start)

    def peak_bytes(self) -> int:
        self.zero_grad()
        self.runtime.measure_memory = True
        try:
            self.step()
        finally:
            self.runtime.measure_memory = False
        return self.runtime.memory_peak()

    def close(self) -> None:
        self.runtime.close()


class TorchRunner:
    """A torch.distributed.pipelining schedule over PipelineStage objects holding the same
    stage modules megatron-prt builds for the same placement."""

    def __init__(self, cfg: Config, rank: int, world: int, args, m: int):
        placement = cfg.placement_for(world)
        self.cfg = cfg
        self.modules = build_stages(placement, rank, layer_maker(args.hidden), args.layers)
        self.stages = [
            pipelining.PipelineStage(module, index, placement.depth, torch.device("cpu"))
            for index, module in sorted(self.modules.items())
        ]
        schedule_cls = getattr(pipelining, cfg.schedule)
        held = self.stages[0] if len(self.stages) == 1 else self.stages
        self.schedule = schedule_cls(held, m, loss_fn=mse_loss)  # may refuse: ValueError
        self.plan = torch_plan(self.schedule, placement, m)
        self.wire = dist.get_backend()
        self.replica_sum_s: list[float] = []
        x, y = batch(args, m)
        self.inputs = (x,) if any(s.is_first for s in self.stages) else ()
        self.target = y if any(s.is_last for s in self.stages) else None

    def zero_grad(self) -> None:
        for module in self.modules.values():
            module.zero_grad(set_to_none=True)

    def step(self) -> None:
        self.schedule.step(*self.inputs, target=self.target, return_outputs=False)

    def peak_bytes(self) -> int:
        self.zero_grad()
        params = [p for module in self.modules.values() for p in module.parameters()]
        meter = ActivationMeter(params)
        owner: list = [None]  # the (stage, mb) whose forward ran last: the loss belongs to it
        for stage in self.stages:
            meter_stage(stage, meter, owner)
        try:
            with meter.saving_for(lambda: owner[0]):
                self.step()
        finally:
            for stage in self.stages:
                unmeter_stage(stage)
        return meter.peak_bytes

    def close(self) -> None:
        pass


_METERED = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")


def meter_stage(stage, meter: ActivationMeter, owner: list) -> None:
    """Count what one PipelineStage holds for backward as megatron-prt's executor counts its
    own: autograd's saved tensors of (stage, mb) plus the stage input and output it keeps
    (``fwd_cache``), released when the backward (or, split, the weight backward) has run."""
    forward, backward, weight = (getattr(stage, name) for name in _METERED)
    full_flag = inspect.signature(backward).parameters["full_backward"].default

    def metered_forward(mb, *args, **kwargs):
        owner[0] = (stage.stage_index, mb)
        out = forward(mb, *args, **kwargs)
        outputs, inputs = stage.fwd_cache[mb]
        for tensor in (*outputs, *inputs):
            if isinstance(tensor, torch.Tensor):
                meter.hold(owner[0], tensor)
        return out

    def metered_backward(mb, *args, **kwargs):
        backward(mb, *args, **kwargs)
        if kwargs.get("full_backward", full_flag):
            meter.release((stage.stage_index, mb))

    def metered_weight(mb, *args, **kwargs):
        weight(mb, *args, **kwargs)
        meter.release((stage.stage_index, mb))

    for name, fn in zip(_METERED, (metered_forward, metered_backward, metered_weight), strict=True):
        setattr(stage, name, fn)  # an instance attribute shadows the method


def unmeter_stage(stage) -> None:
    for name in _METERED:
        stage.__dict__.pop(name, None)


def torch_plan(schedule, placement: Placement, m: int) -> Plan:
    """The compute order a torch schedule runs, as a megatron-prt plan for the simulator
    (:func:`megatron_prt.runtime.peers.peer_plan`: split backwards as I and W, DualPipeV's
    overlapped F+B as its parts, Schedule1F1B as its executed loop)."""
    name = type(schedule).__name__
    return peer_plan(Peer(name, name, placement.placement, placement.reuse), placement.ranks, m)


def build_runner(cfg: Config, rank: int, world: int, args, m: int, cost: CostModel):
    """The runner, or the reason this configuration cannot run (same on every rank)."""
    try:
        if cfg.family == "torch":
            return TorchRunner(cfg, rank, world, args, m)
        return PrtRunner(cfg, rank, world, args, m, cost)
    except (ValueError, ConfigError) as exc:
        return f"n/a: {str(exc).split(chr(10))[0].strip()}"


# -- profiling -----------------------------------------------------------------------------
def profile_layer(rank: int, world: int, args) -> LayerCost:
    """Per-layer forward/backward seconds from a traced 1F1B step on shared memory (as
    runtime_speed.py does; median over actions, then mean over ranks), and the layer's
    gradient bytes (float32 weight and bias)."""
    m = max(2, world)
    placement = Placement(world)
    stages = build_stages(placement, rank, layer_maker(args.hidden), args.layers)
    runtime = PipelineRuntime(build_plan(placement, m, "1f1b"), stages, mse_loss, trace=True)
    x, y = batch(args, m)
    for _ in range(args.profile_steps):
        runtime.step(list(x.tensor_split(m)), list(y.tensor_split(m)))
    runtime.close()
    spans = runtime.trace()
    medians = [statistics.median(e - s for a, s, e in spans if a.op is op) for op in (Op.F, Op.B)]
    times = torch.tensor(medians) * world / args.layers
    dist.all_reduce(times)
    fwd, bwd = (times / world).tolist()
    return LayerCost(fwd=fwd, bwd=bwd, grad=float((args.hidden + 1) * args.hidden * 4))


SPLIT_REPEATS = 30  # alternating B / I+W repetitions of the split profile


def profile_split(rank: int, world: int, args, layer: LayerCost) -> dict:
    """Split backward on this rank's 1F1B stage, one micro-batch: the full backward ``B``,
    the input gradient ``I`` and the weight gradient ``W`` timed alternately as this
    thread's CPU time (medians of :data:`SPLIT_REPEATS`,
    :func:`~megatron_prt.runtime.wgrad.measure_split_overhead`; other processes' load does
    not count, a wall-clock trace under load did), mean over ranks; the bytes the stage
    holds until I and from I until W
    (:func:`~megatron_prt.runtime.wgrad.measure_split_memory`) and those the loss saves.
    Returns ``layer`` (with per-layer ``act``/``wact``), ``split_layer`` (its backward
    ``bwd`` split in the measured proportions: I + W = ``bwd`` x (I + W) / B, W as
    ``wgrad``), ``head`` (the loss) and ``split_cpu_s`` (B, I, W of the stage)."""
    count = args.layers // world
    make = layer_maker(args.hidden)
    stage = torch.nn.Sequential(*(make(rank * count + i) for i in range(count)))
    x, y = batch(args, 1)
    stats = measure_split_overhead(stage, x, repeats=SPLIT_REPEATS)
    cpu = torch.tensor([stats["B_median"], stats["I_median"], stats["W_median"]])
    dist.all_reduce(cpu)
    full, input_grad, weight_grad = (cpu / world).tolist()
    held = measure_split_memory(stage, x)
    out = torch.zeros_like(y, requires_grad=True)
    _, loss_bytes = saved_activation_bytes(lambda: mse_loss(out, y))
    layer = replace(layer, act=held["act"] / count, wact=held["wact"] / count)
    split = replace(
        layer,
        bwd=layer.bwd * (input_grad + weight_grad) / full,
        wgrad=layer.bwd * weight_grad / full,
    )
    return {
        "layer": layer,
        "split_layer": split,
        "head": LayerCost(fwd=0.0, bwd=0.0, act=loss_bytes, wact=0.0),
        "split_cpu_s": (full, input_grad, weight_grad),
    }


def message_costs(rank: int, world: int, args) -> dict[str, tuple[float, float]]:
    """(one_way_s, cpu_s) of one activation-sized message per wire between ranks 0 and 1:
    one-way time of a ping-pong, and the process CPU time per message in a burst (the cost
    model's fields: :func:`..common.wire_fields`)."""
    shape = (args.mb_size, args.hidden)
    costs = {GLOO: _gloo_costs(rank, args), SHM: shm_costs(rank, shape, args.burst)}
    # identical on every rank: plans are built from them
    return {wire: agreed(pair) for wire, pair in costs.items()}


def _gloo_costs(rank: int, args) -> tuple[float, float]:
    tensor = torch.randn(args.mb_size, args.hidden)
    peer = 1 - rank

    def burst():
        recvs = [dist.irecv(torch.empty_like(tensor), peer) for _ in range(args.burst)]
        for work in recvs + [dist.isend(tensor, peer) for _ in range(args.burst)]:
            work.wait()

    def ping_pong():
        first, second = (dist.send, dist.recv) if rank == 0 else (dist.recv, dist.send)
        first(tensor, peer)
        second(tensor, peer)

    return time_wire(rank, burst, ping_pong, 2 * args.burst)


def replica_calibration(rank: int, world: int, args) -> dict[str, dict]:
    """Per wire: the bi replica-gradient sum timed on megatron-prt's runtime for the bi
    variant's placement, on this model and on one of width ``hidden // 8`` (about 64 times
    fewer gradient bytes), and fitted
    (:func:`megatron_prt.runtime.replica_timing.calibrate_replica_sync`). Collective."""
    _, reuse, place, direction = next(v for v in PRT_VARIANTS if v[3] == "bi")
    placement = Placement(world, reuse, place, direction)
    plan = build_plan(placement, 2)
    out = {}
    for wire, transport in PRT_TRANSPORT_ARG.items():
        runtimes = [
            PipelineRuntime(
                plan,
                build_stages(placement, rank, layer_maker(hidden), args.layers),
                mse_loss,
                transport=transport,
            )
            for hidden in (max(4, args.hidden // 8), args.hidden)
        ]
        out[wire] = calibrate_replica_sync(*runtimes, repeats=replica_repeats(args))
        for runtime in runtimes:
            runtime.close()
    return out


def cost_model(
    args,
    layer: LayerCost,
    wire: tuple[float, float],
    replica: dict | None = None,
    head: LayerCost | None = None,
) -> CostModel:
    """The profiled layer and message costs of one wire, with its replica-sum fit and the
    loss's activation bytes (``head``)."""
    fields = replica_cost_fields(replica) if replica else {}
    return CostModel(layers=(layer,) * args.layers, head=head, **wire_fields(wire), **fields)


def cost_models(args, profile: dict, wires: dict, replica: dict) -> dict[str, CostModel]:
    """Per :attr:`Config.cost_key`: each wire's cost model, with the full backward's layer
    cost and (``<wire>/split``) with the split one's (``profile``: :func:`profile_split`)."""
    costs = {}
    for wire, pair in wires.items():
        for key, layer in ((wire, profile["layer"]), (f"{wire}/split", profile["split_layer"])):
            costs[key] = cost_model(args, layer, pair, replica[wire], profile["head"])
    return costs


# -- measuring -----------------------------------------------------------------------------
def grad_gaps(runners: dict) -> dict[str, float]:
    """Same model, same data, same split: each torch row's gradients (from its last step)
    against its megatron-prt twin's, as max |difference| / max |gradient| over all ranks."""
    gaps = {}
    for key, runner in runners.items():
        twin = runners.get(twin_key(runner.cfg)) if runner.cfg.family == "torch" else None
        if twin is None:
            continue
        ours, theirs = grad_vector(twin), grad_vector(runner)
        gap = torch.tensor([(ours - theirs).abs().max() / ours.abs().max()])
        dist.all_reduce(gap, op=dist.ReduceOp.MAX)
        gaps[key] = float(gap)
    return gaps


def grad_vector(runner) -> torch.Tensor:
    return torch.cat(
        [p.grad.reshape(-1) for _, mod in sorted(runner.modules.items()) for p in mod.parameters()]
    )


def measure_m(rank: int, world: int, args, m: int, costs: dict[str, CostModel]) -> dict:
    """Every configuration at ``m`` micro-batches (:func:`common.measure_runners`), with the
    torch rows' gradient gaps."""
    built = {
        cfg.key: build_runner(cfg, rank, world, args, m, costs[cfg.cost_key])
        for cfg in all_configs()
    }
    return measure_runners(
        built,
        args,
        f"layer stack, m={m}:",
        lambda runners, _times: {"grad_gap": grad_gaps(runners)},
    )


def worker(rank: int, world: int, args) -> dict:
    """One rank: profile, then measure every configuration at every m."""
    if args.keep_freed_memory:
        keep_freed_memory()  # both sides: no page faults from reallocating activations
    say("layer stack: profiling layer, split-backward and message costs")
    profile = profile_split(rank, world, args, profile_layer(rank, world, args))
    wires = message_costs(rank, world, args)
    say("layer stack: timing the bi replica-gradient sum")
    replica = replica_calibration(rank, world, args)
    costs = cost_models(args, profile, wires, replica)
    by_m = {}
    for m in args.microbatches:
        say(f"layer stack, m={m}: building {len(all_configs())} configurations, warm-up")
        by_m[m] = measure_m(rank, world, args, m, costs)
    return {**profile, "wires": wires, "replica": replica, "by_m": by_m}
