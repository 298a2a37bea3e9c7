"""Torch runtime: execute PRT plans over torch.distributed (gloo on CPU, NCCL on CUDA)."""

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
