"""What a message between stages must be: a tensor of the runtime's dtype, of the shape its
edge carried first (unless the runtime takes variable shapes). Every transport refuses the
rest alike (:mod:`.p2p`), with errors that name the stage, the micro-batch and the fix."""

from __future__ import annotations

import time
from collections.abc import Mapping

import torch

_KINDS = {"act": "activation", "grad": "gradient", "R": "replica gradient"}  # message_key kinds


def check_edge_shape(shapes: Mapping[tuple, torch.Size], key: tuple, tensor: torch.Tensor) -> None:
    """Refuse a message whose shape is not the first one its edge carried (``shapes``: edge
    -> that shape), as every transport does without ``variable_shapes``: the torch transport
    posts its receives at the known shapes, so the shared-memory one, which could carry any,
    refuses too (a script that ran on one CPU host would fail on GPUs)."""
    known = shapes.get(key[:3])
    if known is not None and tensor.shape != known:
        raise ValueError(
            f"stage {key[1]}, mb {key[3]}: the {_KINDS.get(key[0], key[0])} sent to stage "
            f"{key[2]} has shape {tuple(tensor.shape)}, the first on this edge had "
            f"{tuple(known)}: micro-batches whose shapes differ need "
            "PipelineRuntime(..., variable_shapes=True) (megatron: TransformerConfig("
            "variable_seq_lengths=True)) or the same shape for all"
        )


def message_not_sendable(key: tuple, tensor: object, dtype: torch.dtype | None) -> Exception:
    """The error for a message that is not a tensor of the runtime's dtype."""
    kind = _KINDS.get(key[0], key[0])
    return not_sendable(
        f"stage {key[1]}, mb {key[3]}: the {kind} sent to stage {key[2]}", tensor, dtype
    )


def not_sendable(where: str, tensor: object, dtype: torch.dtype | None) -> TypeError:
    """The error for ``tensor`` (described by ``where``) that is not a tensor of ``dtype``,
    the runtime's: what a stage must return, and the fix."""
    if not isinstance(tensor, torch.Tensor):
        return TypeError(
            f"{where} is a {type(tensor).__name__}, not a tensor: a stage must return one "
            "tensor (pack several into one, or unpack them inside the next stage)"
        )
    return TypeError(
        f"{where} is {tensor.dtype}, the runtime sends {dtype}: pass "
        f"PipelineRuntime(..., dtype={tensor.dtype}) (megatron: TransformerConfig."
        f"pipeline_dtype) or cast the model to {dtype}"
    )


# [Note: every message carries its step] Messages between two ranks are matched by their
# order alone: ranks that disagree on a step (one calls step(forward_only=True) where its
# peer trains, or calls step() once more) leave messages one of them never reads, and the
# next steps read them as their own, training on another step's gradients without a word
# (1.5-1.8 relative off). So every message carries its step's stamp, the count of steps
# this runtime began and whether the step is forward-only; the shared-memory transport
# refuses one of another stamp when it hands it to a receive, the torch transport sends it
# as the message tag, so no receive of another step can match it (the wait times out).
# NCCL ignores tags: on it the runtime gathers every rank's stamp at the start of each step
# instead (one small all_gather per step, :data:`TAGS_IGNORED_BY`).
TAGS_IGNORED_BY = ("nccl",)  # backends whose p2p ignores tags: the step is gathered


def step_stamp(steps_begun: int, forward_only: bool) -> int:
    """The stamp of the step after ``steps_begun`` earlier ones: below 2**31 (a tag)."""
    return (2 * steps_begun + int(forward_only)) % (1 << 31)


def other_step(src: int, theirs: int, mine: int) -> RuntimeError:
    """The error for a message of stamp ``theirs`` from rank ``src`` received in a step of
    stamp ``mine`` ([Note: every message carries its step])."""

    return RuntimeError(
        f"a message from rank {src} belongs to its {step_said(theirs)}, this rank runs its "
        f"{step_said(mine)}: {SAME_STEPS}"
    )


SAME_STEPS = (
    "every rank must call step() alike (the same forward_only, the same number of times) "
    "and build a new runtime after a failed step"
)


def step_said(stamp: int) -> str:
    """A step stamp in words: ``step 3 (training)``."""
    kind = "forward-only" if stamp & 1 else "training"
    return f"step {stamp // 2 + 1} ({kind})"


def check_activation(stage: int, mb: int, out: object, dtype: torch.dtype, training: bool) -> None:
    """Refuse a stage output the next stage cannot take, before any transport sees it (a
    same-rank hand-off passes it directly, so only a send would find it, and the shared
    memory rings carry any dtype: a model would run under one layout or transport and fail
    under another)."""
    if isinstance(out, torch.Tensor) and out.dtype == dtype:
        return
    where = f"stage {stage}, mb {mb}: the stage's output"
    if training and isinstance(out, torch.Tensor) and not out.is_floating_point():
        raise TypeError(
            f"{where} is {out.dtype}: activations between stages carry gradients and must be "
            "floating point (e.g. embed token ids inside the stage that reads them)"
        )
    raise not_sendable(where, out, dtype)


def synced_clock(device: torch.device) -> float:
    """``time.perf_counter()`` once the work queued on ``device``'s current (compute) stream
    has run: a CUDA span's end. Not ``torch.cuda.synchronize``, which also waits for the
    communication streams' open sends and early receives: two ranks could each wait there
    for a receive the other posts only after its own span ends."""
    torch.cuda.current_stream(device).synchronize()
    return time.perf_counter()
