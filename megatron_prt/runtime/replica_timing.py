"""Measure the bi replica-gradient sum on the runtime's own transport, to calibrate the
simulator's ``replica_*`` costs (:mod:`megatron_prt.sim.cost`).

The sum is timed the way the simulator models it: all ranks start together (a barrier
stands in for "both ranks of a pair have finished their step"), so the figure is the
exchange and the add, not the wait for a late peer. With times profiled in seconds, a
measured ``t`` for this model is ``CostModel(replica_latency=t)`` (bandwidths left free);
timing two model sizes separates latency from ``replica_bandwidth``.
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
    spans = []
    for _ in range(repeats):
        dist.barrier(group=runtime._group)
        start = time.perf_counter()
        runtime.reduce_replica_grads(grad_attr)
        if runtime.device.type == "cuda":
            torch.cuda.synchronize(runtime.device)
        spans.append(time.perf_counter() - start)
        for param, grad in zip(params, saved, strict=True):
            setattr(param, grad_attr, _clone(grad))
    return statistics.median(spans)


def _clone(grad: torch.Tensor | None) -> torch.Tensor | None:
    return None if grad is None else grad.detach().clone()
