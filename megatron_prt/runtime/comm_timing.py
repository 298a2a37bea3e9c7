"""Measure the messages a plan pays for, on the runtime's own transport, for the cost model.

Two figures the simulator reads (:mod:`megatron_prt.sim.cost`), in seconds and bytes:

* a stage-boundary hop, ``p2p_latency + bytes / p2p_bandwidth``: a two-stage pipeline of
  identity stages (``P=2``, one micro-batch, forward only) is stepped after a barrier and the
  last rank's step time is the hop plus the runtime's fixed work per step. The median at a
  small size (4 KiB) is the latency (the fixed work included: a real step pays it too), the
  slope to the median at the model's message size the inverse bandwidth;
* for ``bi``, the replica-gradient sum: :func:`megatron_prt.runtime.replica_timing.
  calibrate_replica_sync` on two ``bi`` runtimes whose stages hold a small and a large
  gradient, giving ``replica_latency``, ``replica_bandwidth`` and ``replica_add_bandwidth``.

:func:`measure_comm` runs both on two local gloo ranks (:func:`megatron_prt.runtime.local.
run_local`) with the given transport and returns the cost keys.
"""

from __future__ import annotations

import math
import statistics
import time

import torch
import torch.distributed as dist

from ..core.placement import Placement
from ..core.schedules import build_plan
from .executor import PipelineRuntime
from .local import all_ok, run_local
from .replica_timing import calibrate_replica_sync

SMALL_BYTES = 4096  # the small point of both lines
FLOAT = 4  # bytes of the float32 messages and gradients timed


def _hop_seconds(size: int, transport: str, repeats: int) -> float:
    """Median seconds of one forward-only step of a 2-stage identity pipeline: one hop."""
    plan = build_plan(Placement(2, 1), 1)
    rank = dist.get_rank()
    stages = {rank: torch.nn.Identity()}
    shm = max(1 << 20, 4 * size)
    runtime = PipelineRuntime(  # a loss reading one element: the step is the hop
        plan,
        stages,
        lambda out, _: out.reshape(-1)[:1].sum(),
        transport=transport,
        shm_capacity=shm,
    )
    x = [torch.ones(max(1, size // FLOAT))]
    spans = []
    for _ in range(repeats + 1):  # the first step warms the transport up
        dist.barrier()
        start = time.perf_counter()
        runtime.step(x if rank == 0 else None, x if rank == 1 else None, forward_only=True)
        spans.append(time.perf_counter() - start)
    runtime.close()
    return statistics.median(spans[1:])


def _replica_runtime(size: int, transport: str) -> PipelineRuntime:
    """A bi runtime on 2 ranks whose stages hold ``size`` gradient bytes per rank."""
    plan = build_plan(Placement(2, 1, "loop", "bi"), 2)
    rank = dist.get_rank()
    width = max(1, size // FLOAT // len(plan.placement.rank_stages[rank]))
    stages = {}
    for stage in plan.placement.rank_stages[rank]:
        module = torch.nn.Linear(width, 1, bias=False)
        module.weight.grad = torch.ones_like(module.weight)
        stages[stage] = module
    return PipelineRuntime(plan, stages, lambda out, _: out.sum(), transport=transport)


def _worker(rank: int, world: int, message_bytes: int, grad_bytes: int, transport, repeats):
    hops = [(b, _hop_seconds(b, transport, repeats)) for b in (SMALL_BYTES, message_bytes)]
    small, large = (_replica_runtime(b, transport) for b in (SMALL_BYTES, grad_bytes))
    replica = calibrate_replica_sync(small, large, repeats)
    small.close()
    large.close()
    return hops, replica


def _per_second(seconds_per_byte: float) -> float | None:
    """Bytes per second; ``None`` (free) when the slope is 0."""
    return None if seconds_per_byte <= 0 else 1.0 / seconds_per_byte


def measure_comm(
    message_bytes: int, grad_bytes: int, transport: str = "auto", repeats: int = 5
) -> dict:
    """Cost-model keys measured on two local ranks: ``p2p_latency``, ``p2p_bandwidth``,
    ``replica_latency``, ``replica_bandwidth``, ``replica_add_bandwidth`` (seconds, bytes per
    second; a bandwidth ``None`` means free). ``message_bytes``: one activation between
    stages; ``grad_bytes``: gradient bytes a rank sums with its mirrored rank."""
    if message_bytes < 1 or grad_bytes < 1 or repeats < 1:
        raise ValueError(
            f"message_bytes, grad_bytes and repeats must be >= 1, got {message_bytes}, "
            f"{grad_bytes}, {repeats}"
        )
    large = max(message_bytes, 2 * SMALL_BYTES)
    results = all_ok(
        run_local(2, _worker, large, max(grad_bytes, 2 * SMALL_BYTES), transport, repeats)
    )
    hops, replica = results[1]  # the receiving rank times the hop
    (b0, t0), (b1, t1) = hops
    # the small message's time is the latency (its bytes cost next to nothing): unlike the
    # intercept of the line, noise cannot make it 0 or negative
    slope = max((t1 - t0) / (b1 - b0), 0.0)
    latency = t0
    return {
        "p2p_latency": latency,
        "p2p_bandwidth": _per_second(slope),
        "replica_latency": replica["latency_s"],
        "replica_bandwidth": _per_second(replica["wire_s_per_byte"]),
        "replica_add_bandwidth": _per_second(replica["add_s_per_byte"]),
    }


def hop_seconds(costs: dict) -> float:
    """One hop of ``costs['message_bytes']`` under the measured keys (for summaries)."""
    bandwidth = costs.get("p2p_bandwidth") or math.inf
    return costs.get("p2p_latency", 0.0) + costs.get("message_bytes", 0) / bandwidth
