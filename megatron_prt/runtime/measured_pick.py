"""The measured final pick on real ranks ([Note: measured final pick] in
:mod:`megatron_prt.tune.measured`): the tuner's top candidates, each built as a runner, timed
in place with interleaved repetitions; the fastest median wins, the same on every rank.

Plain PyTorch, for a layout that stays (``tune_layout``: every candidate runs on the same
stage modules)::

    from megatron_prt.runtime.measured_pick import pick_plan
    from megatron_prt.tune.measured import top_candidates

    result = tune_layout(cost, placement, m)                  # on every rank (or broadcast)
    picked = pick_plan(top_candidates(result, 5), stages, loss_fn, xs, ys)
    runtime = PipelineRuntime(picked.winner.plan, stages, loss_fn)

Candidates with other placements or splits need their own stage modules: build a runner per
candidate (anything with ``step()`` and ``zero_grad()``) and call :func:`measured_pick`.
A caller whose steps are driven from outside (``--pipeline-reuse auto``: megatron's training
loop) times each with :func:`slowest_step_seconds`, picks with
:func:`~megatron_prt.tune.measured.fastest` and checks the ranks agree with
:func:`check_same_pick`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

import torch
import torch.distributed as dist

from ..core.placement import ConfigError
from ..tune.measured import MeasuredPick, pick_fastest
from ..tune.search_plans import Candidate
from .executor import PipelineRuntime
from .p2p import wire_device

T = TypeVar("T")


class Runner(Protocol):
    """One candidate, ready to run: ``step()`` one training step (inputs its own),
    ``zero_grad()`` before it."""

    def step(self) -> None: ...

    def zero_grad(self) -> None: ...


def measured_pick(
    candidates: Sequence[T],
    runners: Sequence[Runner],
    reps: int = 5,
    warmup: int = 1,
    step_seconds: Callable[[int], float] | None = None,
    group: dist.ProcessGroup | None = None,
    device: torch.device | str = "cpu",
    warm_steps: int = 0,
) -> MeasuredPick[T]:
    """Time ``reps`` steps of each ``runners[i]`` (candidate ``i``) after ``warmup``
    untimed ones, interleaved, and pick the smallest median (collective over ``group``).

    A step's time is the slowest rank's (barrier, step, all-reduce max), so every rank
    holds the same numbers and picks the same candidate; the picks are gathered and, should
    they differ, every rank raises. ``step_seconds(i)``, when given, replaces the clock:
    this rank's seconds for one step of candidate ``i`` (tests). ``device``: where the
    runners compute (a CUDA step is synchronized before the clock stops; the group's
    collectives get tensors where its backend takes them). ``warm_steps``: untimed steps of
    a runner right before each of its timed ones ([Note: warm timed steps] at
    :func:`slowest_step_seconds`). The runners stay open (the caller owns them); gradients
    they leave are the last timed step's."""
    if len(candidates) != len(runners):  # every rank gets the same lists: all raise
        raise ConfigError(f"{len(candidates)} candidates but {len(runners)} runners")
    device = torch.device(device)
    wire = wire_device(group, device)
    for _ in range(warmup):  # shapes exchanged, buffers and allocator primed
        for runner in runners:
            runner.zero_grad()
            runner.step()
    local = step_seconds or (lambda i: _step_seconds(runners[i], group, device, warm_steps))
    picked = pick_fastest(candidates, lambda i: _slowest(local(i), group, wire), reps)
    check_same_pick(picked.index, group)
    return picked


def check_same_pick(
    index: int, group: dist.ProcessGroup | None = None, who: str = "measured pick", fix: str = ""
) -> None:
    """Collective over ``group``: gather every rank's picked candidate ``index``; should
    they differ, every rank raises (none goes on into a collective the others skip), naming
    which ranks picked which. ``who`` opens the message, ``fix`` ends it."""
    chosen = [None] * dist.get_world_size(group)
    dist.all_gather_object(chosen, index, group=group)
    if len(set(chosen)) > 1:
        ranks = {pick: [r for r, c in enumerate(chosen) if c == pick] for pick in chosen}
        by_pick = "; ".join(f"candidate {pick} on ranks {ranks[pick]}" for pick in sorted(ranks))
        raise ConfigError(
            f"{who}: the ranks found different candidates fastest ({chosen}, in group rank "
            f"order: {by_pick}) from timings that should be the same on every rank{fix}"
        )


def slowest_step_seconds(
    runner: Runner,
    group: dist.ProcessGroup | None = None,
    device: torch.device | str = "cpu",
    local_seconds: Callable[[], float] | None = None,
    warm_steps: int = 0,
) -> float:
    """One timed step of ``runner`` (gradients zeroed off the clock, a barrier, the step):
    the slowest rank's seconds, the same on every rank of ``group`` (collective).
    ``warm_steps`` untimed steps of the same runner go first ([Note: warm timed steps]).
    ``local_seconds``, when given, replaces the clock: this rank's seconds for the step,
    which still runs (tests).

    [Note: warm timed steps] In interleaved rounds over many runners a step is timed right
    after the other runners' steps have pushed this one's weights, activations and message
    rings out of the caches, while a training run steps one runtime over and over. An
    untimed step of the same runner right before the timed one times the warm regime while
    the rounds still spread the host's drift over every runner; it doubles the steps run.
    The tuned grid takes it as ``--warm-steps`` (docs/tune.md has launches with and
    without)."""
    device = torch.device(device)
    seconds = _step_seconds(runner, group, device, warm_steps)
    if local_seconds is not None:
        seconds = local_seconds()
    return _slowest(seconds, group, wire_device(group, device))


def _step_seconds(runner: Runner, group, device: torch.device, warm_steps: int = 0) -> float:
    if warm_steps < 0:  # range() would take it as 0: say so instead
        raise ConfigError(f"warm_steps must be >= 0 untimed steps, got {warm_steps}")
    for _ in range(warm_steps):
        runner.zero_grad()
        runner.step()
    if warm_steps and device.type == "cuda":  # the warm steps' kernels off the clock
        torch.cuda.synchronize(device)
    runner.zero_grad()
    dist.barrier(group=group)
    start = time.perf_counter()
    runner.step()
    if device.type == "cuda":  # the clock stops when the kernels are done, not queued
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def _slowest(seconds: float, group, wire: torch.device) -> float:
    shared = torch.tensor([seconds], dtype=torch.float64, device=wire)
    dist.all_reduce(shared, op=dist.ReduceOp.MAX, group=group)
    return float(shared)


class RuntimeRunner:
    """A :class:`PipelineRuntime` of ``plan`` on ``stages`` with fixed inputs (the
    :class:`Runner` of :func:`pick_plan`); ``runtime_kwargs`` go to the runtime."""

    def __init__(self, plan, stages: dict, loss_fn, xs, ys, **runtime_kwargs) -> None:
        self.stages = stages
        self.runtime = PipelineRuntime(plan, stages, loss_fn, **runtime_kwargs)
        self.xs, self.ys = xs, ys

    def step(self) -> None:
        self.runtime.step(self.xs, self.ys)
        if self.runtime.plan.placement.direction == "bi":  # a bi step sums the replicas
            self.runtime.reduce_replica_grads()

    def zero_grad(self) -> None:
        for module in self.stages.values():
            module.zero_grad(set_to_none=True)

    def close(self) -> None:
        self.runtime.close()


def pick_plan(
    candidates: Sequence[Candidate],
    stages: dict,
    loss_fn,
    xs,
    ys,
    reps: int = 5,
    warmup: int = 1,
    group: dist.ProcessGroup | None = None,
    **runtime_kwargs,
) -> MeasuredPick[Candidate]:
    """:func:`measured_pick` of ``candidates`` that share one layout (placement and layer
    split, as :func:`~megatron_prt.tune.search_plans.tune_layout`'s do), each run on
    ``stages`` with inputs ``xs`` / targets ``ys`` (this rank's, as ``PipelineRuntime.step``
    takes them). ``runtime_kwargs`` go to every candidate's ``PipelineRuntime`` (e.g.
    ``dtype=torch.float64`` for float64 stages, ``transport=``). Collective. The model is
    left as it was: the parameters (no optimizer step), the buffers (BatchNorm's running
    statistics move in every timed forward) and the random number generators (dropout
    draws) are restored; the gradients are zeroed."""
    layouts = {(c.plan.placement, tuple(c.stage_layers)) for c in candidates}
    if len(layouts) > 1:
        raise ConfigError(
            "pick_plan: the candidates need different stage modules (placements or layer "
            "splits differ); build a runner per candidate and call measured_pick"
        )
    buffers = [(b, b.detach().clone()) for m in stages.values() for b in m.buffers()]
    cuda = [torch.cuda.current_device()] if torch.cuda.is_initialized() else []
    runners = [RuntimeRunner(c.plan, stages, loss_fn, xs, ys, **runtime_kwargs) for c in candidates]
    try:
        device = runners[0].runtime.device if runners else "cpu"
        with torch.random.fork_rng(devices=cuda):
            return measured_pick(candidates, runners, reps, warmup, group=group, device=device)
    finally:
        for runner in runners:
            runner.close()
        with torch.no_grad():
            for buffer, before in buffers:
                buffer.copy_(before)
        for module in stages.values():
            module.zero_grad(set_to_none=True)
