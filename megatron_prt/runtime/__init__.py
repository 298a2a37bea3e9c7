"""Torch runtime: execute PRT plans over torch.distributed (gloo on CPU, NCCL on CUDA)."""

# [Note: the default group must end with destroy_process_group] torch.distributed.nn.functional
# writes `group=group.WORLD` as ten functions' defaults, evaluated when it is imported. torch
# imports it late (building the first optimizer imports torch._dynamo, which imports it):
# after init_process_group, the defaults held the default group past destroy_process_group
# (torch 2.13), so the gloo group and its worker threads lived on into interpreter shutdown,
# where a worker still releasing the last collective's tensors could not take the GIL and the
# process aborted ("terminate called without an active exception": 6 in 140 runs of the
# README example on a busy 2-core host). Imported here, before any script starts a group,
# the defaults hold None and destroy_process_group ends the group and joins its threads.
import torch.distributed.nn.functional  # noqa: F401  (see the note above)

from .errors import PipelineError
from .executor import PipelineRuntime
from .groups import data_parallel_groups
from .replicas import reduce_replica_grads, sync_replicas
from .stages import build_stages, layer_ranges

__all__ = [
    "PipelineError",
    "PipelineRuntime",
    "build_stages",
    "data_parallel_groups",
    "layer_ranges",
    "reduce_replica_grads",
    "sync_replicas",
]
