"""Fine-tune a megatron-core BERT classifier on IMDB reviews with PRT (the paper's BERT workload).

    python examples/imdb_finetune.py make-tiny --out data/tiny_imdb       # synthetic, no data
    python examples/imdb_finetune.py convert --imdb data/aclImdb --out data/imdb --seq-length 64
    torchrun --standalone --nproc-per-node 2 examples/imdb_finetune.py train --data data/imdb \\
        --pipeline-model-parallel-size 2 --pipeline-reuse 2 --pipeline-reuse-placement wave \\
        --num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 64 \\
        --micro-batch-size 8 --global-batch-size 32 --train-iters 200 --lr 1e-4 --eval-interval 50

Data (``examples/imdb_data.py``). ``convert`` reads the standard aclImdb folder layout
(``ROOT/{train,test}/{pos,neg}/<id>_<rating>.txt``; ``train/unsup`` and the other files are
ignored), which you download and unpack yourself: nothing is downloaded here. HTML line breaks
(``<br />``) become spaces. Without ``--vocab-file`` a SentencePiece tokenizer is trained on
the train split (``bert_data.py``'s, loaded through megatron-core's tokenizers;
``--vocab-file`` takes a SentencePiece ``.model`` or e.g. bert-base-uncased's WordPiece
``vocab.txt``, which megatron-core loads with ``transformers``). Every review becomes ``[CLS]
text [SEP]``, truncated to ``--seq-length`` tokens and padded with ``[PAD]``. ``make-tiny``
writes a small synthetic folder in the same layout (reviews of neutral words plus a few
positive or negative ones, so a small model learns it in a few dozen steps).

Files written to ``--out DIR`` by ``convert``, for each split ``S`` in ``train``, ``test``:

- ``S_tokens.npy``: ``[N, seq]`` token ids (uint16 when the vocab fits, else int32).
- ``S_padding_mask.npy``: ``[N, seq]`` uint8, 1 for a real token, 0 for padding (megatron's BERT
  ``padding_mask``, the model's attention mask).
- ``S_label.npy``: ``[N]`` uint8, 0 = negative (``neg/``), 1 = positive (``pos/``).
- ``S_rating.npy``: ``[N]`` int8, the star rating from the file name (-1 if it has none).
- ``tokenizer.model`` (or ``vocab.txt``) and ``meta.json`` (sequence length, vocab size, the
  tokenizer's file name, counts per split).

Training. megatron-core's ``BertModel`` (local layer spec, tied embeddings, binary head) is the
classifier: the binary head, a Linear(hidden, 2) on the pooled ``[CLS]``, scores negative /
positive, and the loss is the cross entropy of those two logits alone (the model runs with
``lm_labels=None``; its language-model logits are not used). The flags are Megatron-LM's; the
learning rate is constant (Adam with weight decay and gradient clipping). megatron-prt builds
the chunks, replaces the pipeline schedule (``--pipeline-reuse`` is required; ``1`` is the
1F1B-equivalent) and returns the losses on pipeline rank P-1, which prints, every
``--log-interval`` iterations, the mean train loss and accuracy and the samples/s, and every
``--eval-interval`` iterations (and at the end) the loss and accuracy on the test split
(``--eval-iters`` global batches of it; all of it by default). CPU runs use gloo with one
thread per rank (:mod:`megatron_prt.megatron.cpu`); ``--device cuda`` uses NCCL.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # torch loads lazily: make-tiny and convert do not need it
    pass

# examples/ is not a package: its folder goes on the path whether this file runs as a script,
# under torchrun, or is loaded by path (the tests), so its modules import the same way in all.
_EXAMPLES_DIR = str(Path(__file__).resolve().parent)
if _EXAMPLES_DIR not in sys.path:
    sys.path.insert(0, _EXAMPLES_DIR)

from bert_data import DataError  # noqa: E402
from imdb_data import (  # noqa: E402
    DEFAULT_SEQ_LENGTH,
    DEFAULT_VOCAB_SIZE,
    ImdbSplit,
    ShuffledIndices,
    convert,
    eval_batches,
    load_split,
    make_tiny,
    microbatches,
    read_meta,
)

# --------------------------------------------------------------------------------- model


def classification_loss(label, valid, output) -> tuple:
    """megatron's loss_func contract for the classifier: the mean cross entropy of the binary
    head's logits over the valid samples, and ``{'cls loss', 'accuracy'}`` as Megatron-LM's
    ``[sum, count]`` pairs (so micro-batches and data-parallel ranks add up exactly)."""
    import torch

    _, logits = output  # BertModel at post_process with lm_labels=None: (lm logits, binary)
    weight = valid.to(torch.float32)
    losses = torch.nn.functional.cross_entropy(logits.float(), label, reduction="none")
    count = weight.sum()
    loss_sum = (losses * weight).sum()
    correct = ((logits.argmax(dim=-1) == label).float() * weight).sum()
    reported = {
        "cls loss": torch.stack([loss_sum, count]).detach(),
        "accuracy": torch.stack([correct, count]).detach(),
    }
    return loss_sum / count.clamp(min=1.0), reported


def forward_step(device, data_iterator, model) -> tuple:
    """megatron's forward_step_func: one micro-batch through one model chunk."""
    import torch

    batch = {key: value.to(device) for key, value in next(data_iterator).items()}
    output = model(
        batch["tokens"],
        batch["padding_mask"],
        tokentype_ids=torch.zeros_like(batch["tokens"]),  # one segment
        lm_labels=None,
    )
    return output, partial(classification_loss, batch["label"], batch["valid"])


def build_model(args: argparse.Namespace, reuse, vocab_size: int) -> tuple:
    """``(config, chunks)``: this rank's BertModel chunks, roles from the PRT placement."""
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_prt.megatron import build_chunks, transformer_config_kwargs
    from megatron_prt.megatron.pretrain import build_model

    on_cuda = args.device == "cuda"
    config = TransformerConfig(
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        use_cpu_initialization=not on_cuda,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        pipeline_dtype=torch.float32,
        gradient_accumulation_fusion=False,
        bias_activation_fusion=on_cuda,  # the fused kernels exist on CUDA only
        masked_softmax_fusion=on_cuda,
        bias_dropout_fusion=on_cuda,
        persist_layer_norm=False,
        **transformer_config_kwargs(reuse),  # layers, pipeline size, PRT layer layout
    )
    # BERT's own two token types and binary head, so pretrained checkpoints fit
    provider = partial(build_model, "bert", vocab_size=vocab_size, seq_length=args.seq_length)
    chunks = build_chunks(provider, reuse, config=config)
    return config, chunks


# ------------------------------------------------------------------------------ training


def check_train_args(args: argparse.Namespace, train_parser: argparse.ArgumentParser):
    """Complete and check the ``train`` flags; exits 2 through ``train_parser`` on impossible
    settings, before any collective call. Returns ``args``."""
    from megatron_prt.core import ConfigError
    from megatron_prt.megatron.args import validate_args

    args.world_size = int(os.environ.get("WORLD_SIZE", 1))
    args.tensor_model_parallel_size = args.context_parallel_size = 1
    if args.pipeline_reuse is None:
        train_parser.error(
            "this example runs megatron-prt's schedule: add --pipeline-reuse R "
            "(--pipeline-reuse 1 is the 1F1B-equivalent; megatron's own pipeline schedule "
            "needs CUDA p2p)"
        )
    try:
        args.reuse = validate_args(args)  # also sets the virtual-pipeline size
    except ConfigError as exc:
        train_parser.error(str(exc))
    if args.world_size % args.pipeline_model_parallel_size:
        train_parser.error(
            f"{args.world_size} process(es) do not divide into --pipeline-model-parallel-size "
            f"{args.pipeline_model_parallel_size}: run under torchrun --nproc-per-node N, N a "
            "multiple of it"
        )
    per_step = args.micro_batch_size * (args.world_size // args.pipeline_model_parallel_size)
    if args.global_batch_size % per_step:
        train_parser.error(
            f"--global-batch-size {args.global_batch_size} is not a multiple of "
            f"--micro-batch-size x data-parallel size = {per_step}"
        )
    return args


def _setup_distributed(args: argparse.Namespace):
    """Process group, CPU shim and megatron's model-parallel state; returns the device."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    import megatron_prt.megatron as prt

    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if device.type == "cpu":
        torch.set_num_threads(1)  # ranks share the cores
        from megatron_prt.megatron import cpu

        cpu.enable()
    parallel_state.initialize_model_parallel(
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        get_embedding_ranks=prt.embedding_ranks,  # megatron-prt sums tied embedding grads
    )
    # Megatron-LM's rule: another seed per pipeline rank, so that chunks on different ranks
    # do not start from the same draws (the data order keeps --seed on every rank).
    seed = args.seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    return device


def _build_training(args: argparse.Namespace, vocab_size: int, device) -> tuple:
    """``(model chunks wrapped in DDP, optimizer)``, with PRT installed."""
    from megatron.core.optimizer import OptimizerConfig

    import megatron_prt.megatron as prt
    from megatron_prt.megatron.training import build_training

    config, model = build_model(args, args.reuse, vocab_size)
    model = [chunk.to(device) for chunk in model]
    optimizer_config = OptimizerConfig(
        optimizer="adam", lr=args.lr, weight_decay=args.weight_decay, clip_grad=args.clip_grad
    )
    training = build_training(model, config, optimizer_config=optimizer_config, reuse=args.reuse)
    prt.install(args.reuse)  # get_forward_backward_func() now returns PRT's
    return training.chunks, training.optimizer


class _Runner:
    """One rank's view of the run: the data-parallel coordinates, the forward-backward
    function and the reporting rule (pipeline rank P-1, data-parallel rank 0 prints)."""

    def __init__(self, args: argparse.Namespace, model: list, device) -> None:
        from megatron.core import parallel_state, pipeline_parallel

        self.args, self.model, self.device = args, model, device
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self.dp_group = parallel_state.get_data_parallel_group()
        self.num_microbatches = args.global_batch_size // (args.micro_batch_size * self.dp_size)
        self.holds_losses = (
            parallel_state.get_pipeline_model_parallel_rank()
            == args.pipeline_model_parallel_size - 1
        )  # where the PRT schedule returns them
        self.prints = self.holds_losses and self.dp_rank == 0
        self.forward_backward = pipeline_parallel.get_forward_backward_func()  # after install

    def run(self, data: ImdbSplit, indices: np.ndarray, forward_only: bool) -> list[dict]:
        batches = microbatches(
            data, indices, self.dp_rank, self.dp_size, self.args.micro_batch_size
        )
        return self.forward_backward(
            forward_step_func=partial(forward_step, self.device),
            data_iterator=[iter(batches) for _ in self.model],
            model=self.model,
            num_microbatches=self.num_microbatches,
            seq_length=self.args.seq_length,
            micro_batch_size=self.args.micro_batch_size,
            forward_only=forward_only,
        )

    def totals(self, losses: list[dict]):
        """Per key, the ``[sum, count]`` pairs of ``losses`` added up over micro-batches."""
        return {key: sum(loss[key].double().cpu() for loss in losses) for key in losses[0]}

    def reduced(self, totals: dict) -> tuple[dict[str, float], int]:
        """Means over every data-parallel rank of ``totals`` and the samples they cover
        (collective over the data-parallel group: call on every loss holder)."""
        import torch
        import torch.distributed as dist

        keys = sorted(totals)
        stacked = torch.stack([totals[key] for key in keys]).to(self.device)
        if self.dp_size > 1:
            dist.all_reduce(stacked, group=self.dp_group)
        pairs = dict(zip(keys, stacked.tolist(), strict=True))
        means = {key: s / max(n, 1.0) for key, (s, n) in pairs.items()}
        return means, int(pairs["accuracy"][1])


def evaluate(runner: _Runner, test: ImdbSplit, iteration: int) -> dict[str, float] | None:
    """Forward-only pass over the test split; prints and returns its means on the printing
    rank (None elsewhere). The model is in eval mode (no dropout) meanwhile."""
    start = time.perf_counter()
    for chunk in runner.model:
        chunk.eval()
    totals = None
    for indices in eval_batches(len(test), runner.args.global_batch_size, runner.args.eval_iters):
        losses = runner.run(test, indices, forward_only=True)
        if runner.holds_losses:
            totals = _add(totals, runner.totals(losses))
    for chunk in runner.model:
        chunk.train()
    if not runner.holds_losses:
        return None
    means, samples = runner.reduced(totals)
    if runner.prints:
        print(
            f"eval at iteration {iteration}: test cls loss {means['cls loss']:.4f} | test "
            f"accuracy {means['accuracy']:.4f} | {samples} samples in "
            f"{time.perf_counter() - start:.1f} s",
            flush=True,
        )
    return means


def _add(totals: dict | None, more: dict) -> dict:
    """``totals + more`` per key (``totals`` None: nothing added yet)."""
    return dict(more) if totals is None else {key: totals[key] + more[key] for key in totals}


class _LogWindow:
    """Train losses, step count, step seconds and the latest grad norm since the last log."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.totals, self.steps, self.seconds, self.grad_norm = None, 0, 0.0, float("nan")

    def add(self, runner: _Runner, losses: list[dict], seconds: float, grad_norm) -> None:
        if runner.holds_losses:
            self.totals = _add(self.totals, runner.totals(losses))
        self.steps, self.seconds = self.steps + 1, self.seconds + seconds
        self.grad_norm = float(grad_norm) if grad_norm is not None else float("nan")

    def log(self, runner: _Runner, iteration: int) -> None:
        """Print the window's means (collective over data-parallel loss holders); reset."""
        if runner.holds_losses:
            means, _ = runner.reduced(self.totals)
            if runner.prints:
                rate = self.steps * runner.args.global_batch_size / self.seconds
                print(
                    f"iteration {iteration:6d}/{runner.args.train_iters} | cls loss "
                    f"{means['cls loss']:.4f} | accuracy {means['accuracy']:.4f} | samples/s "
                    f"{rate:.1f} | grad norm {self.grad_norm:.3f}",
                    flush=True,
                )
        self.reset()


def train_step(runner: _Runner, optimizer, train: ImdbSplit, indices: np.ndarray) -> tuple:
    """One optimizer step on the global batch ``indices``: ``(losses, grad norm)``."""
    for chunk in runner.model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    losses = runner.run(train, indices, forward_only=False)
    _, grad_norm, _ = optimizer.step()
    return losses, grad_norm


def train_loop(runner: _Runner, optimizer, train: ImdbSplit, test: ImdbSplit) -> None:
    """``--train-iters`` optimizer steps, logging every ``--log-interval`` and evaluating
    every ``--eval-interval`` iterations and after the last (samples/s: training steps only)."""
    args = runner.args
    stream = ShuffledIndices(len(train), args.seed)
    window = _LogWindow()
    for iteration in range(1, args.train_iters + 1):
        start = time.perf_counter()
        losses, grad_norm = train_step(
            runner, optimizer, train, stream.take(args.global_batch_size)
        )
        window.add(runner, losses, time.perf_counter() - start, grad_norm)
        last = iteration == args.train_iters
        if iteration % args.log_interval == 0 or last:
            window.log(runner, iteration)
        if (args.eval_interval and iteration % args.eval_interval == 0) or last:
            evaluate(runner, test, iteration)


def train(args: argparse.Namespace) -> None:
    """The ``train`` command (every rank of the torchrun job runs it)."""
    meta = read_meta(args.data)  # data errors stop every rank here, before any collective
    if args.seq_length is None:
        args.seq_length = meta["seq_length"]
    if args.seq_length != meta["seq_length"]:
        raise DataError(
            f"{args.data} was converted at --seq-length {meta['seq_length']}, not "
            f"{args.seq_length}: convert again or drop --seq-length"
        )
    train_set, test_set = load_split(args.data, "train"), load_split(args.data, "test")
    device = _setup_distributed(args)
    model, optimizer = _build_training(args, meta["vocab_size"], device)
    runner = _Runner(args, model, device)
    if runner.prints:
        placement = args.reuse.placement
        print(
            f"imdb: train {len(train_set)}, test {len(test_set)} samples, vocab "
            f"{meta['vocab_size']}, seq {args.seq_length}; PRT P={placement.ranks} "
            f"R={placement.reuse} {placement.placement}/{placement.direction}, "
            f"{runner.num_microbatches} micro-batches per rank and iteration",
            flush=True,
        )
    train_loop(runner, optimizer, train_set, test_set)


# ----------------------------------------------------------------------------------- CLI


def _positive_int(text: str) -> int:
    """argparse type of counts that must be >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _add_train_flags(train_parser: argparse.ArgumentParser) -> None:
    from megatron_prt.megatron.args import add_arguments

    group = train_parser.add_argument_group("model and training (Megatron-LM names)")
    group.add_argument("--data", required=True, help="folder written by convert")
    group.add_argument("--num-layers", type=_positive_int, default=4)
    group.add_argument("--hidden-size", type=_positive_int, default=64)
    group.add_argument("--num-attention-heads", type=_positive_int, default=4)
    group.add_argument("--seq-length", type=_positive_int, default=None, help="default: the data's")
    group.add_argument("--micro-batch-size", type=_positive_int, default=8)
    group.add_argument("--global-batch-size", type=_positive_int, default=32)
    group.add_argument("--train-iters", type=_positive_int, default=100)
    group.add_argument("--lr", type=float, default=1e-4)
    group.add_argument("--weight-decay", type=float, default=0.01)
    group.add_argument("--clip-grad", type=float, default=1.0)
    group.add_argument("--hidden-dropout", type=float, default=0.1)
    group.add_argument("--attention-dropout", type=float, default=0.1)
    group.add_argument("--log-interval", type=_positive_int, default=10)
    group.add_argument(
        "--eval-interval", type=_positive_int, default=None, help="default: at the end"
    )
    group.add_argument(
        "--eval-iters",
        type=_positive_int,
        default=None,
        help="global batches of the test split per evaluation (default: all of it)",
    )
    group.add_argument("--seed", type=int, default=1234)
    group.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    group.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    add_arguments(train_parser)


def build_parser() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """The command line (``make-tiny``, ``convert``, ``train``) and its ``train`` parser."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    tiny = commands.add_parser("make-tiny", help="write a synthetic aclImdb-layout folder")
    tiny.add_argument("--out", required=True, help="new folder (ROOT for convert --imdb)")
    tiny.add_argument("--train-per-class", type=int, default=64)
    tiny.add_argument("--test-per-class", type=int, default=32)
    tiny.add_argument("--seed", type=int, default=0)
    conv = commands.add_parser("convert", help="aclImdb folder -> tokenizer + token arrays")
    conv.add_argument("--imdb", required=True, help="ROOT holding {train,test}/{pos,neg}")
    conv.add_argument("--out", required=True, help="output folder")
    conv.add_argument("--seq-length", type=int, default=DEFAULT_SEQ_LENGTH)
    vocab = conv.add_mutually_exclusive_group()
    vocab.add_argument(
        "--vocab-file", help="use this SentencePiece .model or WordPiece vocab.txt, train none"
    )
    vocab.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE)
    train_parser = commands.add_parser("train", help="fine-tune (run under torchrun)")
    _add_train_flags(train_parser)
    return parser, train_parser


def _convert_command(args: argparse.Namespace) -> None:
    meta = convert(
        args.imdb,
        args.out,
        seq_length=args.seq_length,
        vocab_file=args.vocab_file,
        vocab_size=args.vocab_size,
    )
    for split, info in meta["splits"].items():
        print(
            f"{split}: {info['samples']} reviews ({info['positive']} positive), "
            f"{info['truncated']} cut to {meta['seq_length']} tokens"
        )
    print(f"wrote {args.out} (vocab {meta['vocab_size']})")


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; data errors are one line on stderr and exit code 2."""
    # megatron-core says these in every CPU run (no TE / apex; its own default cuda-graph
    # scope): not news to this program, and they would bury its output.
    for message in (
        "Transformer Engine and Apex are not installed",
        "Apex is not installed",
        "full scope is deprecated",
    ):
        warnings.filterwarnings("ignore", message=message)
    parser, train_parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "make-tiny":
            make_tiny(
                args.out,
                train_per_class=args.train_per_class,
                test_per_class=args.test_per_class,
                seed=args.seed,
            )
            print(f"wrote {args.out}")
        elif args.command == "convert":
            _convert_command(args)
        else:
            train(check_train_args(args, train_parser))
            from megatron_prt.megatron import teardown  # megatron is loaded by now

            teardown()  # train's model, PRT's runtimes, megatron's groups, every group
    except DataError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
