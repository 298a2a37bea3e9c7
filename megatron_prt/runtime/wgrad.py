"""Split backward's two halves for linear layers: ``I`` computes the input gradient and keeps
what the weight gradient needs; ``W`` later runs the weight-gradient GEMMs alone.

A split-capable linear layer (:func:`enable_split_backward` for ``nn.Linear``;
:mod:`megatron_prt.megatron.split` for megatron's parallel linears) is the plain layer,
except inside a :func:`split_forward` block (the executor opens one around every forward of
a split plan). There its forward goes through :class:`SplitLinear`, which gives the weight
and bias no autograd edge: the backward of that graph (``I``) computes only
``grad_input = grad_output @ weight`` and appends a :class:`WeightGradWork` (the layer's
saved input and its output gradient) to the open :func:`deferring_weight_grads` block (and
:func:`split_backward_pass`, open around that backward, lets a checkpointed region recompute
in the form its forward took). So
``I`` neither computes nor touches the weight's gradient, and no hook on its accumulator
fires early (megatron DDP's ``main_grad`` hook, torch DDP's reducer, post-accumulate hooks).
:func:`apply_weight_grads` is ``W``: per parameter ``grad_output^T @ input`` (and the bias
sum), handed to each parameter's gradient accumulator through the autograd engine, so
``.grad`` accumulates and those hooks fire as after a full backward. Nothing on the
input-gradient path is recomputed.

Parameters outside split-capable layers (norms, embeddings, attention projections called
through ``F.linear``, any unknown module) get their gradients in ``I``, from the same
autograd pass: the generic fallback, exact, at the cost of doing that part of ``W`` early.

Between ``I`` and ``W`` a stage holds, per split layer, its input (already saved by the
forward) and its output gradient: :func:`held_tensors`, which the executor's memory meter
counts (:mod:`megatron_prt.runtime.memory`).
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import NamedTuple

import torch
from torch.nn.utils import parametrize

from .memory import ActivationMeter


class WeightGradWork(NamedTuple):
    """One deferred weight-gradient GEMM: ``weight`` (and ``bias``, or None) receive
    ``grad_output^T @ input`` (and ``grad_output`` summed over all but its last dim).
    ``fused``: an accumulation that writes the weight gradient itself (megatron's gradient
    accumulation fusion into ``main_grad``) and returns the tensor to hand the weight's
    accumulator instead; None: the plain GEMM."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    input: torch.Tensor
    grad_output: torch.Tensor
    fused: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None


_splitting: list[bool] = [False]  # inside split_forward
_recomputing: list[bool] = [False]  # inside split_backward_pass
_FORM = "_prt_split_form"  # on a layer: whether its last forward took the split form


@contextlib.contextmanager
def split_forward(enabled: bool = True) -> Iterator[None]:
    """While open (and ``enabled``), split-capable layers build split-backward graphs."""
    with _flag(_splitting, enabled):
        yield


@contextlib.contextmanager
def split_backward_pass(enabled: bool = True) -> Iterator[None]:
    """While open (and ``enabled``): the backward of a split plan's forward, where a forward
    that runs is a recomputation and takes its forward's form ([Note: recompute sees the
    forward's form])."""
    with _flag(_recomputing, enabled):
        yield


@contextlib.contextmanager
def _flag(flag: list[bool], value: bool) -> Iterator[None]:
    before = flag[0]
    flag[0] = value
    try:
        yield
    finally:
        flag[0] = before


# [Note: recompute sees the forward's form] torch's non-reentrant checkpoint reruns a region's
# forward inside the backward and hands its saved tensors, by position, to the nodes the first
# forward built: the layers must take the form they took then, or the split nodes get a plain
# linear's tensors (same shapes: wrong weight gradients without a word; else torch's
# metadata error). So each forward records its form on its layer (not on the weight: a
# parametrized layer makes its weight anew at each access) and a recomputation in
# split_backward_pass reads it. A reentrant checkpoint (megatron's recomputation) runs its
# first forward without grad, records the plain form and recomputes plain: its layers' weight
# gradients stay in I ([Note: full recomputation has no W] in sim/cost.py).
def split_form(layer: torch.nn.Module) -> bool:
    """Whether the split-capable ``layer``, running now, takes its split form."""
    if _recomputing[0]:
        return torch.is_grad_enabled() and layer.__dict__.get(_FORM, False)
    form = _splitting[0] and torch.is_grad_enabled()
    layer.__dict__[_FORM] = form
    return form


# Where backward functions append their work: the list of the innermost open block. A plain
# global, not thread-local: on CUDA the autograd engine runs backward on its own thread.
_deferred: list[list[WeightGradWork]] = []


@contextlib.contextmanager
def deferring_weight_grads() -> Iterator[list[WeightGradWork]]:
    """While open, split-capable layers defer their weight gradients into the yielded list."""
    work: list[WeightGradWork] = []
    _deferred.append(work)
    try:
        yield work
    finally:
        _deferred.pop()


def defer(work: WeightGradWork) -> bool:
    """Record ``work`` in the open :func:`deferring_weight_grads` block; False when none is."""
    if not _deferred:
        return False
    _deferred[-1].append(work)
    return True


def weight_gemms(work: WeightGradWork) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(grad of weight, grad of bias or None)`` of one layer; inputs of any rank ``>= 1``
    (leading dims are tokens)."""
    grad_out = work.grad_output.reshape(-1, work.grad_output.shape[-1])
    inp = work.input.reshape(-1, work.input.shape[-1])
    grad_weight = grad_out.t().matmul(inp)
    grad_bias = grad_out.sum(dim=0) if work.bias is not None else None
    return grad_weight, grad_bias


def apply_weight_grads(works: Iterable[WeightGradWork], in_place: bool = False) -> None:
    """``W``: the weight GEMMs of ``works``, handed to the parameters' accumulators through
    the autograd engine (one call; a parameter used by several layers gets their sum), so
    every accumulator hook fires. ``in_place``: a parameter that has no tensor hooks gets
    its gradient without the engine: as ``grad += grad_output^T @ input`` in one GEMM where
    ``.grad`` already holds one, else by storing the GEMM's result as ``.grad`` (what the
    accumulator would store); only for parameters with no hook on their accumulator node
    either (the plain runtime's stages: nothing there registers one)."""
    grads: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def add(param: torch.Tensor, grad: torch.Tensor) -> None:
        if param.requires_grad:
            key = id(param)
            grads[key] = (param, grad if key not in grads else grads[key][1] + grad)

    for work in works:
        if work.fused is not None:
            add(work.weight, work.fused(work.input, work.grad_output))
            if work.bias is not None:
                add(work.bias, weight_gemms(work._replace(fused=None))[1])
        elif in_place and _without_hooks(work):
            _accumulate_in_place(work)
        else:
            grad_weight, grad_bias = weight_gemms(work)
            add(work.weight, grad_weight)
            if grad_bias is not None:
                add(work.bias, grad_bias)
    if grads:
        params, values = zip(*grads.values(), strict=True)
        torch.autograd.backward(params, values)


def _without_hooks(work: WeightGradWork) -> bool:
    """Whether ``work``'s parameters may bypass their accumulators: leaves needing a gradient,
    with no tensor hooks, of the GEMM's dtype, dense and laid out as the GEMM writes (a
    ``.grad`` stored by :func:`_accumulate_in_place` must be what the accumulator, which
    casts and re-lays out, would have stored)."""
    params = (work.weight,) if work.bias is None else (work.weight, work.bias)
    dtype = work.grad_output.dtype
    return work.input.dtype == dtype and all(
        p.requires_grad
        and p.is_leaf
        and p.dtype == dtype
        and p.is_contiguous()
        and (p.grad is None or p.grad.is_contiguous())
        and p._post_accumulate_grad_hooks is None
        and not p._backward_hooks
        for p in params
    )


@torch.no_grad()
def _accumulate_in_place(work: WeightGradWork) -> None:
    """``.grad += grad_output^T @ input`` (and the bias sum); a parameter without a gradient
    yet (the first W of a step after ``zero_grad(set_to_none=True)``) gets the GEMM's result
    itself. Through the engine that first W cost about two Ws: the GEMM into fresh memory,
    then the accumulator's copy of it (the caller still holds the result, so the
    accumulator cannot take it). A later W adds the GEMM's result as the accumulator does,
    not through ``addmm_``: a GEMM that accumulates into its output rounds differently on
    some CPUs (every case on an AMD EPYC's MKL, none on the Intel Xeon before it), and the
    gradients must be the engine's bit for bit."""
    grad_out = work.grad_output.reshape(-1, work.grad_output.shape[-1])
    inp = work.input.reshape(-1, work.input.shape[-1])
    weight, bias = work.weight, work.bias
    if weight.grad is None:
        weight.grad = grad_out.t().matmul(inp)
    else:
        weight.grad.add_(grad_out.t().matmul(inp))
    if bias is not None:
        if bias.grad is None:
            bias.grad = grad_out.sum(dim=0)
        else:
            bias.grad.add_(grad_out.sum(dim=0))


def held_tensors(works: Iterable[WeightGradWork]) -> list[torch.Tensor]:
    """What deferred ``works`` keep alive until ``W``: each layer's input and output gradient."""
    return [t for work in works for t in (work.input, work.grad_output)]


class SplitLinear(torch.autograd.Function):
    """``F.linear`` whose parameters reach it outside autograd (``params`` = (weight, bias),
    a tuple: no edge), so its backward yields the input gradient alone and defers the
    weight GEMMs (module docstring); outside a deferring block they are applied at once.
    ``extra`` = (reduce_input_grad, fused): a collective run on the input gradient (tensor
    parallelism), and :attr:`WeightGradWork.fused`; both may be None."""

    @staticmethod
    def forward(ctx, x, params, anchor, extra):
        weight, bias = params
        ctx.save_for_backward(x)
        ctx.params, ctx.extra = params, extra  # parameters: accumulators' targets
        if x.dim() == 2:
            out = torch.nn.functional.linear(x, weight, bias)
        else:
            # F.linear's own folding, but with an output that is no view: a view returned by
            # a custom Function may not be modified in place (megatron's bias-dropout-add is)
            out = torch.nn.functional.linear(x.reshape(-1, x.shape[-1]), weight, bias)
            out = torch.ops.aten._unsafe_view(out, (*x.shape[:-1], out.shape[-1]))
        ctx.compute_dtype = out.dtype  # under autocast, lower than x's and the weight's
        return out

    @staticmethod
    def backward(ctx, grad_output):
        """The GEMMs in the forward's dtype, as autocast's own linear backward runs them
        (backward runs outside the autocast region, and deferred W later still); the
        engine casts each gradient to its tensor's dtype."""
        (x,) = ctx.saved_tensors
        weight, bias = ctx.params
        reduce_input_grad, fused = ctx.extra
        dtype = ctx.compute_dtype
        grad_output, x = grad_output.to(dtype), x.to(dtype)  # no copy when equal
        grad_input = None
        if ctx.needs_input_grad[0]:
            grad_input = grad_output.matmul(weight.to(dtype))
            if reduce_input_grad is not None:
                reduce_input_grad(grad_input)
        work = WeightGradWork(weight, bias, x, grad_output, fused)
        if not defer(work):
            apply_weight_grads([work])
        return grad_input, None, None, None


def split_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    reduce_input_grad: Callable[[torch.Tensor], None] | None = None,
    fused: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """:class:`SplitLinear` of ``x``; an input without gradient (a first layer's data) is
    given a graph node through a gradient-free anchor, so its backward still runs."""
    anchor = None if x.requires_grad else _anchor(x)
    return SplitLinear.apply(x, (weight, bias), anchor, (reduce_input_grad, fused))


_ANCHORS: dict[tuple, torch.Tensor] = {}


def _anchor(x: torch.Tensor) -> torch.Tensor:
    """One empty leaf requiring grad per (device, dtype): it never receives a gradient."""
    key = (x.device, x.dtype)
    if key not in _ANCHORS:
        _ANCHORS[key] = torch.empty(0, device=x.device, dtype=x.dtype, requires_grad=True)
    return _ANCHORS[key]


# [Note: split-capable by class] A layer becomes split-capable by moving it to a subclass of
# its own class with a mixin first (:func:`make_split_capable`: the mixin's method, calling
# ``super()`` for the plain form), made once per class and kept in the mixin's module under a
# name that spells the base class (``SplitCapable:torch/nn/modules/linear:Linear``), which the
# module's ``__getattr__`` makes again in a process that has not: a whole model pickles and
# loads anywhere. An override kept on the layer itself (a method bound to it, or a partial of
# one) was a reference cycle: a model out of scope waited for the cyclic collector, and a
# forked rank that collected a copied model mid-step stalled its peer.
_SPLIT_CLASSES: dict[tuple[type, type], type] = {}
_PREFIX = "SplitCapable:"


def make_split_capable(layer: torch.nn.Module, mixin: type) -> None:
    """Move ``layer`` to the class ``(mixin, type(layer))`` (idempotent; [Note:
    split-capable by class])."""
    cls = type(layer)
    if not issubclass(cls, mixin):
        layer.__class__ = split_capable_class(mixin, cls)


def split_capable_class(mixin: type, cls: type) -> type:
    """The class ``(mixin, cls)``, made once and kept in ``mixin``'s module under the name
    that spells ``cls`` (its ``__qualname__`` for pickle)."""
    made = _SPLIT_CLASSES.get((mixin, cls))
    if made is None:
        spelled = f"{cls.__module__}:{cls.__qualname__}".replace(".", "/")
        name = _PREFIX + spelled
        made = type(f"SplitCapable{cls.__name__}", (mixin, cls), {"__module__": mixin.__module__})
        made.__qualname__ = name
        setattr(sys.modules[mixin.__module__], name, made)
        _SPLIT_CLASSES[mixin, cls] = made
    return made


def split_capable_lookup(mixin: type, name: str) -> type:
    """The module ``__getattr__`` of ``mixin``'s module: the split-capable class ``name``
    spells, made now (pickle asks for it by name in a process that has not made it)."""
    if not name.startswith(_PREFIX):
        raise AttributeError(f"module {mixin.__module__!r} has no attribute {name!r}")
    module, _, qualname = name.removeprefix(_PREFIX).replace("/", ".").partition(":")
    base = importlib.import_module(module)
    for part in qualname.split("."):
        base = getattr(base, part)
    return split_capable_class(mixin, base)


class SplitLinearForward:
    """The mixin of a split-capable ``nn.Linear``: inside :func:`split_forward` its forward
    goes through :class:`SplitLinear`; else it is the layer's own."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if split_form(self):
            return split_linear(x, self.weight, self.bias)
        return super().forward(x)


SplitCapableLinear = split_capable_class(SplitLinearForward, torch.nn.Linear)


def __getattr__(name: str) -> type:  # [Note: split-capable by class]
    return split_capable_lookup(SplitLinearForward, name)


def enable_split_backward(module: torch.nn.Module) -> int:
    """Make every ``nn.Linear`` of ``module`` without a forward of its own split-capable
    (inside :func:`split_forward` its forward goes through :class:`SplitLinear`; values and
    gradients are unchanged). Left alone, their weight gradients coming in I: subclasses
    with their own forward, and layers whose weight is not a parameter of their own
    (``torch.nn.utils.parametrize``, weight norm): a weight made anew at each access.
    Idempotent; returns how many layers are split-capable."""
    count = 0
    for layer in module.modules():
        if not isinstance(layer, torch.nn.Linear):
            continue
        if not isinstance(layer, SplitLinearForward):
            if type(layer).forward is not torch.nn.Linear.forward or not _own_weight(layer):
                continue
            make_split_capable(layer, SplitLinearForward)
        count += 1
    return count


def _own_weight(layer: torch.nn.Module) -> bool:
    """Whether ``layer.weight`` is a parameter registered on the layer itself."""
    own = dict(layer.named_parameters(recurse=False))
    return not parametrize.is_parametrized(layer) and "weight" in own


def measure_split_overhead(
    module: torch.nn.Module, x: torch.Tensor, repeats: int = 50
) -> dict[str, float]:
    """Seconds of a full backward (``B``) of ``module`` on ``x`` and of the same backward
    split into ``I`` then ``W`` (on a split-capable copy), alternating, as this thread's CPU
    time (other processes' load does not count), the least of ``repeats`` (warm, no
    interference): ``B``, ``I``, ``W`` and ``ratio`` = (I + W) / B; ``*_median`` too.
    Gradients accumulate across repeats, as over micro-batches. For benchmarks; the runtime
    does not call it."""
    split = copy.deepcopy(module)
    enable_split_backward(split)
    clock = time.thread_time
    times: dict[str, list[float]] = {"B": [], "I": [], "W": []}
    for _ in range(repeats + 3):  # 3 warm-up rounds
        x_in = x.detach().requires_grad_()
        out = module(x_in)
        grad = torch.ones_like(out)
        t0 = clock()
        torch.autograd.backward(out, grad)
        t1 = clock()
        x_in = x.detach().requires_grad_()
        with split_forward():
            out = split(x_in)
        t2 = clock()
        with deferring_weight_grads() as work:
            torch.autograd.backward(out, grad)
        t3 = clock()
        apply_weight_grads(work, in_place=True)
        t4 = clock()
        times["B"].append(t1 - t0)
        times["I"].append(t3 - t2)
        times["W"].append(t4 - t3)
    out_stats: dict[str, float] = {}
    for name, values in times.items():
        values = sorted(values[3:])
        out_stats[name] = values[0]
        out_stats[f"{name}_median"] = values[len(values) // 2]
    out_stats["ratio"] = (out_stats["I"] + out_stats["W"]) / out_stats["B"]
    out_stats["ratio_median"] = (out_stats["I_median"] + out_stats["W_median"]) / out_stats[
        "B_median"
    ]
    return out_stats


def measure_split_memory(
    module: torch.nn.Module, x: torch.Tensor, grad: torch.Tensor | None = None
) -> dict[str, int]:
    """Bytes ``module`` (a split-capable copy) holds for one input ``x``, counted as the
    runtime's meter counts them (:mod:`megatron_prt.runtime.memory`: by storage, parameters
    left out): ``act``, from its forward until I (what autograd saves, and ``x``, which the
    runtime keeps for its gradient); ``wact``, from I until W (each split layer's input and
    output gradient, :func:`held_tensors`). The cost model's per-layer ``act`` and ``wact``
    (:mod:`megatron_prt.sim.cost`). ``grad``: the output gradient (default ones)."""
    split = copy.deepcopy(module)
    enable_split_backward(split)
    meter = ActivationMeter(split.parameters())
    x_in = x.detach().requires_grad_()
    with split_forward(), meter.saving("forward"):
        out = split(x_in)
    meter.hold("forward", x_in)
    act = meter.held_bytes
    with deferring_weight_grads() as work:
        torch.autograd.backward(out, torch.ones_like(out) if grad is None else grad)
    meter.release("forward")
    for tensor in held_tensors(work):
        meter.hold("weight", tensor)
    return {"act": act, "wact": meter.held_bytes}
