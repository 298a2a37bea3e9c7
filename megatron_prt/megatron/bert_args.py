"""Flags of ``examples/pretrain_bert.py``: Megatron-LM's names and meanings plus megatron-prt's
``--pipeline-reuse*``, checked before anything heavy loads.

Every impossible setting ends the process through :func:`refuse`: one line on stderr (rank 0
only, so a torchrun launch prints it once) and exit status 2, before any collective call, so
every rank stops the same way.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from collections.abc import Iterator, Sequence
from typing import NoReturn

import torch

from ..sim.model_shape import default_ffn
from .plan_flag import is_first_launched
from .pretrain import TRANSFORMER_IMPLS
from .tokenizer import SENTENCEPIECE_TYPES, TOKENIZER_TYPES, WORDPIECE_TYPES

PROG = "pretrain_bert.py"
OTHER_RANKS_WAIT_S = 2.0  # how long ranks other than 0 wait before a refusal's exit
LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root")


class _OneLineParser(argparse.ArgumentParser):
    """argparse whose errors are one line on stderr and exit status 2, like our refusals."""

    def error(self, message: str) -> NoReturn:
        refuse(message)


def refuse(message: str) -> NoReturn:
    """Stop with ``PROG: error: message`` (rank 0 only, so a torchrun launch prints it once)
    and exit status 2. Called before any collective, so every rank stops the same way."""
    stop(message, status=2)


def say_error(message: str, prog: str = PROG) -> None:
    """``prog: error: message`` on stderr in one write: ranks printing at once (a load
    every rank fails) then give whole lines (print's two writes interleaved them)."""
    sys.stderr.write(f"{prog}: error: {message}\n")
    sys.stderr.flush()


def stop(message: str, status: int, prog: str = PROG) -> NoReturn:
    """Exit with ``status`` after ``prog: error: message`` on stderr (rank 0 only). Every rank
    must call it for the same reason at the same point, so every rank stops."""
    if is_first_launched():
        say_error(message, prog)
    else:  # torchrun stops every worker once one exits: let rank 0 say why first
        time.sleep(OTHER_RANKS_WAIT_S)
    sys.exit(status)


def build_parser(description: str = "") -> argparse.ArgumentParser:
    """Every flag: Megatron-LM's names and meanings, plus megatron-prt's ``--pipeline-reuse*``;
    ``description`` heads ``--help``."""
    from .args import add_arguments

    parser = _OneLineParser(
        prog=PROG,
        description=description,
        epilog="Baseline for PRT comparisons: --pipeline-reuse 1 (PRT's 1F1B-equivalent plan); "
        "megatron's own pipelined schedule (no --pipeline-reuse, pipeline size > 1) needs CUDA. "
        "Each pipeline rank initializes its layers from --seed + 100 x its rank (Megatron-LM's "
        "rule), so fresh runs of two layouts start from different weights: compare their "
        "numbers from one checkpoint (--load).",
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
    group.add_argument(
        "--lr-warmup-fraction", type=float, default=None, help="of the decay, for warm-up"
    )
    group.add_argument("--lr-warmup-init", type=float, default=0.0, help="lr warm-up starts at")
    group.add_argument(
        "--override-opt_param-scheduler",
        action="store_true",
        help="on --load, keep these flags' schedule, not the checkpoint's",
    )
    group.add_argument(
        "--use-checkpoint-opt_param-scheduler",
        action="store_true",
        help="on --load, take the schedule from the checkpoint (default: they must match)",
    )
    group.add_argument("--weight-decay", type=float, default=0.01)
    group.add_argument("--clip-grad", type=float, default=1.0)
    group.add_argument("--adam-beta1", type=float, default=0.9)
    group.add_argument("--adam-beta2", type=float, default=0.999)
    group.add_argument("--adam-eps", type=float, default=1e-8)
    group.add_argument("--seed", type=int, default=1234)
    group.add_argument("--bf16", action="store_true", help="bfloat16 model (CUDA only)")
    group.add_argument("--fp16", action="store_true", help="float16 model, loss scaling (CUDA)")
    group.add_argument(
        "--no-check-for-nan-in-loss-and-grad",
        "--no-stop-on-nan",
        dest="check_for_nan_in_loss_and_grad",
        action="store_false",
        help="train on after a NaN or infinite loss or gradient norm (default: stop with an "
        "error naming the iteration)",
    )


def _add_parallel_flags(group) -> None:
    group.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    group.add_argument(
        "--tensor-model-parallel-size",
        type=int,
        default=1,
        help="megatron-core's tensor parallelism inside every pipeline stage",
    )
    group.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    group.add_argument(
        "--transformer-impl",
        choices=TRANSFORMER_IMPLS,
        default="local",
        help="megatron-core's layer spec: local (any device) or transformer_engine (--device "
        "cuda with Transformer Engine installed, as in NVIDIA's PyTorch container)",
    )
    group.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="megatron's sequence parallelism (needs --tensor-model-parallel-size > 1)",
    )
    group.add_argument(
        "--use-distributed-optimizer",
        action="store_true",
        help="megatron's distributed optimizer: Adam state sharded over data-parallel ranks",
    )
    group.add_argument(
        "--overlap-grad-reduce",
        action="store_true",
        help="start each DDP bucket's reduction as its gradients are ready (megatron's overlap)",
    )
    group.add_argument(
        "--recompute-granularity",
        choices=("full", "selective"),
        default=None,
        help="activation recomputation, as Megatron-LM (full needs --recompute-method)",
    )
    group.add_argument("--recompute-method", choices=("uniform", "block"), default=None)
    group.add_argument("--recompute-num-layers", type=int, default=None)
    group.add_argument(
        "--recompute-activations",
        action="store_true",
        help="Megatron-LM's shorthand for --recompute-granularity selective",
    )


def _add_data_flags(group) -> None:
    group.add_argument("--data-path", default=None, help="indexed dataset prefix (no .bin/.idx)")
    group.add_argument(
        "--tokenizer-type",
        choices=TOKENIZER_TYPES,
        default=None,
        help="Megatron-LM's name (default: from the file: a .txt is BertWordPieceLowerCase, "
        "anything else SentencePieceTokenizer)",
    )
    group.add_argument(
        "--tokenizer-model", default=None, help="SentencePiece .model of --data-path"
    )
    group.add_argument(
        "--vocab-file",
        default=None,
        help="vocab.txt of --data-path for --tokenizer-type BertWordPieceLowerCase / "
        "BertWordPieceCase (needs transformers)",
    )
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
    group.add_argument(
        "--allow-new-data-order",
        action="store_true",
        help="on --load, resume even where the training samples come in another order than "
        "the checkpoint's run drew them (e.g. a --train-iters that maps more passes over the "
        "data): samples already seen may come again and others never (default: refused)",
    )
    group.add_argument("--exit-interval", type=int, default=None, help="stop after iteration N")
    group.add_argument("--tensorboard-dir", default=None)


def parse_args(argv: Sequence[str] | None = None, description: str = "") -> argparse.Namespace:
    """Parsed and checked flags. Impossible settings end the process (exit status 2, one line)
    before anything heavy loads; sets ``args.reuse`` (ReuseConfig or None) and
    ``args.data_parallel_size``."""
    from ..core import ConfigError
    from .args import validate_args

    args = build_parser(description).parse_args(argv)
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
    yield from _transformer_engine_problems(args)
    yield from _layout_problems(args)
    yield from _parallel_problems(args)
    yield from _size_problems(args)
    yield from _output_problems(args)


def _layout_problems(args: argparse.Namespace) -> Iterator[str]:
    pp, tp = args.pipeline_model_parallel_size, args.tensor_model_parallel_size
    if pp < 1 or tp < 1 or args.world_size % (pp * tp):
        yield (
            f"--tensor-model-parallel-size {tp} x --pipeline-model-parallel-size {pp} must "
            f"divide the number of ranks ({args.world_size}); the rest is data parallel"
        )
        return
    if args.num_attention_heads % tp:
        yield (
            f"--num-attention-heads {args.num_attention_heads} must be a multiple of "
            f"--tensor-model-parallel-size {tp} (each tensor-parallel rank holds whole heads)"
        )
    ffn = default_ffn(args.ffn_hidden_size, args.hidden_size)
    if ffn % tp:
        yield (
            f"--ffn-hidden-size {ffn} must be a multiple of --tensor-model-parallel-size {tp} "
            "(each tensor-parallel rank holds an equal slice of the MLP)"
        )
    args.data_parallel_size = args.world_size // (pp * tp)
    per_step = args.micro_batch_size * args.data_parallel_size
    if args.micro_batch_size < 1 or args.global_batch_size % per_step:
        yield (
            f"--global-batch-size {args.global_batch_size} must be a positive multiple of "
            f"--micro-batch-size * data-parallel size = {per_step}"
        )
    reuse = args.pipeline_reuse is not None or args.pipeline_reuse_plan  # a plan file implies it
    if pp > 1 and not reuse and args.device == "cpu":
        yield (
            "megatron's own pipelined schedule needs CUDA (its p2p calls CUDA); on CPU use "
            "--pipeline-reuse 1 for 1F1B (PRT's equivalent plan) or --pipeline-reuse R"
        )


def _fused_adam() -> bool:
    """Whether megatron-core's distributed optimizer runs Transformer Engine's or apex's
    Adam, whose state its checkpoint loader reads (torch's Adam keeps a step per
    parameter, which that loader refuses)."""
    from megatron.core.optimizer import distrib_optimizer

    return distrib_optimizer.HAVE_APEX_OR_TE


def _parallel_problems(args: argparse.Namespace) -> Iterator[str]:
    """Megatron-LM's rules for the sequence-parallel and recomputation flags."""
    if args.recompute_activations:
        args.recompute_granularity = args.recompute_granularity or "selective"
    if args.use_distributed_optimizer and (args.save or args.load) and not _fused_adam():
        yield (
            "--use-distributed-optimizer with --save/--load needs Transformer Engine or apex: "
            "with torch's Adam (CPU, or a GPU without them) megatron-core's loader of the "
            "sharded optimizer state fails on every resume; install one (NVIDIA's NGC image "
            "has both) or drop --use-distributed-optimizer"
        )
    if args.sequence_parallel and args.tensor_model_parallel_size < 2:
        yield "--sequence-parallel needs --tensor-model-parallel-size > 1"
    elif args.sequence_parallel and args.seq_length % args.tensor_model_parallel_size:
        yield (
            f"--seq-length {args.seq_length} must be a multiple of --tensor-model-parallel-size "
            f"{args.tensor_model_parallel_size} under --sequence-parallel (each tensor-parallel "
            "rank holds an equal slice of the sequence)"
        )
    if args.recompute_granularity == "full" and args.recompute_method is None:
        yield "--recompute-granularity full needs --recompute-method uniform or block"
    if args.recompute_granularity != "full" and args.recompute_method is not None:
        yield "--recompute-method needs --recompute-granularity full"
    if args.recompute_num_layers is not None and args.recompute_method is None:
        yield "--recompute-num-layers needs --recompute-granularity full and --recompute-method"
    if args.recompute_method is not None:
        if args.recompute_num_layers is None:
            args.recompute_num_layers = 1  # Megatron-LM's default
        if args.recompute_num_layers < 1:
            yield f"--recompute-num-layers must be >= 1, got {args.recompute_num_layers}"


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
    if args.make_vocab_size_divisible_by < 1:  # was a ZeroDivisionError at the model's build
        yield (
            f"--make-vocab-size-divisible-by must be >= 1, got "
            f"{args.make_vocab_size_divisible_by} (megatron's default 128)"
        )
    if args.lr_warmup_fraction is not None and args.lr_warmup_iters:
        yield "pass --lr-warmup-fraction or --lr-warmup-iters, not both"
    if args.lr_warmup_fraction is not None and not 0.0 <= args.lr_warmup_fraction <= 1.0:
        yield f"--lr-warmup-fraction {args.lr_warmup_fraction} must lie in [0, 1]"
    if args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler:
        yield "pass --override-opt_param-scheduler or --use-checkpoint-opt_param-scheduler"
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


def _transformer_engine_problems(args: argparse.Namespace) -> Iterator[str]:
    """Transformer Engine has CUDA kernels only and ships in NVIDIA's container, not on PyPI's
    CPU wheels: refused before megatron-core fails on import or at its first kernel."""
    if args.transformer_impl != "transformer_engine":
        return
    if args.device != "cuda":
        yield (
            "--transformer-impl transformer_engine needs --device cuda (Transformer Engine "
            "has no CPU kernels); use --transformer-impl local on CPU"
        )
    elif importlib.util.find_spec("transformer_engine") is None:
        yield (
            "--transformer-impl transformer_engine: Transformer Engine is not installed "
            "(pip install transformer_engine[pytorch], or NVIDIA's PyTorch container); or use "
            "--transformer-impl local"
        )


def _tokenizer_problems(args: argparse.Namespace) -> Iterator[str]:
    """Megatron-LM's pairing: WordPiece types read --vocab-file, SentencePiece types
    --tokenizer-model; --data-path needs the tokenizer its ids come from."""
    if args.vocab_file is not None and args.tokenizer_model is not None:
        yield "pass --tokenizer-model (SentencePiece) or --vocab-file (WordPiece), not both"
    if args.data_path is not None and args.vocab_file is None and args.tokenizer_model is None:
        yield "--data-path needs --tokenizer-model or --vocab-file (the tokenizer of its ids)"
    if args.tokenizer_type in WORDPIECE_TYPES and args.tokenizer_model is not None:
        yield f"--tokenizer-type {args.tokenizer_type} reads --vocab-file, not --tokenizer-model"
    if args.tokenizer_type in SENTENCEPIECE_TYPES and args.vocab_file is not None:
        yield f"--tokenizer-type {args.tokenizer_type} reads --tokenizer-model, not --vocab-file"


def _output_problems(args: argparse.Namespace) -> Iterator[str]:
    yield from _tokenizer_problems(args)
    if args.data_path is not None and not os.path.isfile(args.data_path + ".idx"):
        yield f"--data-path {args.data_path}: no {args.data_path}.idx (give the prefix)"
    for flag in ("vocab_file", "tokenizer_model"):
        path = getattr(args, flag)
        if path is not None and not os.path.isfile(path):
            yield f"--{flag.replace('_', '-')} {path} does not exist"
    if args.save_interval is not None and args.save is None:
        yield "--save-interval needs --save DIR"
    if args.save_interval is not None and args.save_interval < 1:
        yield "--save-interval must be >= 1"
    if args.save is not None and _unwritable_folder(args.save):
        yield (
            f"--save {args.save}: not a folder that can be created or written (a file, or "
            "its parent missing or read-only); choose another DIR"
        )
    if args.tensorboard_dir is not None and not _tensorboard_available():
        yield (
            "--tensorboard-dir needs torch.utils.tensorboard, which needs the tensorboard "
            "package: pip install tensorboard (or drop --tensorboard-dir)"
        )


def _unwritable_folder(path: str) -> bool:
    """Found before training, not at the first save: ``path`` is a file, or it is missing
    and its parent cannot hold it."""
    if os.path.isdir(path):
        return not os.access(path, os.W_OK | os.X_OK)
    if os.path.exists(path):
        return True
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):  # save makes the missing folders
        parent = os.path.dirname(parent)
    return not (os.path.isdir(parent) and os.access(parent, os.W_OK | os.X_OK))


def _tensorboard_available() -> bool:
    try:
        import torch.utils.tensorboard  # noqa: F401
    except ImportError:
        return False
    return True
