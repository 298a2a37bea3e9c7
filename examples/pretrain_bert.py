"""Pretrain megatron-core's BERT with PRT pipeline reuse: Megatron-LM's pretrain_bert.py, short.

    torchrun --standalone --nproc-per-node 4 examples/pretrain_bert.py \\
        --pipeline-model-parallel-size 4 --pipeline-reuse 2 --pipeline-reuse-placement wave

Model: megatron-core ``BertModel`` (local spec, tied word embeddings and output layer, the
sentence-order "binary" head unless ``--bert-no-binary-head``). Training: megatron-core's DDP,
Adam (``get_megatron_optimizer``), gradient clipping, ``OptimizerParamScheduler`` (warm-up,
then decay to ``--min-lr``); megatron-prt supplies the layer layout, the chunks' roles and the
forward-backward function. Flags keep Megatron-LM's names and meanings.

Schedules. ``--pipeline-reuse R`` runs PRT (each pipeline rank reused R times); ``R=1`` is
PRT's plan equivalent to 1F1B, the baseline to compare against on CPU. Without
``--pipeline-reuse`` megatron-core's own schedule runs: with ``--pipeline-model-parallel-size``
> 1 its p2p needs CUDA, so on CPU that means ``--pipeline-model-parallel-size 1``.

Devices. ``--device cpu`` (default): gloo, one thread per rank, megatron-core's CUDA-only spots
replaced by :mod:`megatron_prt.megatron.cpu`, fp32. ``--device cuda``: NCCL, one GPU per rank,
``--bf16`` / ``--fp16`` available. The same command runs under ``torchrun`` on either; a plain
``python`` launch is one rank.

Data. ``--data-path PREFIX --vocab-file vocab.txt``: a sentence-level indexed dataset (as
Megatron-LM's ``tools/preprocess_data.py --split-sentences`` or ``examples/bert_data.py``
write it). Without ``--data-path`` the corpus embedded in Python (``pydoc_data.topics``) is
prepared once into ``--data-cache-path`` (no download). Each data-parallel rank reads its
micro-batches sequentially (megatron's sampler order); every model chunk receives the same
micro-batches. Evaluation uses the same first ``--eval-iters`` global batches of the
validation split every time, so validation losses are comparable along a run.

Output. A progress line every ``--log-interval`` iterations (losses averaged over the
interval, learning rate, grad norm, samples/s, ms/iteration, the pipeline bubble measured
from the last iteration's per-action spans, and each pipeline rank's peak activation memory),
validation losses every ``--eval-interval``, and at the end one line ``SUMMARY {json}``.
The PRT runtime is built during iteration 1, so the bubble is measured from iteration 2 on
(iteration 1 too with ``--pipeline-reuse-trace``, which also writes its timeline) and the
activation memory on iteration 2 alone (its hooks cost time; every iteration repeats the same
schedule and shapes). Megatron's own schedule reports neither.

Checkpoints. ``--save DIR --save-interval N`` writes every rank's model chunks, optimizer
(with its state), scheduler, iteration, data position and RNG states to
``DIR/iter_XXXXXXX/rank_YY.pt`` and the iteration to ``DIR/latest``; ``--load DIR`` resumes
from ``DIR/latest`` (same launch layout required) and continues with the numbers an
uninterrupted run gives. ``--exit-interval N`` stops after iteration N (saving first).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bert_data lives beside this file

PROG = "pretrain_bert.py"
LR_DECAY_STYLES = ("constant", "linear", "cosine")
CHECKPOINT_FORMAT = 1


# ----------------------------------------------------------------------------------- flags


class _OneLineParser(argparse.ArgumentParser):
    """argparse whose errors are one line on stderr and exit status 2, like our refusals."""

    def error(self, message: str) -> NoReturn:
        refuse(message)


def refuse(message: str) -> NoReturn:
    """Stop with ``PROG: error: message`` (rank 0 only, so a torchrun launch prints it once)
    and exit status 2. Called before any collective, so every rank stops the same way."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"{PROG}: error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    """Every flag: Megatron-LM's names and meanings, plus megatron-prt's ``--pipeline-reuse*``."""
    from megatron_prt.megatron.args import add_arguments

    parser = _OneLineParser(
        prog=PROG,
        description=__doc__.split("\n\n")[0],
        epilog="Baseline for PRT comparisons: --pipeline-reuse 1 (PRT's 1F1B-equivalent plan); "
        "megatron's own pipelined schedule (no --pipeline-reuse, pipeline size > 1) needs CUDA.",
    )
    _add_model_flags(parser.add_argument_group("model"))
    _add_training_flags(parser.add_argument_group("training"))
    _add_parallel_flags(parser.add_argument_group("parallelism and device"))
    _add_data_flags(parser.add_argument_group("data"))
    _add_output_flags(parser.add_argument_group("checkpoints and logging"))
    add_arguments(parser)
    return parser


def _add_model_flags(group) -> None:
    group.add_argument("--num-layers", type=int, default=8)
    group.add_argument("--hidden-size", type=int, default=64)
    group.add_argument("--ffn-hidden-size", type=int, default=None, help="default 4 * hidden")
    group.add_argument("--num-attention-heads", type=int, default=4)
    group.add_argument("--seq-length", type=int, default=64)
    group.add_argument(
        "--max-position-embeddings", type=int, default=None, help="default --seq-length"
    )
    group.add_argument("--hidden-dropout", type=float, default=0.1)
    group.add_argument("--attention-dropout", type=float, default=0.1)
    group.add_argument(
        "--bert-no-binary-head",
        dest="bert_binary_head",
        action="store_false",
        help="no sentence-order (binary) head: samples are single segments, no sop loss",
    )
    group.add_argument("--make-vocab-size-divisible-by", type=int, default=128)


def _add_training_flags(group) -> None:
    group.add_argument("--micro-batch-size", type=int, default=2)
    group.add_argument("--global-batch-size", type=int, default=8)
    group.add_argument("--train-iters", type=int, default=20)
    group.add_argument("--lr", type=float, default=1e-3)
    group.add_argument("--min-lr", type=float, default=0.0)
    group.add_argument("--lr-decay-style", choices=LR_DECAY_STYLES, default="linear")
    group.add_argument("--lr-decay-iters", type=int, default=None, help="default --train-iters")
    group.add_argument("--lr-warmup-iters", type=int, default=0)
    group.add_argument("--weight-decay", type=float, default=0.01)
    group.add_argument("--clip-grad", type=float, default=1.0)
    group.add_argument("--adam-beta1", type=float, default=0.9)
    group.add_argument("--adam-beta2", type=float, default=0.999)
    group.add_argument("--adam-eps", type=float, default=1e-8)
    group.add_argument("--seed", type=int, default=1234)
    group.add_argument("--bf16", action="store_true", help="bfloat16 model (CUDA only)")
    group.add_argument("--fp16", action="store_true", help="float16 model, loss scaling (CUDA)")


def _add_parallel_flags(group) -> None:
    group.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    group.add_argument(
        "--tensor-model-parallel-size", type=int, default=1, help="only 1 is supported here"
    )
    group.add_argument("--device", choices=("cpu", "cuda"), default="cpu")


def _add_data_flags(group) -> None:
    group.add_argument("--data-path", default=None, help="indexed dataset prefix (no .bin/.idx)")
    group.add_argument("--vocab-file", default=None, help="WordPiece vocab.txt of --data-path")
    group.add_argument("--split", default="90,5,5", help="train,valid,test document weights")
    group.add_argument(
        "--data-cache-path",
        default=None,
        help="where the default corpus is prepared and sample indices are cached (default "
        "$XDG_CACHE_HOME/megatron-prt, or beside --data-path for its indices)",
    )


def _add_output_flags(group) -> None:
    group.add_argument("--eval-interval", type=int, default=10)
    group.add_argument("--eval-iters", type=int, default=2, help="global batches per evaluation")
    group.add_argument("--log-interval", type=int, default=5)
    group.add_argument("--save", default=None, metavar="DIR")
    group.add_argument("--save-interval", type=int, default=None)
    group.add_argument("--load", default=None, metavar="DIR")
    group.add_argument("--exit-interval", type=int, default=None, help="stop after iteration N")
    group.add_argument("--tensorboard-dir", default=None)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parsed and checked flags. Impossible settings end the process (exit status 2, one line)
    before anything heavy loads; sets ``args.reuse`` (ReuseConfig or None) and
    ``args.data_parallel_size``."""
    from megatron_prt.core import ConfigError
    from megatron_prt.megatron.args import validate_args

    args = build_parser().parse_args(argv)
    args.world_size = int(os.environ.get("WORLD_SIZE", "1"))
    args.context_parallel_size = 1
    args.max_position_embeddings = args.max_position_embeddings or args.seq_length
    args.lr_decay_iters = args.lr_decay_iters or args.train_iters
    _refuse_unsupported(args)
    try:
        args.reuse = validate_args(args)  # PRT settings checked before any collective
    except ConfigError as exc:
        refuse(str(exc))
    return args


def _refuse_unsupported(args: argparse.Namespace) -> None:
    for message in _problems(args):
        refuse(message)


def _problems(args: argparse.Namespace) -> Iterator[str]:
    """Why ``args`` cannot run, most basic first (each a one-line message with the fix)."""
    if args.tensor_model_parallel_size != 1:
        yield (
            f"--tensor-model-parallel-size {args.tensor_model_parallel_size} is not supported "
            "by this example (megatron-prt replaces the pipeline schedule only); use 1"
        )
    if args.bf16 and args.fp16:
        yield "--bf16 and --fp16 exclude each other; pick one"
    if (args.bf16 or args.fp16) and args.device == "cpu":
        flag = "--bf16" if args.bf16 else "--fp16"
        yield (
            f"{flag} needs --device cuda: on CPU megatron-core trains in fp32 here "
            "(megatron_prt.megatron.cpu supports no half-precision optimizer); drop it"
        )
    if args.device == "cuda" and not torch.cuda.is_available():
        yield "--device cuda but torch sees no GPU; use --device cpu"
    yield from _layout_problems(args)
    yield from _size_problems(args)
    yield from _output_problems(args)


def _layout_problems(args: argparse.Namespace) -> Iterator[str]:
    pp = args.pipeline_model_parallel_size
    if pp < 1 or args.world_size % pp:
        yield (
            f"--pipeline-model-parallel-size {pp} must divide the number of ranks "
            f"({args.world_size}); the rest is data parallel"
        )
        return
    args.data_parallel_size = args.world_size // pp
    per_step = args.micro_batch_size * args.data_parallel_size
    if args.micro_batch_size < 1 or args.global_batch_size % per_step:
        yield (
            f"--global-batch-size {args.global_batch_size} must be a positive multiple of "
            f"--micro-batch-size * data-parallel size = {per_step}"
        )
    if pp > 1 and args.pipeline_reuse is None and args.device == "cpu":
        yield (
            "megatron's own pipelined schedule needs CUDA (its p2p calls CUDA); on CPU use "
            "--pipeline-reuse 1 for 1F1B (PRT's equivalent plan) or --pipeline-reuse R"
        )


def _size_problems(args: argparse.Namespace) -> Iterator[str]:
    if args.hidden_size % args.num_attention_heads:
        yield (
            f"--hidden-size {args.hidden_size} must be a multiple of --num-attention-heads "
            f"{args.num_attention_heads}"
        )
    if args.max_position_embeddings < args.seq_length:
        yield (
            f"--max-position-embeddings {args.max_position_embeddings} is below --seq-length "
            f"{args.seq_length}"
        )
    if args.seq_length < 5:
        yield f"--seq-length {args.seq_length} leaves no room for text ([CLS] A [SEP] B [SEP])"
    if args.train_iters < 1:
        yield f"--train-iters must be >= 1, got {args.train_iters}"
    if args.lr_warmup_iters > args.lr_decay_iters:
        yield (
            f"--lr-warmup-iters {args.lr_warmup_iters} exceeds the decay length "
            f"{args.lr_decay_iters} (--lr-decay-iters, default --train-iters)"
        )
    if args.min_lr > args.lr:
        yield f"--min-lr {args.min_lr} exceeds --lr {args.lr}"
    for flag in ("log_interval", "eval_interval"):
        if getattr(args, flag) < 1:
            yield f"--{flag.replace('_', '-')} must be >= 1"


def _output_problems(args: argparse.Namespace) -> Iterator[str]:
    if args.data_path is not None and args.vocab_file is None:
        yield "--data-path needs --vocab-file (the WordPiece vocab.txt its ids come from)"
    if args.data_path is not None and not os.path.isfile(args.data_path + ".idx"):
        yield f"--data-path {args.data_path}: no {args.data_path}.idx (give the prefix)"
    if args.vocab_file is not None and not os.path.isfile(args.vocab_file):
        yield f"--vocab-file {args.vocab_file} does not exist"
    if args.save_interval is not None and args.save is None:
        yield "--save-interval needs --save DIR"
    if args.save_interval is not None and args.save_interval < 1:
        yield "--save-interval must be >= 1"
    if args.tensorboard_dir is not None and not _tensorboard_available():
        yield (
            "--tensorboard-dir needs torch.utils.tensorboard, which needs the tensorboard "
            "package: pip install tensorboard (or drop --tensorboard-dir)"
        )


def _tensorboard_available() -> bool:
    try:
        import torch.utils.tensorboard  # noqa: F401
    except ImportError:
        return False
    return True


# ------------------------------------------------------------------------- distributed set-up


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
    from megatron_prt.megatron import cpu
    from megatron_prt.runtime.cpu import keep_freed_memory

    torch.set_num_threads(1)  # ranks share the cores: more threads only contend
    keep_freed_memory()  # activations are reallocated every micro-batch: avoid page faults
    cpu.enable()


def _init_model_parallel(args: argparse.Namespace) -> None:
    from megatron.core import parallel_state

    import megatron_prt.megatron as prt

    parallel_state.initialize_model_parallel(
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size
        if args.reuse
        else None,
        # PRT sums tied embedding gradients itself; megatron's group would sum them twice.
        get_embedding_ranks=prt.embedding_ranks if args.reuse else None,
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
    """Pipeline rank P-1 of data-parallel replica 0: where megatron reads the losses."""
    from megatron.core import parallel_state

    return (
        parallel_state.is_pipeline_last_stage(ignore_virtual=True)
        and parallel_state.get_data_parallel_rank() == 0
    )


def log(message: str) -> None:
    """A progress line from the logging rank."""
    if is_logging_rank():
        print(message, flush=True)


# ---------------------------------------------------------------------------------------- data


def resolve_data(args: argparse.Namespace) -> tuple[str, str, str]:
    """``(dataset prefix, vocab file, sample-index cache dir)``. Without ``--data-path`` the
    embedded corpus is prepared once into the cache (global rank 0 writes, the others wait
    at a barrier and read it: the cache must be on a file system every rank sees; a
    completed preparation is reused)."""
    if args.data_path is not None:
        cache = args.data_cache_path or os.path.join(os.path.dirname(args.data_path), "cache")
        return args.data_path, args.vocab_file, cache
    root = Path(args.data_cache_path or _default_cache_root())
    version = f"py{sys.version_info.major}.{sys.version_info.minor}"  # pydoc text varies
    out = root / f"bert-pydoc-{version}"
    if args.vocab_file is not None:
        out = root / f"bert-pydoc-{version}-{Path(args.vocab_file).stem}"
    marker = out / "prepared.json"
    if dist.get_rank() == 0 and not marker.is_file():
        _prepare_default_corpus(out, marker, args.vocab_file)
    dist.barrier()
    prepared = json.loads(marker.read_text())
    return prepared["prefix"], prepared["vocab_file"], str(out / "cache")


def _default_cache_root() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "megatron-prt")


def _prepare_default_corpus(out: Path, marker: Path, vocab_file: str | None) -> None:
    import bert_data

    print(f"preparing the embedded corpus (pydoc_data.topics) in {out} ...", flush=True)
    prepared = bert_data.prepare(out, vocab_file=vocab_file)
    tmp = marker.with_suffix(".tmp")
    tmp.write_text(json.dumps({"prefix": prepared.prefix, "vocab_file": prepared.vocab_file}))
    tmp.replace(marker)  # written last: a half-finished preparation is never reused


def build_data(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    """``(tokenizer, train dataset, valid dataset or None)``: megatron-core's
    ``BERTMaskedWordPieceDataset`` with enough samples for ``--train-iters`` global batches
    and one evaluation's ``--eval-iters`` (collective over all ranks)."""
    import bert_data

    prefix, vocab_file, cache = resolve_data(args)
    tokenizer = bert_data.WordPieceTokenizer(vocab_file)
    started = time.perf_counter()
    eval_samples = max(1, args.eval_iters) * args.global_batch_size
    try:
        train, valid, _ = bert_data.build_datasets(
            prefix,
            tokenizer,
            args.seq_length,
            args.split,
            num_samples=(args.train_iters * args.global_batch_size, eval_samples, eval_samples),
            seed=args.seed,
            binary_head=args.bert_binary_head,
            cache_dir=cache,
        )
    except bert_data.DataError as exc:
        refuse(str(exc))  # same data on every rank: every rank stops here
    if train is None:
        refuse(f"--split {args.split} leaves no training data")
    sizes = f"train {len(train)}" + (f", valid {len(valid)}" if valid is not None else "")
    log(
        f"data: {prefix} (vocab {tokenizer.vocab_size}, seq {args.seq_length}): {sizes} "
        f"samples ({time.perf_counter() - started:.1f} s)"
    )
    return tokenizer, train, valid


def collate(samples: Sequence[dict]) -> dict[str, torch.Tensor]:
    """One micro-batch from megatron's BERT samples: int64 tensors ``[b, s]`` (``text``,
    ``types``, ``labels``, ``loss_mask``, ``padding_mask``) and ``is_random`` ``[b]``."""
    keys = ("text", "types", "labels", "loss_mask", "padding_mask")
    batch = {k: torch.from_numpy(np.stack([s[k] for s in samples]).astype(np.int64)) for k in keys}
    batch["is_random"] = torch.tensor([int(s["is_random"]) for s in samples], dtype=torch.int64)
    return batch


@dataclass
class MicroBatchSampler:
    """Megatron's sequential pretraining order for one data-parallel rank: global batch ``i``
    is samples ``[i*G, (i+1)*G)``; in each step of ``micro_batch_size * dp_size`` samples,
    rank ``r`` takes the ``r``-th slice. ``consumed`` (samples of all ranks) is the data
    position a checkpoint keeps; indices wrap around the dataset."""

    dataset: Any
    micro_batch_size: int
    dp_rank: int
    dp_size: int
    consumed: int = 0

    def next_global_batch(self, microbatches: int) -> list[dict[str, torch.Tensor]]:
        """This rank's ``microbatches`` micro-batches of the next global batch."""
        batches = [self._micro_batch(self.consumed + k * self._step) for k in range(microbatches)]
        self.consumed += microbatches * self._step
        return batches

    @property
    def _step(self) -> int:
        return self.micro_batch_size * self.dp_size

    def _micro_batch(self, start: int) -> dict[str, torch.Tensor]:
        first = start + self.dp_rank * self.micro_batch_size
        size = len(self.dataset)
        return collate([self.dataset[(first + i) % size] for i in range(self.micro_batch_size)])


# --------------------------------------------------------------------------------------- model


def padded_vocab_size(vocab_size: int, divisible_by: int) -> int:
    """Megatron-LM pads the vocab to a multiple of ``--make-vocab-size-divisible-by`` (x TP)."""
    return math.ceil(vocab_size / divisible_by) * divisible_by


def params_dtype(args: argparse.Namespace) -> torch.dtype:
    return torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32


def build_model(args: argparse.Namespace, vocab_size: int, device: torch.device):
    """``(config, chunks)``: this rank's megatron-core BertModel chunks (roles from the PRT
    placement, or the whole model), half-precision-wrapped as Megatron-LM does, on
    ``device``, inside megatron's DDP, prepared for PRT when it runs."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.module import Float16Module

    import megatron_prt.megatron as prt

    config = transformer_config(args)
    provider = partial(_bert_chunk, args, vocab_size)
    chunks = [chunk.to(device) for chunk in prt.build_chunks(provider, args.reuse, config=config)]
    if args.bf16 or args.fp16:
        chunks = [Float16Module(config, chunk) for chunk in chunks]
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=args.bf16 or args.fp16, overlap_grad_reduce=False
    )
    chunks = [DistributedDataParallel(config, ddp_config, chunk) for chunk in chunks]
    if args.reuse is not None:
        prt.prepare_model(chunks, args.reuse)  # bi replicas, tied output weight copies
    return config, chunks


def transformer_config(args: argparse.Namespace):
    """megatron-core's TransformerConfig for the flags (fused kernels only on CUDA)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    import megatron_prt.megatron as prt

    cuda = args.device == "cuda"
    fields = dict(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        use_cpu_initialization=not cuda,
        params_dtype=params_dtype(args),
        pipeline_dtype=params_dtype(args),
        bf16=args.bf16,
        fp16=args.fp16,
        gradient_accumulation_fusion=False,  # needs apex / Transformer Engine
        bias_activation_fusion=cuda,
        masked_softmax_fusion=cuda and _has_fused_softmax(),
        bias_dropout_fusion=cuda,
        persist_layer_norm=False,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
    )
    if args.reuse is not None:
        fields.update(prt.transformer_config_kwargs(args.reuse))  # PRT's layer layout
    return TransformerConfig(**fields)


def _has_fused_softmax() -> bool:
    """megatron's fused softmax (half precision only) imports this kernel module at run time;
    without it (no apex / Megatron-LM kernels installed) the unfused softmax must be chosen."""
    import importlib.util

    return importlib.util.find_spec("scaled_masked_softmax_cuda") is not None


def _bert_chunk(args: argparse.Namespace, vocab_size: int, config, **role):
    """One BertModel chunk; ``role``: ``pre_process`` / ``post_process`` / ``vp_stage`` from
    :func:`megatron_prt.megatron.build_chunks`."""
    from megatron.core.models.bert.bert_layer_specs import bert_layer_local_spec
    from megatron.core.models.bert.bert_model import BertModel

    return BertModel(
        config=config,
        num_tokentypes=2 if args.bert_binary_head else 0,
        transformer_layer_spec=bert_layer_local_spec,
        vocab_size=vocab_size,
        max_sequence_length=args.max_position_embeddings,
        share_embeddings_and_output_weights=True,
        add_binary_head=args.bert_binary_head,
        **role,
    )


def build_optimizer(args: argparse.Namespace, config, chunks: list):
    """``(optimizer, scheduler)``: megatron-core Adam with clipping (mixed-precision wrapper
    with --bf16/--fp16) and OptimizerParamScheduler stepped in samples, as Megatron-LM does."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    optimizer = get_megatron_optimizer(
        OptimizerConfig(
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
        ),
        chunks,
    )
    if args.fp16:
        config.grad_scale_func = optimizer.scale_loss  # dynamic loss scaling
    samples = args.global_batch_size
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters * samples,
        lr_decay_steps=args.lr_decay_iters * samples,
        lr_decay_style=args.lr_decay_style,
        start_wd=args.weight_decay,
        end_wd=args.weight_decay,
        wd_incr_steps=args.train_iters * samples,
        wd_incr_style="constant",
    )
    return optimizer, scheduler


# ---------------------------------------------------------------------------- forward and loss


def forward_step(binary_head: bool, device: torch.device, data_iterator, model):
    """megatron's forward_step_func, as in Megatron-LM's pretrain_bert.py: the model's token
    losses (and sentence-order logits) and the loss function over them."""
    batch = {k: v.to(device, non_blocking=True) for k, v in next(data_iterator).items()}
    output = model(
        batch["text"],
        batch["padding_mask"],
        tokentype_ids=batch["types"] if binary_head else None,
        lm_labels=batch["labels"],
    )
    return output, partial(loss_func, batch["loss_mask"], batch["is_random"])


def loss_func(loss_mask: torch.Tensor, sentence_order: torch.Tensor, output):
    """Masked-LM loss (mean over masked tokens) plus sentence-order loss; megatron's
    ``(loss, {name: value})`` protocol, values detached."""
    token_losses, sop_logits = output
    mask = loss_mask.float().reshape(-1)
    lm_loss = torch.sum(token_losses.float().reshape(-1) * mask) / mask.sum().clamp(min=1)
    if sop_logits is None:
        return lm_loss, {"lm loss": lm_loss.detach().clone()}
    sop_loss = torch.nn.functional.cross_entropy(
        sop_logits.view(-1, 2).float(), sentence_order.view(-1), ignore_index=-1
    )
    reported = {"lm loss": lm_loss.detach().clone(), "sop loss": sop_loss.detach().clone()}
    return lm_loss + sop_loss, reported


def mean_losses(store: list[dict], device: torch.device) -> dict[str, float]:
    """Loss dicts of the micro-batches (pipeline rank P-1), averaged over micro-batches and
    data-parallel replicas; ``{}`` on other pipeline ranks (they hold no losses)."""
    from megatron.core import parallel_state

    if not parallel_state.is_pipeline_last_stage(ignore_virtual=True) or not store:
        return {}
    names = sorted(store[0])
    values = torch.stack([sum(entry[n].float() for entry in store) / len(store) for n in names])
    values = values.to(device)
    dist.all_reduce(values, group=parallel_state.get_data_parallel_group())
    values /= parallel_state.get_data_parallel_world_size()
    return {name: float(v) for name, v in zip(names, values.tolist(), strict=True)}


# ----------------------------------------------------------------------- pipeline measurements


def prt_runtime(forward_backward) -> Any | None:
    """The PRT runtime (MegatronPipeline) behind PRT's forward-backward function after its
    first call, ``None`` for megatron's own schedule or before that call."""
    pipeline = getattr(forward_backward, "pipeline", None)
    return pipeline() if callable(pipeline) else None


def measured_bubble(spans: Sequence[Sequence[tuple]]) -> float | None:
    """1 - (compute time of all ranks) / (P * makespan) for one iteration's spans
    ``[(action, start_s, end_s), ...]`` per pipeline rank (each rank's clock starts at its
    own step start). ``None`` without spans."""
    ends = [end for row in spans for _, _, end in row]
    if not ends:
        return None
    busy = sum(end - start for row in spans for _, start, end in row)
    return 1.0 - busy / (len(spans) * max(ends))


@dataclass
class PipelineProbe:
    """Per-action spans and activation memory of PRT's runtime (inert for megatron's own
    schedule). Spans are recorded every iteration once the runtime exists (it is built
    during iteration 1) and gathered at log intervals only. Activation memory is measured
    on one iteration, the next: its saved-tensor hooks cost time, and the schedule and
    shapes repeat every iteration, so one measurement holds for all."""

    forward_backward: Any
    runtime: Any = None
    own_peak: int | None = None
    peak_bytes: list[int] | None = None  # per pipeline rank, once gathered

    def after_iteration(self) -> None:
        """Call after every training iteration (local, no collective)."""
        if self.runtime is None:
            self.runtime = prt_runtime(self.forward_backward)
            if self.runtime is not None:
                self.runtime.trace_enabled = True
                self.runtime.measure_memory = True  # for the next iteration only
        elif self.runtime.measure_memory:
            self.own_peak = int(self.runtime.memory_peak())
            self.runtime.measure_memory = False

    def measure(self) -> tuple[float | None, list[int] | None]:
        """``(bubble of the last training iteration, per-rank peak activation bytes)``,
        ``None`` for what is not measured (yet). Collective over the pipeline group."""
        from megatron.core import parallel_state

        from megatron_prt.runtime.trace import gather_spans

        if self.runtime is None:
            return None, None
        group = parallel_state.get_pipeline_model_parallel_group()
        bubble = measured_bubble(gather_spans(self.runtime, group))
        if self.peak_bytes is None:
            peaks: list = [None] * dist.get_world_size(group)
            dist.all_gather_object(peaks, self.own_peak, group=group)
            self.peak_bytes = None if None in peaks else peaks
        return bubble, self.peak_bytes


def predicted_bubble(reuse, microbatches: int) -> float | None:
    """The simulator's bubble for the plan (uniform stages, free communication)."""
    if reuse is None:
        return None
    from megatron_prt.core import build_plan
    from megatron_prt.sim.simulate import simulate

    return simulate(build_plan(reuse.placement, microbatches)).bubble_fraction


# --------------------------------------------------------------------------------- checkpoints


def rng_state() -> dict:
    """Every RNG training reads (dropout draws from torch's and megatron's tracker)."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": {k: v.clone() for k, v in get_cuda_rng_tracker().get_states().items()},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    get_cuda_rng_tracker().set_states({k: v.clone() for k, v in state["tracker"].items()})
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])


def layout_signature(args: argparse.Namespace) -> dict:
    """What must match for a rank's checkpoint file to fit this launch."""
    reuse = args.reuse
    return {
        "format": CHECKPOINT_FORMAT,
        "world_size": args.world_size,
        "pipeline_model_parallel_size": args.pipeline_model_parallel_size,
        "placement": None if reuse is None else str(reuse.placement),
        "stage_layers": None if reuse is None else list(reuse.layers_per_stage()),
        "num_layers": args.num_layers,
        "hidden_size": args.hidden_size,
        "binary_head": args.bert_binary_head,
        "dtype": str(params_dtype(args)),
    }


@dataclass
class TrainState:
    """Everything a resumed run needs besides the flags."""

    chunks: list
    optimizer: Any
    scheduler: Any
    sampler: MicroBatchSampler
    iteration: int = 0


def checkpoint_path(root: str, iteration: int, rank: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}" / f"rank_{rank:02d}.pt"


def save_checkpoint(args: argparse.Namespace, state: TrainState) -> None:
    """Every rank writes its file (atomically); rank 0 then points ``latest`` at it.
    Collective (a barrier between the files and ``latest``)."""
    path = checkpoint_path(args.save, state.iteration, dist.get_rank())
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "layout": layout_signature(args),
        "iteration": state.iteration,
        "consumed_samples": state.sampler.consumed,
        "model": [chunk.state_dict() for chunk in state.chunks],
        "optimizer": state.optimizer.state_dict(),
        "scheduler": state.scheduler.state_dict(),
        "rng": rng_state(),
    }
    tmp = path.with_suffix(".tmp")
    torch.save(payload, tmp)
    tmp.replace(path)
    dist.barrier()
    if dist.get_rank() == 0:
        latest = Path(args.save) / "latest"
        latest.with_suffix(".tmp").write_text(f"{state.iteration}\n")
        latest.with_suffix(".tmp").replace(latest)
    dist.barrier()
    log(f"saved checkpoint of iteration {state.iteration} to {path.parent}")


def load_checkpoint(args: argparse.Namespace, state: TrainState) -> None:
    """Resume from ``--load DIR/latest``; without ``latest`` start fresh (Megatron-LM's
    behaviour, so ``--save D --load D`` restarts a preempted job). Refuses (exit 2) a
    checkpoint written by another launch layout or model."""
    latest = Path(args.load) / "latest"
    if not latest.is_file():
        log(f"no checkpoint in {args.load} (no {latest}): starting from scratch")
        return
    iteration = int(latest.read_text().strip())
    path = checkpoint_path(args.load, iteration, dist.get_rank())
    if not path.is_file():
        refuse(f"--load {args.load}: no {path} (was the checkpoint written by fewer ranks?)")
    # On the CPU first: RNG states must stay CPU tensors; weights and optimizer state are
    # copied onto their parameters' device by load_state_dict.
    payload = torch.load(path, map_location="cpu", weights_only=False)
    saved, current = payload["layout"], layout_signature(args)
    if saved != current:
        differences = [
            f"{k} {saved.get(k)} (now {v})" for k, v in current.items() if saved.get(k) != v
        ]
        refuse(f"checkpoint {path} does not fit this launch: {'; '.join(differences)}")
    for chunk, weights in zip(state.chunks, payload["model"], strict=True):
        chunk.load_state_dict(weights, strict=True)
    state.optimizer.load_state_dict(payload["optimizer"])
    state.scheduler.load_state_dict(payload["scheduler"])
    state.iteration = payload["iteration"]
    state.sampler.consumed = payload["consumed_samples"]
    set_rng_state(payload["rng"])
    log(f"resumed from {path.parent} at iteration {state.iteration}")


# ------------------------------------------------------------------------------------ training


@dataclass
class Meters:
    """Per-iteration numbers of this process's run, for the log lines and the summary."""

    losses: list[dict[str, float]] = field(default_factory=list)  # on pipeline rank P-1
    times_s: list[float] = field(default_factory=list)
    bubbles: list[tuple[int, float]] = field(default_factory=list)  # (iteration, bubble)
    last_valid: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Launch:
    """What every step reads: the flags, this rank's device, micro-batches per iteration
    (global batch // (micro batch * data-parallel size))."""

    args: argparse.Namespace
    device: torch.device
    microbatches: int


def run_schedule(forward_backward, chunks: list, batches: list, launch: Launch, **kw) -> list:
    """One global batch through megatron's forward-backward contract; every chunk gets its
    own iterator over the same micro-batches (it draws one per micro-batch it computes)."""
    args = launch.args
    return forward_backward(
        forward_step_func=partial(forward_step, args.bert_binary_head, launch.device),
        data_iterator=[iter(batches) for _ in chunks],
        model=chunks,
        num_microbatches=launch.microbatches,
        seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size,
        **kw,
    )


def train_step(forward_backward, state: TrainState, launch: Launch) -> tuple:
    """One global batch: forward-backward over its micro-batches, optimizer and scheduler
    step. Returns ``(losses, grad_norm, seconds)``."""
    started = time.perf_counter()
    for chunk in state.chunks:
        chunk.zero_grad_buffer()
    state.optimizer.zero_grad()
    batches = state.sampler.next_global_batch(launch.microbatches)
    store = run_schedule(forward_backward, state.chunks, batches, launch)
    updated, grad_norm, _ = state.optimizer.step()
    if updated:  # a skipped fp16 step (overflow) does not advance the schedule
        state.scheduler.step(increment=launch.args.global_batch_size)
    if launch.device.type == "cuda":
        torch.cuda.synchronize(launch.device)
    seconds = time.perf_counter() - started
    return mean_losses(store, launch.device), grad_norm, seconds


def evaluate(forward_backward, chunks: list, valid, launch: Launch) -> dict[str, float]:
    """Forward-only losses over the first ``--eval-iters`` global batches of the validation
    split (the same batches every time), dropout off."""
    from megatron.core import parallel_state

    args = launch.args
    sampler = MicroBatchSampler(
        valid,
        args.micro_batch_size,
        parallel_state.get_data_parallel_rank(),
        parallel_state.get_data_parallel_world_size(),
    )
    totals: dict[str, float] = {}
    for chunk in chunks:
        chunk.eval()
    with torch.no_grad():
        for _ in range(args.eval_iters):
            batches = sampler.next_global_batch(launch.microbatches)
            store = run_schedule(forward_backward, chunks, batches, launch, forward_only=True)
            for name, value in mean_losses(store, launch.device).items():
                totals[name] = totals.get(name, 0.0) + value / args.eval_iters
    for chunk in chunks:
        chunk.train()
    return totals


def progress_line(
    args: argparse.Namespace,
    iteration: int,
    meters: Meters,
    interval: int,
    lr: float,
    grad_norm: float,
    measured: tuple,
) -> str:
    """Megatron-LM-style progress: losses and times averaged over the last ``interval``
    iterations; bubble and memory of the last one."""
    losses = meters.losses[-interval:]
    seconds = statistics.fmean(meters.times_s[-interval:])
    parts = [f"iteration {iteration:>6d}/{args.train_iters}"]
    for name in sorted(losses[-1]):
        parts.append(f"{name} {statistics.fmean(x[name] for x in losses):.6E}")
    parts += [
        f"lr {lr:.4E}",
        f"grad norm {grad_norm:.4f}",
        f"{args.global_batch_size / seconds:.1f} samples/s",
        f"{seconds * 1e3:.1f} ms/iteration",
    ]
    bubble, peaks = measured
    parts.append(f"bubble {bubble:.1%}" if bubble is not None else "bubble n/a")
    if peaks is not None:
        parts.append("peak act MiB/rank " + " ".join(f"{p / 2**20:.2f}" for p in peaks))
    return " | ".join(parts)


def summary(args: argparse.Namespace, state: TrainState, meters: Meters, probe, micro: int):
    """The run's one-line JSON summary (last-iteration losses, means over the last half of
    this process's iterations)."""
    first = state.iteration - len(meters.times_s) + 1  # first iteration this process ran
    half = first + len(meters.times_s) // 2
    late = meters.times_s[len(meters.times_s) // 2 :] or meters.times_s
    late_bubbles = [b for i, b in meters.bubbles if i >= half] or [b for _, b in meters.bubbles]
    reuse = args.reuse
    losses = meters.losses[-1] if meters.losses else {}
    return {
        "schedule": _schedule_name(reuse),
        "world_size": args.world_size,
        "pipeline_model_parallel_size": args.pipeline_model_parallel_size,
        "data_parallel_size": args.data_parallel_size,
        "reuse": None if reuse is None else reuse.placement.reuse,
        "placement": None if reuse is None else reuse.placement.placement,
        "direction": None if reuse is None else reuse.placement.direction,
        "num_microbatches": micro,
        "device": args.device,
        "cpu_count": os.cpu_count(),
        "iteration": state.iteration,
        "lm_loss": losses.get("lm loss"),
        "sop_loss": losses.get("sop loss"),
        "valid": meters.last_valid or None,
        "ms_per_iteration": statistics.fmean(late) * 1e3 if late else None,
        "samples_per_s": args.global_batch_size / statistics.fmean(late) if late else None,
        "bubble": statistics.fmean(late_bubbles) if late_bubbles else None,
        "predicted_bubble": predicted_bubble(reuse, micro),
        "peak_activation_bytes": probe.peak_bytes,
        "trace": _trace_files(reuse),
    }


def _schedule_name(reuse) -> str:
    if reuse is None:
        return "megatron"
    c = reuse.placement
    if c.reuse == 1 and c.direction == "uni":
        return "PRT R=1 (1F1B)"
    return f"PRT R={c.reuse} {c.placement}/{c.direction}"


def _trace_files(reuse) -> list[str] | None:
    if reuse is None or not reuse.trace_path:
        return None
    found = [f"{reuse.trace_path}.{ext}" for ext in ("json", "png")]
    return [path for path in found if os.path.isfile(path)]


class TensorBoard:
    """Scalars for TensorBoard on the logging rank (no-op without ``--tensorboard-dir``)."""

    def __init__(self, directory: str | None) -> None:
        self.writer = None
        if directory is not None and is_logging_rank():
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=directory)

    def scalars(self, values: dict[str, float | None], iteration: int) -> None:
        if self.writer is None:
            return
        for name, value in values.items():
            if value is not None:
                self.writer.add_scalar(name, value, iteration)
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def train(args: argparse.Namespace, device: torch.device) -> dict:
    """The whole run; returns the summary (meaningful on the logging rank)."""
    from megatron.core import parallel_state, pipeline_parallel

    import megatron_prt.megatron as prt

    tokenizer, train_data, valid_data = build_data(args)
    vocab_size = padded_vocab_size(tokenizer.vocab_size, args.make_vocab_size_divisible_by)
    config, chunks = build_model(args, vocab_size, device)
    if args.reuse is not None:
        prt.install(args.reuse)  # megatron's get_forward_backward_func() now returns PRT's
    prt.connect_model_hooks(config, chunks)
    optimizer, scheduler = build_optimizer(args, config, chunks)
    forward_backward = pipeline_parallel.get_forward_backward_func()
    dp_rank = parallel_state.get_data_parallel_rank()
    sampler = MicroBatchSampler(train_data, args.micro_batch_size, dp_rank, args.data_parallel_size)
    state = TrainState(chunks, optimizer, scheduler, sampler)
    if args.load is not None:
        load_checkpoint(args, state)
    microbatches = args.global_batch_size // (args.micro_batch_size * args.data_parallel_size)
    _log_start(args, chunks, microbatches)
    loop = _Loop(Launch(args, device, microbatches), state, forward_backward, valid_data)
    loop.run()
    return summary(args, state, loop.meters, loop.probe, microbatches)


def _log_start(args: argparse.Namespace, chunks: list, microbatches: int) -> None:
    params = sum(p.numel() for chunk in chunks for p in chunk.parameters())
    counts: list = [None] * dist.get_world_size()
    dist.all_gather_object(counts, params)
    log(
        f"schedule {_schedule_name(args.reuse)}: {args.world_size} ranks (pipeline "
        f"{args.pipeline_model_parallel_size} x data {args.data_parallel_size}), "
        f"{len(chunks)} chunk(s) per rank, {microbatches} micro-batches per iteration; "
        f"parameters per rank {counts}"
    )


class _Loop:
    """The training loop: steps, logging, evaluation, checkpoints (all ranks)."""

    def __init__(self, launch: Launch, state: TrainState, forward_backward, valid) -> None:
        self.launch, self.args, self.state = launch, launch.args, state
        self.forward_backward = forward_backward
        self.valid = valid
        self.meters = Meters()
        self.probe = PipelineProbe(forward_backward)
        self.board = TensorBoard(self.args.tensorboard_dir)

    def run(self) -> None:
        args, state = self.args, self.state
        while state.iteration < args.train_iters:
            losses, grad_norm, seconds = train_step(self.forward_backward, state, self.launch)
            state.iteration += 1
            self.meters.losses.append(losses)
            self.meters.times_s.append(seconds)
            if len(self.meters.times_s) == 1:
                self._after_first_iteration()
            self.probe.after_iteration()
            if state.iteration % args.log_interval == 0:
                self._log(grad_norm)
            if (
                self.valid is not None
                and args.eval_iters
                and state.iteration % args.eval_interval == 0
            ):
                self._evaluate()
            if self._should_save():
                save_checkpoint(args, state)
            if args.exit_interval and state.iteration % args.exit_interval == 0:
                log(f"exiting after iteration {state.iteration} (--exit-interval)")
                break
        self.board.close()

    def _should_save(self) -> bool:
        args, iteration = self.args, self.state.iteration
        if args.save is None:
            return False
        at_interval = args.save_interval is not None and iteration % args.save_interval == 0
        exiting = bool(args.exit_interval) and iteration % args.exit_interval == 0
        return at_interval or exiting or iteration == args.train_iters

    def _after_first_iteration(self) -> None:
        reuse = self.args.reuse
        if reuse is not None and reuse.trace_path and dist.get_rank() == 0:
            files = _trace_files(reuse)
            print(f"timeline of iteration {self.state.iteration}: {', '.join(files)}", flush=True)

    def _log(self, grad_norm: float) -> None:
        measured = self.probe.measure()
        if measured[0] is not None:
            self.meters.bubbles.append((self.state.iteration, measured[0]))
        if not is_logging_rank():
            return
        interval = min(self.args.log_interval, len(self.meters.losses))
        lr = self.state.optimizer.param_groups[0]["lr"]
        line = progress_line(self.args, self.state.iteration, self.meters, interval, lr,
                             float(grad_norm), measured)  # fmt: skip
        print(line, flush=True)
        values = {f"train/{k}": v for k, v in self.meters.losses[-1].items()}
        values.update({"train/lr": lr, "train/grad-norm": float(grad_norm),
                       "time/ms-per-iteration": self.meters.times_s[-1] * 1e3,
                       "pipeline/bubble": measured[0]})  # fmt: skip
        self.board.scalars(values, self.state.iteration)

    def _evaluate(self) -> None:
        started = time.perf_counter()
        losses = evaluate(self.forward_backward, self.state.chunks, self.valid, self.launch)
        if not is_logging_rank():
            return
        self.meters.last_valid = losses
        text = " | ".join(f"{name} {value:.6E}" for name, value in sorted(losses.items()))
        seconds = time.perf_counter() - started
        print(f"validation at iteration {self.state.iteration}: {text} ({seconds:.1f} s)",
              flush=True)  # fmt: skip
        self.board.scalars({f"valid/{k}": v for k, v in losses.items()}, self.state.iteration)


def quiet_megatron_warnings() -> None:
    """megatron-core warns about missing apex / Transformer Engine and its own deprecated
    defaults in every run without them: not news to the user of this script."""
    for text in ("Transformer Engine and Apex are not installed", "Apex is not installed",
                 "full scope is deprecated"):  # fmt: skip
        warnings.filterwarnings("ignore", message=f".*{text}")


def main(argv: Sequence[str] | None = None) -> int:
    """Parse, train, print ``SUMMARY {json}`` on the logging rank; 0 on success."""
    args = parse_args(argv)
    quiet_megatron_warnings()
    device = init_distributed(args)
    try:
        result = train(args, device)
        if is_logging_rank():
            print("SUMMARY " + json.dumps(result), flush=True)
        dist.barrier()  # no rank tears down its transport while a peer still reads
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
