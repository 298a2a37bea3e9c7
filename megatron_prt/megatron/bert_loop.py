"""The training loop of ``examples/pretrain_bert.py``: steps, Megatron-LM-style progress lines,
evaluation, checkpoints, TensorBoard scalars and the run's one-line JSON summary.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..tune.plan_file import describe_recompute, recompute_setting
from .bert_checkpoint import load_checkpoint, save_checkpoint
from .bert_setup import build_model, build_training, is_logging_rank, log, padded_vocab_size
from .bert_step import (
    Launch,
    MicroBatchSampler,
    TrainState,
    evaluate,
    microbatches_per_iteration,
    train_step,
)
from .pipeline_probe import PipelineProbe, predicted_bubble
from .plan_flag import warn_other_vocabulary


@dataclass
class Meters:
    """Per-iteration numbers of this process's run, for the log lines and the summary."""

    losses: list[dict[str, float]] = field(default_factory=list)  # on pipeline rank P-1
    times_s: list[float] = field(default_factory=list)
    bubbles: list[tuple[int, float]] = field(default_factory=list)  # (iteration, bubble)
    last_valid: dict[str, float] = field(default_factory=dict)


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
        "tensor_model_parallel_size": args.tensor_model_parallel_size,
        "pipeline_model_parallel_size": args.pipeline_model_parallel_size,
        "data_parallel_size": args.data_parallel_size,
        "reuse": None if reuse is None else reuse.placement.reuse,
        "placement": None if reuse is None else reuse.placement.placement,
        "direction": None if reuse is None else reuse.placement.direction,
        "stage_layers": None if reuse is None else list(reuse.layers_per_stage()),
        "split_backward": None if reuse is None else reuse.splits_backward,
        "recompute": _recompute(args),
        "transformer_impl": args.transformer_impl,
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
        "predicted_bubble": predicted_bubble(reuse, micro, probe.plan),  # uniform stages
        "tuned_bubble": None if reuse is None else reuse.tuned_bubble,  # under the plan's costs
        "peak_activation_bytes": probe.peak_bytes,
        "trace": _trace_files(reuse),
    }


def _schedule_name(reuse) -> str:
    return "megatron" if reuse is None else reuse.name


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


def train(args: argparse.Namespace, device: torch.device, data: tuple) -> dict:
    """The whole run over ``data`` = ``(tokenizer, train dataset, valid dataset or None)``
    (megatron-core BERT datasets); returns the summary (meaningful on the logging rank)."""
    from megatron.core import parallel_state, pipeline_parallel

    from .installer import install

    tokenizer, train_data, valid_data = data
    vocab_size = padded_vocab_size(tokenizer.vocab_size, args.make_vocab_size_divisible_by)
    args.vocab_size, args.padded_vocab_size = tokenizer.vocab_size, vocab_size  # checkpoints
    args.tokenizer_type, args.vocab_digest = tokenizer.tokenizer_type, tokenizer.vocab_digest
    if args.reuse is not None:
        warn_other_vocabulary(args.reuse.recorded_vocab, tokenizer.vocab_size, vocab_size)
    config, chunks = build_model(args, vocab_size, device)
    training, scheduler = build_training(args, config, chunks)
    if args.reuse is not None:
        install(args.reuse)  # megatron's get_forward_backward_func() now returns PRT's
    forward_backward = pipeline_parallel.get_forward_backward_func()
    dp_rank = parallel_state.get_data_parallel_rank()
    sampler = MicroBatchSampler(train_data, args.micro_batch_size, dp_rank, args.data_parallel_size)
    state = TrainState(training.chunks, training.optimizer, scheduler, sampler)
    if getattr(forward_backward, "auto", None) is not None:
        state.auto_schedule = forward_backward  # a checkpoint saves its pick, a resume runs it
    if args.load is not None:
        load_checkpoint(args, state)
    microbatches = microbatches_per_iteration(args)
    _log_start(args, state.chunks, microbatches)
    loop = _Loop(Launch(args, device, microbatches), state, forward_backward, valid_data)
    loop.run()
    return summary(args, state, loop.meters, loop.probe, microbatches)


def _log_start(args: argparse.Namespace, chunks: list, microbatches: int) -> None:
    params = sum(p.numel() for chunk in chunks for p in chunk.parameters())
    counts: list = [None] * dist.get_world_size()
    dist.all_gather_object(counts, params)
    log(
        f"schedule {'megatron' if args.reuse is None else args.reuse.describe()}: "
        f"{args.world_size} ranks (tensor "
        f"{args.tensor_model_parallel_size} x pipeline {args.pipeline_model_parallel_size} "
        f"x data {args.data_parallel_size}), "
        f"{len(chunks)} chunk(s) per rank, {microbatches} micro-batches per iteration, "
        f"{args.transformer_impl} layers, recomputation {_recompute(args)}; parameters per "
        f"rank {counts}"
    )


def _recompute(args: argparse.Namespace) -> str:
    """The run's activation recomputation in words, e.g. ``full (uniform, 1 layer(s))``."""
    return describe_recompute(
        recompute_setting(
            args.recompute_granularity, args.recompute_method, args.recompute_num_layers
        )
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
