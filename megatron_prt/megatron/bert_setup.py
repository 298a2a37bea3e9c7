"""Set-up of ``examples/pretrain_bert.py``: process group and megatron's parallel state,
seeds, the logging rank, megatron-core's BertModel chunks and their training (DDP, Adam,
learning-rate schedule), as Megatron-LM's ``pretrain_bert.py`` sets them up.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import tempfile
import warnings
from functools import partial
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from .training import Training
from .training import build_training as training_builder


def init_distributed(args: argparse.Namespace) -> torch.device:
    """Process group (NCCL on CUDA, gloo on CPU; a 1-rank group without torchrun), CPU
    tuning, megatron's model-parallel groups and seeds. Returns this rank's device."""
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if "RANK" in os.environ:
        dist.init_process_group(backend)
    else:  # plain `python`: one rank
        store = os.path.join(tempfile.mkdtemp(prefix="pretrain_bert_"), "store")
        dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1)
    if device.type == "cpu":
        _tune_cpu()
    _init_model_parallel(args)
    set_random_seed(args.seed)
    return device


def _tune_cpu() -> None:
    from ..runtime.cpu import keep_freed_memory
    from . import cpu

    torch.set_num_threads(1)  # ranks share the cores: more threads only contend
    keep_freed_memory()  # activations are reallocated every micro-batch: avoid page faults
    cpu.enable()


def _init_model_parallel(args: argparse.Namespace) -> None:
    from megatron.core import parallel_state

    from .model import embedding_ranks

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size
        if args.reuse
        else None,
        # PRT sums tied embedding gradients itself; megatron's group would sum them twice.
        get_embedding_ranks=embedding_ranks if args.reuse else None,
    )


def set_random_seed(seed: int) -> None:
    """Megatron-LM's seeding: one seed per pipeline rank (data-parallel replicas share it, so
    they start from the same weights) for python, numpy, torch and megatron's RNG tracker."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def is_logging_rank() -> bool:
    """Pipeline rank P-1 of data-parallel replica 0 and tensor-parallel rank 0: where megatron
    reads the losses (every TP rank holds the same)."""
    from megatron.core import parallel_state

    return (
        parallel_state.is_pipeline_last_stage(ignore_virtual=True)
        and parallel_state.get_data_parallel_rank() == 0
        and parallel_state.get_tensor_model_parallel_rank() == 0
    )


def log(message: str) -> None:
    """A progress line from the logging rank."""
    if is_logging_rank():
        print(message, flush=True)


def padded_vocab_size(vocab_size: int, divisible_by: int) -> int:
    """Megatron-LM pads the vocab to a multiple of ``--make-vocab-size-divisible-by`` x the
    tensor-parallel size (every TP rank holds an equal slice of the embedding). Needs
    megatron's parallel state."""
    from megatron.core import parallel_state

    tensor_parallel = parallel_state.get_tensor_model_parallel_world_size()
    return pad_vocab(vocab_size, divisible_by, tensor_parallel)


def pad_vocab(vocab_size: int, divisible_by: int, tensor_parallel: int) -> int:
    """``vocab_size`` rounded up to a multiple of ``divisible_by * tensor_parallel``."""
    multiple = divisible_by * tensor_parallel
    return math.ceil(vocab_size / multiple) * multiple


def params_dtype(args: argparse.Namespace) -> torch.dtype:
    return torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32


def build_model(args: argparse.Namespace, vocab_size: int, device: torch.device):
    """``(config, chunks)``: this rank's megatron-core BertModel chunks (roles from the PRT
    placement, or the whole model), half-precision-wrapped as Megatron-LM does, on
    ``device``; :func:`build_training` wraps them for training."""
    from megatron.core.transformer.module import Float16Module

    from .model import build_chunks

    config = transformer_config(args)
    provider = partial(_bert_chunk, args, vocab_size)
    chunks = [chunk.to(device) for chunk in build_chunks(provider, args.reuse, config=config)]
    if args.bf16 or args.fp16:
        chunks = [Float16Module(config, chunk) for chunk in chunks]
    return config, chunks


def transformer_config(args: argparse.Namespace):
    """megatron-core's TransformerConfig for the flags: :func:`megatron_prt.megatron.pretrain.
    transformer_config` (the shared defaults) with the flags' sizes, dropout and precision, and
    fused kernels only on CUDA."""
    from .model import transformer_config_kwargs
    from .pretrain import transformer_config as base_config

    cuda = args.device == "cuda"
    fields = dict(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        use_cpu_initialization=not cuda,
        bf16=args.bf16,
        fp16=args.fp16,
        bias_activation_fusion=cuda,
        masked_softmax_fusion=cuda and _has_fused_softmax(),
        bias_dropout_fusion=cuda,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        sequence_parallel=args.sequence_parallel,
        recompute_granularity=args.recompute_granularity,
        recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers,
    )
    if args.reuse is not None:
        fields.update(transformer_config_kwargs(args.reuse))  # PRT's layer layout
    return base_config(params_dtype(args), **fields)


def _has_fused_softmax() -> bool:
    """megatron's fused softmax (half precision only) imports this kernel module at run time;
    without it (no apex / Megatron-LM kernels installed) the unfused softmax must be chosen."""
    import importlib.util

    return importlib.util.find_spec("scaled_masked_softmax_cuda") is not None


def _bert_chunk(args: argparse.Namespace, vocab_size: int, config, **role):
    """One BertModel chunk; ``role``: ``pre_process`` / ``post_process`` / ``vp_stage`` from
    :func:`megatron_prt.megatron.build_chunks`."""
    from megatron.core.models.bert.bert_model import BertModel

    from .pretrain import layer_spec_of

    return BertModel(
        config=config,
        num_tokentypes=2 if args.bert_binary_head else 0,
        transformer_layer_spec=layer_spec_of("bert", args.transformer_impl),
        vocab_size=vocab_size,
        max_sequence_length=args.max_position_embeddings,
        share_embeddings_and_output_weights=True,
        add_binary_head=args.bert_binary_head,
        **role,
    )


def build_training(args: argparse.Namespace, config, chunks: list) -> tuple[Training, Any]:
    """``(training, scheduler)``: the chunks inside megatron's DDP, prepared for PRT when it
    runs, with megatron-core Adam and clipping (mixed-precision wrapper with --bf16/--fp16)
    (:func:`megatron_prt.megatron.training.build_training`), and OptimizerParamScheduler
    stepped in samples, as Megatron-LM does."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig

    optimizer_config = OptimizerConfig(
        optimizer="adam",
        lr=args.lr,
        min_lr=args.min_lr,
        weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2,
        adam_eps=args.adam_eps,
        clip_grad=args.clip_grad,
        bf16=args.bf16,
        fp16=args.fp16,
        params_dtype=params_dtype(args),
        use_distributed_optimizer=args.use_distributed_optimizer,
    )
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=args.bf16 or args.fp16,
        overlap_grad_reduce=args.overlap_grad_reduce,
        use_distributed_optimizer=args.use_distributed_optimizer,
    )
    training = training_builder(
        chunks, config, optimizer_config=optimizer_config, ddp_config=ddp_config, reuse=args.reuse
    )
    return training, scheduler(args, training.optimizer)


def scheduler(args: argparse.Namespace, optimizer):
    """megatron-core's OptimizerParamScheduler as Megatron-LM builds it for iteration-based
    training: counted in samples, warm-up of ``--lr-warmup-iters`` or
    ``--lr-warmup-fraction`` of the decay."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    samples = args.global_batch_size
    decay_steps = args.lr_decay_iters * samples
    warmup_steps = args.lr_warmup_iters * samples
    if args.lr_warmup_fraction is not None:
        warmup_steps = int(args.lr_warmup_fraction * decay_steps)
    return OptimizerParamScheduler(
        optimizer,
        init_lr=args.lr_warmup_init,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_steps=warmup_steps,
        lr_decay_steps=decay_steps,
        lr_decay_style=args.lr_decay_style,
        start_wd=args.weight_decay,
        end_wd=args.weight_decay,
        wd_incr_steps=args.train_iters * samples,
        wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=args.override_opt_param_scheduler,
    )


def quiet_megatron_warnings() -> None:
    """megatron-core warns about missing apex / Transformer Engine and its own deprecated
    defaults in every run without them: not news to the user of this script."""
    for text in ("Transformer Engine and Apex are not installed", "Apex is not installed",
                 "full scope is deprecated"):  # fmt: skip
        warnings.filterwarnings("ignore", message=f".*{text}")
