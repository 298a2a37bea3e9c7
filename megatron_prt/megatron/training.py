"""The one way megatron-prt sets up megatron-core training for model chunks.

:func:`build_training` wraps freshly built chunks in megatron-core's
``DistributedDataParallel``, makes a PRT model consistent across ranks
(:func:`~megatron_prt.megatron.model.prepare_model`), connects megatron's gradient hooks
(:func:`~megatron_prt.megatron.model.connect_model_hooks`) and builds megatron-core's
optimizer (``get_megatron_optimizer``), in that order:

1. DDP first: it moves every parameter into its contiguous buffer; everything after writes
   through the wrapped parameters.
2. ``prepare_model`` before the optimizer: ``bi`` replicas and tied output weights take their
   source's values here, and a mixed-precision optimizer copies the parameters into its fp32
   main weights when it is built, so it must see the prepared values.
3. Hooks and optimizer: megatron's schedule reads the hooks from ``config``; with fp16 the
   optimizer's loss scaling becomes ``config.grad_scale_func``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .config import ReuseConfig


@dataclass(frozen=True)
class Training:
    """What :func:`build_training` made: ``chunks`` (this rank's chunks, each inside
    megatron's ``DistributedDataParallel``, in chunk order: the ``model`` list of megatron's
    forward-backward contract), ``optimizer`` (megatron-core's, over all of them) and
    ``config`` (the ``TransformerConfig`` whose hooks now point at ``chunks``)."""

    chunks: list
    optimizer: Any
    config: Any


def build_training(
    chunks: list,
    config,
    *,
    optimizer_config,
    ddp_config=None,
    reuse: ReuseConfig | None = None,
) -> Training:
    """DDP-wrap ``chunks``, prepare them for PRT, connect megatron's hooks, build the
    optimizer (the order the module docstring explains).

    ``chunks``: this rank's freshly built model chunks, already on their device (and inside
    ``Float16Module`` for bf16/fp16), not yet wrapped; ``config``: their ``TransformerConfig``
    (its ``no_sync_func``, ``grad_sync_func``, ``finalize_model_grads_func`` and, with fp16,
    ``grad_scale_func`` are set here); ``optimizer_config``: megatron-core's
    ``OptimizerConfig``; ``ddp_config``: its ``DistributedDataParallelConfig`` (default: no
    overlapped gradient reduction: ``finalize_model_grads`` reduces each gradient buffer once
    after the schedule; with ``overlap_grad_reduce`` DDP's hooks start it during each chunk's
    last backward, except in chunks whose gradients PRT sums after the schedule (``bi``
    replicas, tied embeddings), whose reductions start asynchronously right after those
    sums: ``MegatronCallbacks.start_summed_grad_sync``); ``reuse``: the PRT
    configuration, ``None`` for megatron's own schedule (nothing to prepare). Collective over
    the pipeline group when ``reuse`` is given (``prepare_model`` exchanges replica and tied
    weights)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import get_megatron_optimizer

    from .model import connect_model_hooks, prepare_model

    if ddp_config is None:
        ddp_config = DistributedDataParallelConfig(overlap_grad_reduce=False)
    wrapped = [DistributedDataParallel(config, ddp_config, chunk) for chunk in chunks]
    if reuse is not None:
        prepare_model(wrapped, reuse)  # bi replicas, tied output weight copies
    connect_model_hooks(config, wrapped)
    optimizer = get_megatron_optimizer(optimizer_config, wrapped)
    if optimizer_config.fp16:
        config.grad_scale_func = optimizer.scale_loss  # dynamic loss scaling
    return Training(chunks=wrapped, optimizer=optimizer, config=config)


def restart_grad_ready_counts(model: list) -> None:
    """Make megatron's DDP record its gradient-ready counts afresh on the next iteration.

    [Note: DDP's recorded gradient counts] With ``--overlap-grad-reduce`` megatron-core's DDP
    records, in its first iteration, how often each parameter's gradient hook fires once
    ``no_sync`` is released, and later starts a bucket's reduction when the counts reach
    that record. Under split backward the release comes before a chunk's last I, so the
    Ws that follow it count, and their number depends on the plan: after a switch of plan
    (auto, its measured pick, another micro-batch count) the reduction started while a W
    still added to the gradients (replicas 3.7e-3 apart after 8 iterations, without a word)
    or never (an assertion). So DDP records again when another runtime trains (one
    iteration reduced at its end). megatron-core 0.16-0.19's bucket groups; others kept."""
    for chunk in model:
        groups = (
            *getattr(chunk, "bucket_groups", ()),
            *getattr(chunk, "expert_parallel_bucket_groups", ()),
        )
        for group in groups:
            if hasattr(group, "golden_per_param_grad_ready_counts"):
                group.is_first_batch = True
                group.golden_per_param_grad_ready_counts = {}
                group.per_param_grad_ready_counts = {}
