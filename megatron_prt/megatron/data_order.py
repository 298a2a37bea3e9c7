"""The order of pretrain_bert's training samples, recorded in its checkpoints and compared on
resume (:mod:`.bert_checkpoint`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from .bert_step import TrainState

# [Note: the data order on resume] megatron maps whole passes over the training documents,
# enough for --train-iters global batches, and shuffles all their samples together under
# --seed; the checkpoint keeps only the position (consumed samples). A resumed run whose
# mapping differs (more passes for a longer --train-iters, another --seed, --split or
# --seq-length) reads that position in another order: samples already seen come again and
# others never, without a word. So the order's inputs are saved, and a difference is
# refused unless --allow-new-data-order says it is meant.
DATA_ORDER_FLAGS = {"seed": "--seed", "split": "--split", "seq_length": "--seq-length"}


def data_order(args: argparse.Namespace, state: TrainState) -> dict:
    """What fixes the order of the training samples: :data:`DATA_ORDER_FLAGS` and the
    number of samples megatron mapped (whole passes: ``train_samples``)."""
    order = {name: getattr(args, name) for name in DATA_ORDER_FLAGS}
    return {**order, "train_samples": len(state.sampler.dataset)}


def other_data_order(args: argparse.Namespace, saved: dict, state, folder: Path) -> str | None:
    """Why the checkpoint's samples came in another order than this run's would (see
    [Note: the data order on resume]); None when they come alike, the checkpoint predates
    the record, or ``--allow-new-data-order``."""
    theirs = saved.get("data_order")
    if theirs is None or args.allow_new_data_order:
        return None
    ours = data_order(args, state)
    differ = [
        f"{flag} {theirs[name]} there, {ours[name]} here"
        for name, flag in DATA_ORDER_FLAGS.items()
        if theirs[name] != ours[name]
    ]
    if theirs["train_samples"] != ours["train_samples"]:
        differ.append(
            f"--train-iters {args.train_iters} x --global-batch-size {args.global_batch_size} "
            f"maps {ours['train_samples']} training samples (whole passes over the data, as "
            f"the data and the flags above cut them), its run mapped {theirs['train_samples']}"
        )
    if not differ:
        return None
    return (
        f"{folder}: the training samples would come in another order ({'; '.join(differ)}): "
        f"megatron shuffles all mapped samples together, so the saved position "
        f"({saved['consumed_samples']} samples) would repeat some and skip others; give the "
        "flags it was saved with (a --train-iters within as many passes), or pass "
        "--allow-new-data-order to accept the new order"
    )
