"""Timing one micro-batch of a megatron-core model part by part (:mod:`.profile`): hooks at
the part boundaries (the embedding, each transformer layer, the head), whole passes, and
passes in the split form ([Note: the split form's own costs] in
:mod:`megatron_prt.sim.layer_cost`).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from functools import partial

import torch

from ..runtime.memory import ActivationMeter
from ..runtime.wgrad import (
    apply_weight_grads,
    deferring_weight_grads,
    held_tensors,
    split_forward,
)

Progress = Callable[[str], None]


class Parts:
    """Hooks that tell which part of the model runs (``"embedding"``, layer index,
    ``"head"``), for attributing saved tensors, and stamp the times at part boundaries."""

    def __init__(self, model: torch.nn.Module, kind: str) -> None:
        block = model.decoder if kind == "gpt" else model.encoder
        self.embedding = model.embedding
        self.layers = list(block.layers)
        self.cuda = next(model.parameters()).is_cuda
        self.current: object = "embedding"
        self.started = 0  # the layer that started last
        self.in_backward = False  # a recomputed layer's rerun forward is not a forward
        self.stamps: dict[tuple, float] = {}
        self.deferred: list | None = None  # a split pass's W work, appended in backward order
        self.marks: dict[object, int] = {}  # part -> len(deferred) when its backward began
        self._handles = [self.embedding.register_forward_hook(self._embedding_done)]
        for i, layer in enumerate(self.layers):
            self._handles.append(layer.register_forward_pre_hook(partial(self._layer_start, i)))
            self._handles.append(layer.register_forward_hook(partial(self._layer_done, i)))

    def names(self) -> list:
        return ["embedding", *range(len(self.layers)), "head"]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()

    def now(self) -> float:
        if self.cuda:  # kernels run asynchronously: a boundary is where they have finished
            torch.cuda.synchronize()
        return time.perf_counter()

    def stamp(self, *event) -> None:
        self.stamps[event] = self.now()

    def _embedding_done(self, module, args, output) -> None:
        if torch.is_grad_enabled() and output.requires_grad:
            output.register_hook(self._grad_hook("embedding"))

    def _layer_start(self, i, module, args) -> None:
        if self.in_backward:
            return
        self.current = self.started = i
        self.stamp("fwd", i)

    def _layer_done(self, i, module, args, output) -> None:
        if self.in_backward:
            return
        self.current = "head"
        self.stamp("fwd_end", i)
        hidden = output[0] if isinstance(output, tuple) else output
        if torch.is_grad_enabled() and hidden.requires_grad:
            hidden.register_hook(self._grad_hook(i))

    def _grad_hook(self, part):
        def hook(grad):
            self.stamp("grad", part)  # the gradient reached this part's output
            if self.deferred is not None:  # the W work so far is the later parts'
                self.marks[part] = len(self.deferred)

        return hook


@contextlib.contextmanager
def block_checkpoints(parts: Parts, on: bool) -> Iterator[None]:
    """Full recomputation: megatron's ``tensor_parallel.checkpoint`` runs a block of layers
    without autograd and saves the block's input after it ran, when the layer hooks already
    point past the layer; this attributes that save to the block's (one) layer and times
    its backward (recompute included) from a gradient hook on the block's output."""
    if not on:
        yield
        return
    from megatron.core import tensor_parallel

    original = tensor_parallel.checkpoint

    def checkpoint(function, distribute_saved_activations, *args):
        def run(*inputs):
            outputs = function(*inputs)
            parts.current = parts.started  # CheckpointFunction saves the input next
            return outputs

        outputs = original(run, distribute_saved_activations, *args)
        parts.current = "head"  # until the next layer starts
        hidden = outputs[0] if isinstance(outputs, tuple) else outputs
        if not parts.in_backward and torch.is_grad_enabled() and hidden.requires_grad:
            hidden.register_hook(parts._grad_hook(parts.started))
        return outputs

    tensor_parallel.checkpoint = checkpoint
    try:
        yield
    finally:
        tensor_parallel.checkpoint = original


def time_passes(step, parts: Parts, reps: int, say: Progress, split: bool = False) -> dict:
    """Median seconds per part over ``reps`` passes (one warm-up): ``fwd`` and ``bwd``.
    ``split``: the passes in the split form, the model's linear layers split-capable
    (``enable_megatron_split_backward``): the forward inside
    :func:`~megatron_prt.runtime.wgrad.split_forward`, ``bwd`` the backward with the weight
    GEMMs deferred (I), and ``wgrad`` each part's deferred GEMMs applied on their own (W)."""
    samples = []
    for rep in range(reps + 1):
        sample = _one_pass(step, parts, split)
        if rep > 0:
            samples.append(sample)
        kind = "split pass" if split else "pass"
        say(f"profile: {kind} {rep + 1}/{reps + 1} ({'warm-up' if rep == 0 else 'timed'})")
    return {
        key: {name: statistics.median(s[key][name] for s in samples) for name in parts.names()}
        for key in samples[0]
    }


def _one_pass(step, parts: Parts, split: bool) -> dict:
    """One stamped forward and backward (:func:`time_passes`). A part's W is the work its
    backward deferred: the work list's length is marked as each part's backward begins
    (backward runs head, layer n-1, ..., layer 0, embedding)."""
    parts.current, parts.marks = "embedding", {}
    parts.stamp("start")
    with split_forward(split):
        loss = step()
    parts.stamp("fwd_done")
    parts.in_backward = True
    try:
        with deferring_weight_grads() if split else contextlib.nullcontext() as work:
            parts.deferred = work
            loss.backward()
    finally:
        parts.in_backward, parts.deferred = False, None
    parts.stamp("bwd_done")
    fwd, bwd = durations(parts)
    if not split:
        return {"fwd": fwd, "bwd": bwd}
    wact = _weight_grad_bytes(parts, work)  # before W runs and lets them go
    return {"fwd": fwd, "bwd": bwd, "wact": wact, "wgrad": _time_weight_grads(parts, work)}


def durations(parts: Parts) -> tuple[dict, dict]:
    """Forward and backward seconds of each part in the pass just stamped."""
    t = parts.stamps
    n = len(parts.layers)
    fwd = {"embedding": t[("fwd", 0)] - t[("start",)]}
    for i in range(n):
        end = t[("fwd", i + 1)] if i + 1 < n else t[("fwd_end", i)]
        fwd[i] = end - t[("fwd", i)]
    fwd["head"] = t[("fwd_done",)] - t[("fwd_end", n - 1)]
    # Backward runs head, layer n-1, ..., layer 0, embedding; a part's backward ends when
    # the gradient reaches the output of the part before it.
    reached = [t[("grad", "embedding")]] + [t[("grad", i)] for i in range(n)]
    bwd = {"head": reached[n] - t[("fwd_done",)], "embedding": t[("bwd_done",)] - reached[0]}
    for i in range(n):
        bwd[i] = reached[i] - reached[i + 1]
    return fwd, bwd


def _part_work(parts: Parts, work: list) -> Iterator[tuple[object, list]]:
    """Each part with the deferred W work its backward left (:func:`_one_pass`), in
    backward order: head, layer n-1, ..., layer 0, embedding."""
    order = ["head", *reversed(range(len(parts.layers))), "embedding"]
    ends = [parts.marks.get(part, len(work)) for part in order[1:]] + [len(work)]
    first = 0
    for part, end in zip(order, ends, strict=True):
        yield part, work[first:end]
        first = end


def _time_weight_grads(parts: Parts, work: list) -> dict:
    """Seconds of each part's deferred weight GEMMs (:func:`_one_pass`)."""
    seconds = {}
    for part, own in _part_work(parts, work):
        start = parts.now()
        apply_weight_grads(own)
        seconds[part] = parts.now() - start
    return seconds


def _weight_grad_bytes(parts: Parts, work: list) -> dict:
    """Bytes each part's deferred W keeps alive from I until W runs (every split linear
    layer's input and output gradient, each storage once), counted as the runtime's meter
    counts them: the cost model's ``wact`` ([Note: the split form's own costs])."""
    held = {}
    for part, own in _part_work(parts, work):
        meter = ActivationMeter()
        for tensor in held_tensors(own):
            meter.hold(part, tensor)
        held[part] = meter.held_bytes
    return held


def time_stage_work(
    model: torch.nn.Module, kind: str, step: Callable, hidden: torch.Tensor, reps: int
) -> tuple[float, float]:
    """Median seconds a middle model chunk (``model``: no embedding, no head) spends outside
    its layers in ``step(model, input)`` (megatron's ``schedules.forward_step`` as the
    pipeline runs it) and in the backward from its output to ``hidden``'s gradient, over
    ``reps`` passes after one warm-up ([Note: every stage pays its step's work] in
    :mod:`megatron_prt.sim.cost`); never below 0."""
    block = model.decoder if kind == "gpt" else model.encoder
    first, last = block.layers[0], block.layers[-1]
    cuda = hidden.is_cuda
    marks: dict[str, float] = {}

    def now() -> float:
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def mark(name: str) -> Callable:
        return lambda *_: marks.__setitem__(name, now())

    def last_done(module, args, output) -> None:
        marks["layers_end"] = now()
        out = output[0] if isinstance(output, tuple) else output
        out.register_hook(mark("grad_in"))

    handles = [first.register_forward_pre_hook(mark("layers_start"))]
    handles.append(last.register_forward_hook(last_done))
    outside: list[tuple[float, float]] = []
    try:
        for _ in range(reps + 1):
            x = hidden.detach().clone().requires_grad_(True)
            x.register_hook(mark("grad_out"))
            start = now()
            out = step(model, x)
            forward = now() - start - (marks["layers_end"] - marks["layers_start"])
            start = now()
            torch.autograd.backward(out, torch.ones_like(out))
            backward = now() - start - (marks["grad_out"] - marks["grad_in"])
            outside.append((forward, backward))
    finally:
        for handle in handles:
            handle.remove()
    fwd, bwd = (statistics.median(column) for column in zip(*outside[1:], strict=True))
    return max(fwd, 0.0), max(bwd, 0.0)
