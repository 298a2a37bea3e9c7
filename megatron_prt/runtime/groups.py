"""The process groups of data parallelism around the plain runtime (README, "Data
parallelism"): world = P pipeline ranks x DP replicas, pipeline k holding global ranks
``k*P .. k*P+P-1`` and data-parallel group r holding pipeline rank r of every pipeline. Each
rank of pipeline k is member k of its data-parallel group, so the two ranks of a bi replica
pair (one pipeline) hold the same member index: what is laid out per data-parallel group
(a shard, a slice of the batch) lines up across them."""

from __future__ import annotations

import torch.distributed as dist


def data_parallel_groups(pipeline_ranks: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """``(pipeline, data)``: this rank's pipeline group (pass it as ``group=`` to
    ``PipelineRuntime``, ``sync_replicas`` and ``reduce_replica_grads``) and its
    data-parallel group (all-reduce the gradients over it after ``step()``). Collective over
    the default group: every rank calls it, as ``dist.new_group`` requires. ValueError when
    the world size is not a multiple of ``pipeline_ranks``."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if pipeline_ranks < 1 or world % pipeline_ranks:
        raise ValueError(
            f"rank {rank}: {world} ranks do not make pipelines of {pipeline_ranks} ranks; "
            f"launch a multiple of {pipeline_ranks} processes (P x DP) or pass the placement's P"
        )
    pipeline = data = None
    for first in range(0, world, pipeline_ranks):  # every rank makes every group
        group = dist.new_group(list(range(first, first + pipeline_ranks)))
        pipeline = group if first <= rank < first + pipeline_ranks else pipeline
    for member in range(pipeline_ranks):
        group = dist.new_group(list(range(member, world, pipeline_ranks)))
        data = group if rank % pipeline_ranks == member else data
    return pipeline, data
