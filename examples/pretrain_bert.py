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

Data. ``--data-path PREFIX --tokenizer-model tokenizer.model`` (SentencePiece) or
``--data-path PREFIX --vocab-file vocab.txt`` (WordPiece), with Megatron-LM's
``--tokenizer-type``: a sentence-level indexed dataset (as Megatron-LM's
``tools/preprocess_data.py --split-sentences`` or ``examples/bert_data.py`` write it).
Without ``--data-path`` the corpus embedded in Python (``pydoc_data.topics``) is prepared
once into ``--data-cache-path`` (no download), with a SentencePiece tokenizer trained on it
or the tokenizer file given, in a folder named by the Python version and tokenizer kind.
Each data-parallel rank reads its micro-batches sequentially (megatron's sampler order);
every model chunk receives the same micro-batches. Evaluation uses the same first
``--eval-iters`` global batches of the validation split every time, so validation losses
are comparable along a run.

Output. A progress line every ``--log-interval`` iterations (losses averaged over the
interval, learning rate, grad norm, samples/s, ms/iteration, the pipeline bubble measured
from the last iteration's per-action spans, and each pipeline rank's peak activation memory),
validation losses every ``--eval-interval``, and at the end one line ``SUMMARY {json}``.
A NaN or infinite loss (checked before the optimizer step) or gradient norm stops every rank
with exit status 1 and an error naming the iteration and the value; ``--no-stop-on-nan``
(Megatron-LM's ``--no-check-for-nan-in-loss-and-grad``) trains on.
The PRT runtime is built during iteration 1, so the bubble is measured from iteration 2 on
(iteration 1 too with ``--pipeline-reuse-trace``, which also writes its timeline) and the
activation memory on iteration 2 alone (its hooks cost time; every iteration repeats the same
schedule and shapes). Megatron's own schedule reports neither.

Checkpoints. ``--save DIR --save-interval N`` writes model and optimizer (with its state)
through megatron-core's dist_checkpointing (``torch_dist``) to ``DIR/iter_XXXXXXX/``, with the
iteration, data position, learning-rate scheduler state and RNG states, and the iteration to
``DIR/latest``; ``--load DIR`` resumes from ``DIR/latest`` under any layout (another
``--pipeline-reuse``, placement, direction, pipeline, tensor- or data-parallel size) and
continues with the numbers the saving run would have gone on with: in the same layout; in
another with dropout off (to fp32 rounding across tensor-parallel sizes). With dropout on
another layout draws other masks (a chunk's dropout stream belongs to its place in the
layout; another pipeline or tensor-parallel size restarts the streams from ``--seed``).
Initial weights: each pipeline rank draws from ``--seed`` + 100 x its rank, as in
Megatron-LM, so fresh runs of two layouts start from different weights; compare layouts from
one checkpoint. ``--exit-interval N`` stops
after iteration N (saving first). Nothing in a checkpoint is unpickled into objects. A
``--load DIR`` without ``DIR/latest`` (the folder missing too) starts fresh, as Megatron-LM
does, and says so on rank 0. When ``latest`` names a checkpoint that cannot be loaded
(unreadable, missing, incomplete, truncated, another model) every rank exits with status 2
(under torchrun the first to exit does, torchrun stops the others and itself exits 1) and says
which earlier complete checkpoint to resume from instead, or which flags differ.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch.distributed as dist

from megatron_prt.megatron import bert_args
from megatron_prt.megatron.bert_args import refuse
from megatron_prt.megatron.bert_loop import train
from megatron_prt.megatron.bert_setup import (
    init_distributed,
    is_logging_rank,
    log,
    quiet_megatron_warnings,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bert_data lives beside this file


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parsed and checked flags (:func:`megatron_prt.megatron.bert_args.parse_args`):
    impossible settings end the process (exit status 2, one line) before anything heavy
    loads."""
    return bert_args.parse_args(argv, description=__doc__.split("\n\n")[0])


# ---------------------------------------------------------------------------------------- data


def resolve_data(args: argparse.Namespace) -> tuple[str, str, str]:
    """``(dataset prefix, tokenizer file, sample-index cache dir)``. Without ``--data-path``
    the embedded corpus is prepared once into the cache, in a folder named by the tokenizer
    kind and file content (:func:`_file_digest`); global rank 0 writes, the others wait at a
    barrier and read it: the cache must be on a file system every rank sees; a completed
    preparation is reused."""
    given = args.tokenizer_model or args.vocab_file
    if args.data_path is not None:
        cache = args.data_cache_path or os.path.join(os.path.dirname(args.data_path), "cache")
        return args.data_path, given, cache
    root = Path(args.data_cache_path or _default_cache_root())
    version = f"py{sys.version_info.major}.{sys.version_info.minor}"  # pydoc text varies
    kind = "sentencepiece" if given is None else f"{tokenizer_type(args)}-{_file_digest(given)}"
    out = root / f"bert-pydoc-{version}-{kind}"
    marker = out / "prepared.json"
    if dist.get_rank() == 0 and not marker.is_file():
        _prepare_default_corpus(out, marker, args)
    dist.barrier()
    prepared = json.loads(marker.read_text())
    return prepared["prefix"], prepared["tokenizer_file"], str(out / "cache")


def _file_digest(path: str) -> str:
    """The tokenizer file's stem and content: a folder prepared for another file of the
    same name (another ``spm.model``) was reused, its tokenizer and data with it."""
    import hashlib

    digest = hashlib.md5(Path(path).read_bytes(), usedforsecurity=False).hexdigest()[:12]
    return f"{Path(path).stem}-{digest}"


def tokenizer_type(args: argparse.Namespace) -> str:
    """``--tokenizer-type``, or Megatron-LM's type for the file given."""
    from megatron_prt.megatron.tokenizer import WORDPIECE_TYPES

    if args.tokenizer_type is not None:
        return args.tokenizer_type
    if args.vocab_file is not None and args.vocab_file.endswith(".txt"):
        return WORDPIECE_TYPES[0]  # BertWordPieceLowerCase, Megatron-LM's BERT default
    return "SentencePieceTokenizer"


def _default_cache_root() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "megatron-prt")


def _prepare_default_corpus(out: Path, marker: Path, args: argparse.Namespace) -> None:
    import bert_data

    from megatron_prt.megatron.tokenizer import WORDPIECE_TYPES

    wordpiece = args.vocab_file is not None and tokenizer_type(args) in WORDPIECE_TYPES
    given = args.tokenizer_model or args.vocab_file
    print(f"preparing the embedded corpus (pydoc_data.topics) in {out} ...", flush=True)
    try:
        prepared = bert_data.prepare(
            out,
            vocab_file=args.vocab_file if wordpiece else None,
            tokenizer_model=None if wordpiece else args.tokenizer_model or args.vocab_file,
            tokenizer_type=tokenizer_type(args) if given else None,
        )
    except bert_data.DataError as exc:
        refuse(str(exc))  # rank 0 only: the others wait at the barrier, torchrun ends them
    tmp = marker.with_suffix(".tmp")
    written = {"prefix": prepared.prefix, "tokenizer_file": prepared.tokenizer_file}
    tmp.write_text(json.dumps(written))
    tmp.replace(marker)  # written last: a half-finished preparation is never reused


def build_data(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    """``(tokenizer, train dataset, valid dataset or None)``: megatron-core's
    ``BERTMaskedWordPieceDataset`` with enough samples for ``--train-iters`` global batches
    and one evaluation's ``--eval-iters`` (collective over all ranks). A tokenizer that does
    not load stops every rank (exit status 2, one line)."""
    import bert_data

    prefix, tokenizer_file, cache = resolve_data(args)
    try:
        tokenizer = bert_data.load_tokenizer(tokenizer_file, tokenizer_type(args))
    except bert_data.DataError as exc:
        refuse(str(exc))  # same files on every rank: every rank stops here
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
        f"data: {prefix} (tokenizer {tokenizer_file}, vocab {tokenizer.vocab_size}, seq "
        f"{args.seq_length}): {sizes} samples ({time.perf_counter() - started:.1f} s)"
    )
    return tokenizer, train, valid


def main(argv: Sequence[str] | None = None) -> int:
    """Parse, train, print ``SUMMARY {json}`` on the logging rank; 0 on success."""
    args = parse_args(argv)
    quiet_megatron_warnings()
    device = init_distributed(args)
    try:
        result = train(args, device, build_data(args))
        if is_logging_rank():
            print("SUMMARY " + json.dumps(result), flush=True)
        dist.barrier()  # no rank tears down its transport while a peer still reads
    finally:
        if "megatron.core" in sys.modules:
            from megatron_prt.megatron import teardown

            teardown()  # PRT's runtimes, megatron's groups, then every process group
        else:  # refused before megatron loaded: only the process group to end
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
