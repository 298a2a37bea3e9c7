"""Measure the messages a plan pays for, on the runtime's own transport, for the cost model.

Two figures the simulator reads (:mod:`megatron_prt.sim.cost`), in seconds and bytes:

* a stage-boundary hop, ``p2p_latency + bytes / p2p_bandwidth``: one micro-batch is stepped
  forward through chains of identity stages on 2 ranks, of 1 hop and of 15, and a hop is the
  slope of the median step time over the hops (:func:`_hops_seconds`: the step's fixed work
  is no message's), at a small size (4 KiB) and at the model's message size; the line
  through the two prices both as timed. With ``p2p_cpu`` fitted (below), both ends' CPU is
  taken out of both hops first (:func:`comm_keys`);
* for ``bi``, the replica-gradient sum: :func:`megatron_prt.runtime.replica_timing.
  calibrate_replica_sync` on two ``bi`` runtimes whose stages hold a small and a large
  gradient, giving ``replica_latency``, ``replica_bandwidth`` and ``replica_add_bandwidth``;
* optionally ``p2p_cpu``, the rank time a message costs while the ranks compute, fitted in
  place ([Note: per-message CPU in place] in :mod:`megatron_prt.tune.measured`): a stand-in
  stack (:func:`stand_in_layer`) is traced with every layer its own stage (per-layer F/B
  costs), then a 1F1B step (few messages) and a step with every layer its own stage (many)
  are timed, interleaved, and the CPU per message under which the simulator reproduces both,
  with the per-layer times scaled to the few-message step, is it
  (:func:`~megatron_prt.tune.measured.fit_in_place`; the bench's layer stacks call it with
  their own layers and keep the scale too).

:func:`measure_comm` runs these on two local gloo ranks (:func:`megatron_prt.runtime.local.
run_local`) with the given transport and returns the cost keys.
"""

from __future__ import annotations

import math
import statistics
import time
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.nn.functional import mse_loss

from ..core.actions import Op
from ..core.placement import ConfigError, Placement
from ..core.plan import Plan
from ..core.schedules import build_plan
from ..sim.cost import CostModel, LayerCost
from ..tune.measured import (
    fit_in_place,
    hop_in_flight,
    interleaved_rounds,
    message_cpu_in_place,
)
from .executor import PipelineRuntime
from .local import all_ok, run_local
from .measured_pick import RuntimeRunner, slowest_step_seconds
from .p2p import SHM_DIR
from .replica_timing import calibrate_replica_sync
from .stages import build_stages

SMALL_BYTES = 4096  # the small point of both lines
FLOAT = 4  # bytes of the float32 messages and gradients timed
STAND_IN_LAYERS = 8  # P = 2: R = 4 when every layer is its own stage
STAND_IN_WIDTH = 256  # features of the stand-in's messages (rows make up the bytes)
STAND_IN_MAX_BYTES = 4 << 20  # larger messages are fitted at this size (compute grows too)


def _device() -> torch.device:
    """This rank's device: its GPU under NCCL (:func:`~.local.run_local`), else the host."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


CHAIN_REUSE = 8  # the long chain: Placement(2, 8), 16 identity stages, 15 hops
WARM_STEPS = 3  # untimed steps of each chain before any is timed (the first ones run cold)


def _chain(size: int, transport: str, reuse: int) -> tuple[PipelineRuntime, list, int]:
    """A forward-only runtime of one micro-batch through ``2 * reuse`` identity stages on 2
    ranks (loop: every boundary a hop), its input, and its hop count ``2 * reuse - 1``."""
    placement = Placement(2, reuse)
    rank, device = dist.get_rank(), _device()
    stages = {stage: torch.nn.Identity() for stage in placement.rank_stages[rank]}
    runtime = PipelineRuntime(  # a loss reading one element: the step is the hops
        build_plan(placement, 1),
        stages,
        lambda out, _: out.reshape(-1)[:1].sum(),
        device=device,
        transport=transport,
        shm_capacity=max(1 << 20, 4 * size),
    )
    return runtime, [torch.ones(max(1, size // FLOAT), device=device)], 2 * reuse - 1


def _hops_seconds(sizes: tuple[int, ...], transport: str, repeats: int) -> list[float]:
    """Seconds of one more hop at each of ``sizes``: the median step time of a chain of 15
    hops less one of 1, over the 14 hops between (:func:`marginal_hop`). Every chain is
    stepped :data:`WARM_STEPS` times untimed, then all are timed in shuffled rounds.

    [Note: a hop is what one more message costs] A step pays fixed work once (its set-up,
    the loss, the barrier's skew: 0.1-0.25 ms on shared memory here), a message 11-43 us:
    one step's time as the hop charged that fixed work to every message a plan sends (a
    step of 24 more messages simulated 2.3 ms slower where it ran 0.1 ms slower). And a
    size timed first, right after its warm-up step, ran 2-35 times slower than when timed
    again on shared memory, which wrote a hop latency of 2-3 ms in 3 of 5 profiles."""
    chains = _chains(sizes, transport)
    rank, device = dist.get_rank(), _device()
    spans: list[list[float]] = [[] for _ in chains]

    def step(k: int) -> float:
        runtime, x, _ = chains[k]
        dist.barrier()
        start = time.perf_counter()
        runtime.step(x if rank == 0 else None, x if rank == 1 else None, forward_only=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the hops have landed, not just been queued
        return time.perf_counter() - start

    def warm() -> None:  # after sizing, auto may have put some chains on shm, some on torch
        for k in range(len(chains)):
            for _ in range(WARM_STEPS):
                step(k)

    warm()
    if len({type(runtime.transport) for runtime, _, _ in chains}) > 1:
        for runtime, _, _ in chains:
            runtime.close()
        warnings.warn(
            f"{SHM_DIR} had room for the rings of some hop-timing chains only: every hop is "
            "timed over the torch transport (give /dev/shm more room for shared memory's)",
            stacklevel=2,
        )
        chains = _chains(sizes, "torch")
        warm()
    for order in interleaved_rounds(len(chains), repeats):
        for k in order:
            spans[k].append(step(k))
    for runtime, _, _ in chains:
        runtime.close()
    medians = [
        (chain[2], statistics.median(times)) for chain, times in zip(chains, spans, strict=True)
    ]
    return [marginal_hop(*medians[i : i + 2]) for i in range(0, len(medians), 2)]


def _chains(sizes: tuple[int, ...], transport: str) -> list[tuple]:
    """The short and the long chain (:func:`_chain`) of every size, in that order."""
    return [_chain(size, transport, reuse) for size in sizes for reuse in (1, CHAIN_REUSE)]


def marginal_hop(short: tuple[int, float], long: tuple[int, float]) -> float:
    """Seconds per hop between two chains of ``(hops, step seconds)``: the slope, not the
    step time ([Note: a hop is what one more message costs]); never below 0."""
    (hops_short, short_s), (hops_long, long_s) = short, long
    return max((long_s - short_s) / (hops_long - hops_short), 0.0)


def _replica_runtime(size: int, transport: str) -> PipelineRuntime:
    """A bi runtime on 2 ranks whose stages hold ``size`` gradient bytes per rank."""
    plan = build_plan(Placement(2, 1, "loop", "bi"), 2)
    rank, device = dist.get_rank(), _device()
    width = max(1, size // FLOAT // len(plan.placement.rank_stages[rank]))
    stages = {}
    for stage in plan.placement.rank_stages[rank]:
        module = torch.nn.Linear(width, 1, bias=False, device=device)
        module.weight.grad = torch.ones_like(module.weight)
        stages[stage] = module
    return PipelineRuntime(
        plan, stages, lambda out, _: out.sum(), device=device, transport=transport
    )


def _worker(rank, world, message_bytes, grad_bytes, transport, repeats, message_cpu):
    sizes = (SMALL_BYTES, message_bytes)
    hops = list(zip(sizes, _hops_seconds(sizes, transport, repeats), strict=True))
    small, large = (_replica_runtime(b, transport) for b in (SMALL_BYTES, grad_bytes))
    replica = calibrate_replica_sync(small, large, repeats)
    small.close()
    large.close()
    stand_in = _stand_in(world, message_bytes, transport, repeats) if message_cpu else None
    return hops, replica, stand_in


# -- per-message CPU in place ([Note: per-message CPU in place] in tune/measured.py) ---------
def step_spans(
    plan: Plan, stages: dict, loss_fn, xs, ys, steps: int, trace: bool = True, **runtime_kwargs
) -> tuple[list, float]:
    """One warm-up step, then ``steps`` timed steps of ``plan``
    (:func:`~megatron_prt.runtime.measured_pick.slowest_step_seconds`): this rank's traced
    spans of them (none unless ``trace``) and the median of the slowest rank's step seconds
    (collective; the same on every rank)."""
    runner = RuntimeRunner(plan, stages, loss_fn, xs, ys, trace=trace, **runtime_kwargs)
    runner.step()  # warm-up: shapes exchanged, allocator primed (not timed)
    spans, seconds = [], []
    for _ in range(steps):
        seconds.append(slowest_step_seconds(runner))
        spans += runner.runtime.trace() if trace else []
    runner.close()
    return spans, statistics.median(seconds)


def layer_costs_in_place(
    world: int, make_layer: Callable, num_layers: int, xs, ys, loss_fn, steps: int, **kwargs
) -> list[LayerCost]:
    """Per layer, F and whole-B medians (seconds) of ``steps`` traced steps with every layer
    its own stage (R = layers // ``world``, loop); the same on every rank (collective).
    ``xs``/``ys``: the micro-batches (as ``PipelineRuntime.step`` takes them); ``kwargs`` go
    to the runtime."""
    placement = Placement(world, num_layers // world)
    plan = build_plan(placement, len(xs), "1f1b" if placement.reuse == 1 else "prt")
    stages = build_stages(placement, dist.get_rank(), make_layer, num_layers)
    spans, _ = step_spans(plan, stages, loss_fn, xs, ys, steps, **kwargs)
    mine = torch.zeros(num_layers, 2, dtype=torch.float64)
    for k in range(num_layers):
        for column, op in enumerate((Op.F, Op.B)):
            times = [e - s for a, s, e in spans if a.op is op and a.stage == k]
            mine[k, column] = statistics.median(times) if times else 0.0
    dist.all_reduce(mine)  # each layer is timed on the one rank that holds it
    return [LayerCost(fwd=f, bwd=b) for f, b in mine.tolist()]


def few_and_many_messages(
    world: int,
    make_layer: Callable,
    num_layers: int,
    xs,
    ys,
    loss_fn,
    steps: int,
    bi: bool = False,
    warm_steps: int = 0,
    split_plan: Plan | None = None,
    **kwargs,
) -> list[tuple[Plan, float]]:
    """``(plan, median step seconds of the slowest rank)`` of untraced steps of 1F1B (R = 1:
    few messages), of every layer its own stage (many), with ``bi`` of R = 1 loop/bi (its
    replica sum included) and with ``split_plan`` of that split-backward plan (R = 1 uni:
    the order the tuner would run, built for the stack's costs), on the actual transport
    (``kwargs`` go to the runtime),
    ``steps`` each after one warm-up step each, interleaved in shuffled rounds
    (:func:`~megatron_prt.tune.measured.interleaved_rounds`: a machine that slows down
    mid-way slows all alike), each timed step after ``warm_steps`` untimed ones of the same
    plan ([Note: warm timed steps] in :mod:`megatron_prt.runtime.measured_pick`); what
    :func:`~megatron_prt.tune.measured.fit_in_place` fits from. Collective."""
    if num_layers % world or num_layers // world < 2:
        raise ValueError(
            f"fitting the per-message CPU needs a multiple of the {world} ranks, at least "
            f"{2 * world} layers (every layer its own stage against R = 1), got {num_layers}"
        )
    layouts = [(Placement(world, 1), "1f1b"), (Placement(world, num_layers // world), "prt")]
    layouts += [(Placement(world, 1, "loop", "bi"), "prt")] * bi
    plans = [build_plan(placement, len(xs), schedule) for placement, schedule in layouts]
    if split_plan is not None:
        shape = (split_plan.placement.ranks, split_plan.num_microbatches)
        if shape != (world, len(xs)) or not split_plan.split_backward:
            raise ValueError(
                f"split_plan must be a split-backward plan of the {world} ranks and "
                f"{len(xs)} micro-batches timed, got {shape} (split "
                f"{split_plan.split_backward})"
            )
        plans.append(split_plan)
    runners = []
    for plan in plans:
        stages = build_stages(plan.placement, dist.get_rank(), make_layer, num_layers)
        runners.append(RuntimeRunner(plan, stages, loss_fn, xs, ys, **kwargs))
    for runner in runners:
        runner.step()  # warm-up: shapes exchanged, allocator primed (not timed)
    seconds: list[list[float]] = [[] for _ in runners]
    for order in interleaved_rounds(len(runners), steps):
        for i in order:
            seconds[i].append(slowest_step_seconds(runners[i], warm_steps=warm_steps))
    for runner in runners:
        runner.close()
    return [(r.runtime.plan, statistics.median(s)) for r, s in zip(runners, seconds, strict=True)]


def stand_in_layer(width: int) -> Callable[[int], torch.nn.Module]:
    """``make(i)``: the stand-in stack's layer ``i``, Linear(width, width) + GELU, seeded."""

    def make(i: int) -> torch.nn.Module:
        torch.manual_seed(i)
        return torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU())

    return make


def _stand_in(world: int, message_bytes: int, transport: str, repeats: int):
    """The stand-in's per-layer costs, message bytes and few/many-message step times."""
    rows = max(1, min(message_bytes, STAND_IN_MAX_BYTES) // (FLOAT * STAND_IN_WIDTH))
    gen = torch.Generator().manual_seed(2000)
    m = max(2, world)
    xs = [torch.randn(rows, STAND_IN_WIDTH, generator=gen) for _ in range(m)]
    ys = [torch.randn(rows, STAND_IN_WIDTH, generator=gen) for _ in range(m)]
    stack = (world, stand_in_layer(STAND_IN_WIDTH), STAND_IN_LAYERS, xs, ys, mse_loss, repeats)
    kwargs = {"transport": transport, "shm_capacity": max(1 << 20, 8 * FLOAT * xs[0].numel())}
    layers = layer_costs_in_place(*stack, **kwargs)
    return layers, FLOAT * xs[0].numel(), few_and_many_messages(*stack, **kwargs)


def _per_second(seconds_per_byte: float) -> float | None:
    """Bytes per second; ``None`` (free) when the slope is 0."""
    return None if seconds_per_byte <= 0 else 1.0 / seconds_per_byte


def measure_comm(
    message_bytes: int,
    grad_bytes: int,
    transport: str = "auto",
    repeats: int = 5,
    message_cpu: bool = False,
) -> dict:
    """Cost-model keys measured on two local ranks: ``p2p_latency``, ``p2p_bandwidth``,
    ``replica_latency``, ``replica_bandwidth``, ``replica_add_bandwidth`` (seconds, bytes per
    second; a bandwidth ``None`` means free), and with ``message_cpu`` ``p2p_cpu`` fitted in
    place on a stand-in stack (module docstring). ``message_bytes``: one activation between
    stages; ``grad_bytes``: gradient bytes a rank sums with its mirrored rank. ``transport``:
    the runtime's (``auto``, ``shm``, ``torch``: two gloo ranks on the host) or ``nccl``
    (GPUs 0 and 1 over NCCL, the runtime's ``torch`` transport on them; no ``message_cpu``:
    its stand-in times host ranks)."""
    if message_bytes < 1 or grad_bytes < 1 or repeats < 1:
        raise ValueError(
            f"message_bytes, grad_bytes and repeats must be >= 1, got {message_bytes}, "
            f"{grad_bytes}, {repeats}"
        )
    backend = comm_backend(transport, message_cpu)
    large = max(message_bytes, 2 * SMALL_BYTES)
    grads = max(grad_bytes, 2 * SMALL_BYTES)
    wire = "torch" if backend == "nccl" else transport
    job = (_worker, large, grads, wire, repeats, message_cpu)
    results = all_ok(run_local(2, *job, backend=backend))
    hops, replica, stand_in = results[1]  # the receiving rank times the hop
    return comm_keys(hops, replica, stand_in)


def comm_backend(transport: str, message_cpu: bool) -> str:
    """The process group's backend for ``transport``; a clear error where it cannot run."""
    if transport != "nccl":
        return "gloo"
    if message_cpu:
        raise ValueError(
            "the message CPU is fitted in place on host ranks only: over nccl measure "
            "without it (megatron-prt profile --message-cpu none)"
        )
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        raise ValueError(
            f"--comm nccl times a hop between GPUs 0 and 1: this machine shows {count} "
            "CUDA device(s); use --comm auto on the host, or give the p2p_* and replica_* "
            "keys from a machine with two GPUs"
        )
    return "nccl"


HOP_ROUNDS = 40  # at most, of the message CPU's search (each a fit: some 40 ms)


def comm_keys(hops: list, replica: dict, stand_in: tuple | None) -> dict:
    """The cost keys of :func:`measure_comm` from its measurements: ``hops`` the small and
    the large ``(bytes, seconds)`` hop, ``replica`` the replica-sum calibration, ``stand_in``
    ``(layers, message bytes, timed steps)`` or ``None``.

    Without ``stand_in`` the hop line is the two hops as timed. With it, ``p2p_cpu`` is fitted
    in place and the hop line is what is left of each hop once both ends' CPU is out
    ([Note: a hop's time less its CPU] in :mod:`megatron_prt.tune.measured`):
    :func:`_cpu_out_of_hops`."""
    _warn_noisy_hops(hops)
    keys = {
        "replica_latency": replica["latency_s"],
        "replica_bandwidth": _per_second(replica["wire_s_per_byte"]),
        "replica_add_bandwidth": _per_second(replica["add_s_per_byte"]),
    }
    if stand_in is None:
        return {**_hop_line(hops, 0.0), **keys}
    cpu = _cpu_out_of_hops(hops, stand_in)
    return {**_hop_line(hops, cpu), "p2p_cpu": cpu, **keys}


def _cpu_out_of_hops(hops: list, stand_in: tuple) -> float:
    """The message CPU ``c`` that the stand-in's fit returns when the hop line is the hops
    less ``2 * c``: the fit reads the line, the line the CPU. ``fit(c) - c`` falls as ``c``
    grows (less in flight, more CPU to fit the many-message step, by less than ``c`` grows),
    so its root is found by regula falsi (Illinois) on ``[0, the longer hop / 2]``; past
    that nothing is in flight and the fit no longer moves. Within a millionth of ``c``, or
    the closest of :data:`HOP_ROUNDS` rounds."""
    layers, message_bytes, timed = stand_in

    def gap(cpu: float) -> float:  # fit(c) - c
        line = _hop_line(hops, cpu)
        bandwidth = line["p2p_bandwidth"] or math.inf
        cost = CostModel(
            layers=tuple(layers),
            p2p_latency=line["p2p_latency"],
            p2p_bandwidth=bandwidth,
            message_bytes=message_bytes,
        )
        return _stand_in_cpu(cost, timed) - cpu

    low, high = 0.0, max(seconds for _, seconds in hops) / 2
    g_low, g_high = gap(low), gap(high)
    if g_high >= 0:  # the fit wants more CPU than the hops hold: none of them in flight
        return high + g_high
    if g_low <= 0:
        return low
    best = (math.inf, low)
    for _ in range(HOP_ROUNDS):
        cpu = low + (high - low) * g_low / (g_low - g_high)
        g_cpu = gap(cpu)
        best = min(best, (abs(g_cpu), cpu))
        if abs(g_cpu) <= 1e-6 * cpu:
            break
        if g_cpu > 0:
            low, g_low, g_high = cpu, g_cpu, g_high / 2  # Illinois: the far end weighs less
        else:
            high, g_high, g_low = cpu, g_cpu, g_low / 2
    return best[1]


NOISY_SIZE_RATIO = 64  # a hop this many times larger that times faster is noise


def _warn_noisy_hops(hops: list) -> None:
    """Say what timing noise wrote as free: the small hop timed as free (``p2p_latency``
    0), or the large hop timed faster than the small one although it carries
    :data:`NOISY_SIZE_RATIO` times the bytes or more (the line's slope clipped to 0, the
    bandwidth ``null``). Closer sizes (messages under 256 KiB) may time either way and are
    not said."""
    (b0, t0), (b1, t1) = hops
    if t0 <= 0:  # marginal_hop clipped it: the longer chain timed no slower
        warnings.warn(
            f"a hop of {b0} bytes timed as free (its longer chain of hops no slower than "
            "the shorter one): p2p_latency is written as 0 on timing noise; profile again "
            "with more --reps, on a quieter machine",
            stacklevel=3,
        )
    if b1 >= NOISY_SIZE_RATIO * b0 and t1 < t0:
        warnings.warn(
            f"a hop of {b1} bytes timed faster than one of {b0} bytes ({t1 * 1e6:.1f} vs "
            f"{t0 * 1e6:.1f} us, medians): p2p_bandwidth is written as free (null) on timing "
            "noise; profile again with more --reps, on a quieter machine",
            stacklevel=3,
        )


def _hop_line(hops: list, cpu: float) -> dict:
    """``p2p_latency`` and ``p2p_bandwidth`` of the line through the two hops, each less
    ``2 * cpu`` (never below 0), so that it prices the large hop (the model's message) as
    timed: the latency is the line's value at 0 bytes, or the small hop's time where the
    large one timed no slower (noise: the bandwidth is then free)."""
    (b0, t0), (b1, t1) = hops
    small, large = hop_in_flight(t0, cpu), hop_in_flight(t1, cpu)
    slope = max((large - small) / (b1 - b0), 0.0)
    return {"p2p_latency": max(small - b0 * slope, 0.0), "p2p_bandwidth": _per_second(slope)}


def _stand_in_cpu(cost: CostModel, timed: list) -> float:
    """``p2p_cpu`` of the stand-in: the joint fit of compute scale and message CPU
    (:func:`~megatron_prt.tune.measured.fit_in_place`); when no compute scale reproduces
    the 1F1B step (a model message of a few KiB makes the stand-in's steps all message and
    step overhead, so even free compute simulates slower than measured), the message CPU
    alone fitted to the two steps' gap at the traced compute, as
    :func:`~megatron_prt.tune.measured.message_cpu_in_place` fits it. Silent at 0 (a wire
    may cost no CPU, and the regula falsi above tries CPUs that leave none)."""
    try:
        return fit_in_place(cost, timed, warn=False)[0].p2p_cpu
    except ConfigError:
        return message_cpu_in_place(cost, timed, warn=False)


def hop_seconds(costs: dict) -> float:
    """One hop of ``costs['message_bytes']`` under the measured keys (for summaries)."""
    bandwidth = costs.get("p2p_bandwidth") or math.inf
    return costs.get("p2p_latency", 0.0) + costs.get("message_bytes", 0) / bandwidth
