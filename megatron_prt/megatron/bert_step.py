"""One step of ``examples/pretrain_bert.py``: micro-batches in megatron's sequential order,
megatron's ``forward_step_func`` with Megatron-LM's BERT loss, a training step (forward-backward,
optimizer, scheduler) and the forward-only evaluation.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from .bert_args import stop


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


@dataclass
class TrainState:
    """Everything a resumed run needs besides the flags."""

    chunks: list
    optimizer: Any
    scheduler: Any
    sampler: MicroBatchSampler
    iteration: int = 0
    auto_schedule: Any = None  # PRT's forward-backward function under --pipeline-reuse auto


def microbatches_per_iteration(args: argparse.Namespace) -> int:
    """Micro-batches each data-parallel rank runs per iteration."""
    return args.global_batch_size // (args.micro_batch_size * args.data_parallel_size)


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
    losses = mean_losses(store, launch.device)
    check = launch.args.check_for_nan_in_loss_and_grad
    if check:
        stop_on_nonfinite_loss(losses, state.iteration + 1, launch)
    updated, grad_norm, _ = state.optimizer.step()
    if updated:  # a skipped fp16 step (overflow) does not advance the schedule
        state.scheduler.step(increment=launch.args.global_batch_size)
    # the gradient norm is reduced over all ranks: every rank stops alike
    if check and updated and grad_norm is not None and not math.isfinite(grad_norm):
        stop(f"iteration {state.iteration + 1}: grad norm {grad_norm} is not finite; {_FIX}", 1)
    if launch.device.type == "cuda":
        torch.cuda.synchronize(launch.device)
    seconds = time.perf_counter() - started
    return losses, grad_norm, seconds


_FIX = "lower --lr or --clip-grad, or pass --no-stop-on-nan to train on"


def stop_on_nonfinite_loss(losses: dict[str, float], iteration: int, launch: Launch) -> None:
    """Exit (status 1, before the optimizer step) on every rank of the pipeline when a loss of
    ``iteration`` is NaN or infinite: the last pipeline rank's ``losses`` (the mean over the
    data-parallel replicas, so every replica decides alike) are broadcast over the pipeline
    group. Collective."""
    from megatron.core import parallel_state

    names = ["lm loss", "sop loss"] if launch.args.bert_binary_head else ["lm loss"]
    values = torch.tensor(
        [losses.get(name, 0.0) for name in names], dtype=torch.float64, device=launch.device
    )
    group = parallel_state.get_pipeline_model_parallel_group()
    if dist.get_world_size(group) > 1:
        last = parallel_state.get_pipeline_model_parallel_last_rank()
        dist.broadcast(values, src=last, group=group)
    shared = dict(zip(names, values.tolist(), strict=True))
    if all(math.isfinite(value) for value in shared.values()):
        return
    text = ", ".join(f"{name} {value}" for name, value in shared.items())
    stop(f"iteration {iteration}: {text} is not finite; {_FIX}", 1)


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
