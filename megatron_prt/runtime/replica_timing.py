"""Measure the bi replica-gradient sum on the runtime's own transport, to calibrate the
simulator's ``replica_*`` costs (:mod:`megatron_prt.sim.cost`).

The sum is timed the way the simulator models it: all ranks start together (a barrier
stands in for "both ranks of a pair have finished their step"), so the figure is the
exchange and the add, not the wait for a late peer. With times profiled in seconds, a
measured ``t`` for this model is ``CostModel(replica_latency=t)`` (bandwidths left free);
timing two model sizes separates latency from ``replica_bandwidth``
(:func:`calibrate_replica_sync`, see [Note: replica-sum calibration]).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from .executor import PipelineRuntime


def time_replica_sync(runtime: PipelineRuntime, repeats: int = 5, grad_attr: str = "grad") -> float:
    """Median seconds this rank spends in ``runtime.reduce_replica_grads(grad_attr)`` over
    ``repeats`` runs, each started after a barrier of the pipeline group. Collective: every
    rank of the group must call it. The gradients are left as they were (each run sums
    them; they are restored after it). ``0.0`` without a call for ``uni`` plans."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if runtime.plan.placement.direction != "bi":
        return 0.0
    params = [p for stage in runtime.stages.values() for p in stage.parameters()]
    saved = [_clone(getattr(p, grad_attr, None)) for p in params]
    summed, spans = runtime.summed_replicas, []
    for _ in range(repeats):
        runtime.gradients_restored()  # a sum before this call (a step's) must not skip it
        dist.barrier(group=runtime.group)
        start = time.perf_counter()
        runtime.reduce_replica_grads(grad_attr)
        if runtime.device.type == "cuda":
            torch.cuda.synchronize(runtime.device)
        spans.append(time.perf_counter() - start)
        for param, grad in zip(params, saved, strict=True):
            setattr(param, grad_attr, _clone(grad))
    runtime.gradients_restored(summed)  # as before the call
    return statistics.median(spans)


def _clone(grad: torch.Tensor | None) -> torch.Tensor | None:
    return None if grad is None else grad.detach().clone()


# [Note: replica-sum calibration] The simulator charges a rank with a remote replica
# ``replica_latency + sent / replica_bandwidth + added / replica_add_bandwidth``
# (megatron_prt.sim.cost), and for such a rank sent = added = the gradient bytes of all its
# stages. We time the runtime's own sum (time_replica_sync: barrier, then
# ``reduce_replica_grads``, median) on two bi runtimes of the measured placement and wire,
# the benchmarked model and one with far smaller gradients: the line through the two points
# gives the latency (intercept) and seconds per byte (slope). A plain ``a + b`` of the large
# size, timed on this rank, is the add's share of the slope; the rest is the transfer.


def replica_bytes(runtime) -> int:
    """Gradient bytes this rank sends its mirrored rank in ``runtime.reduce_replica_grads``
    (stages whose replica is on another rank; ``requires_grad`` parameters)."""
    total = 0
    for pair in runtime.plan.placement.replica_pairs():
        here = [stage for stage in pair if stage in runtime.stages]
        if len(here) == 1:  # the replica is on the mirrored rank
            params = [p for p in runtime.stages[here[0]].parameters() if p.requires_grad]
            total += sum(p.numel() * p.element_size() for p in params)
    return total


def add_seconds_per_byte(nbytes: int, repeats: int) -> float:
    """Median seconds per byte of ``a + b`` on float32 vectors of ``nbytes`` each."""
    a = torch.ones(max(1, nbytes // 4))
    b = torch.ones_like(a)
    spans = []
    for _ in range(repeats):
        start = time.perf_counter()
        _ = a + b
        spans.append(time.perf_counter() - start)
    return statistics.median(spans) / (a.numel() * 4)


def fit_replica_sum(
    small: tuple[float, float], large: tuple[float, float], add_s_per_byte: float
) -> tuple[float, float, float]:
    """``(latency_s, wire_s_per_byte, add_s_per_byte)`` from two ``(bytes, seconds)`` points
    of the sum (see [Note: replica-sum calibration]). The large size's time is always
    reproduced: a negative intercept or slope (noise) becomes 0 and the slope absorbs it;
    the add's share is capped at the slope."""
    (b0, t0), (b1, t1) = small, large
    slope = max((t1 - t0) / (b1 - b0), 0.0) if b1 > b0 else 0.0
    latency = t1 - slope * b1
    if latency < 0 or b1 <= b0:
        latency, slope = (0.0, t1 / b1) if b1 > 0 else (t1, 0.0)
    add = min(add_s_per_byte, slope)
    return latency, slope - add, add


def calibrate_replica_sync(small, large, repeats: int, grad_attr: str = "grad") -> dict:
    """Time the sum on two bi runtimes (``small`` and ``large`` gradients; collective over
    their group) and fit it; every rank returns the same figures: those of the rank whose
    sum was quickest at the large size (the last out of the barrier, so the one that did
    not wait for its peer: the simulator charges waiting separately). Seconds and bytes;
    ``*_s_per_byte`` 0 means free."""
    points = [
        (replica_bytes(rt), time_replica_sync(rt, repeats, grad_attr)) for rt in (small, large)
    ]
    remote = points[1][0] > 0  # odd P: the middle rank only adds in place
    add = add_seconds_per_byte(points[1][0], repeats) if remote else 0.0
    fit = fit_replica_sum(points[0], points[1], add) if remote else (0.0, 0.0, 0.0)
    mine = torch.tensor([*(x for point in points for x in point), *fit], dtype=torch.float64)
    if not remote:
        mine.zero_()
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    timed = [record for record in every if float(record[2]) > 0] or every
    quickest = min(timed, key=lambda record: float(record[3]))
    small_b, small_s, large_b, large_s, latency, wire, add = quickest.tolist()
    return {
        "bytes": [small_b, large_b],
        "seconds": [small_s, large_s],
        "latency_s": latency,
        "wire_s_per_byte": wire,
        "add_s_per_byte": add,
    }
