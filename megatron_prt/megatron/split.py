"""Split backward for megatron-core models: megatron's linear layers made split-capable.

megatron-core 0.16.1 defers weight gradients only in Transformer Engine layers
(``config.delay_wgrad_compute`` with TE >= 2.3, ``backward_dw``) and, for the output
embedding alone, with ``defer_embedding_wgrad_compute``; its local-spec
``ColumnParallelLinear`` / ``RowParallelLinear`` compute input and weight gradients in one
autograd Function (``LinearWithGradAccumulationAndAsyncCommunication``). Both layers call
``self._forward_impl(input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad,
sequence_parallel, grad_output_buffer, wgrad_deferral_limit, tp_group)``: that one method is
overridden by moving each layer to a subclass (:class:`SplitForwardImpl` first; [Note:
split-capable by class] in megatron_prt/runtime/wgrad.py), so inside
:func:`megatron_prt.runtime.wgrad.split_forward` the product goes through
:func:`megatron_prt.runtime.wgrad.split_linear` with megatron's semantics:

* the input gradient is ``grad_output @ weight``, all-reduced over the tensor-parallel
  group when ``allreduce_dgrad`` (as megatron, before the weight GEMM);
* ``W``, under megatron's DDP (a weight with ``main_grad``), accumulates
  ``grad_output^T @ input`` straight into ``main_grad`` (megatron's fused kernel with
  ``gradient_accumulation_fusion``, CUDA + APEX; else the GEMM's result added as DDP's hook
  adds it), marks
  ``grad_added_to_main_grad`` and hands the weight's accumulator megatron's dummy, as
  megatron's own fusion branch does: DDP's hook fires after every W and adds nothing twice.
  Without DDP the product goes to the accumulator (``.grad``).

Left on megatron's path (weight gradient in ``I``, still exact): a column layer under
sequence parallelism (its weight GEMM needs the all-gathered input again), the deferred
output-embedding gradient (``defer_embedding_wgrad_compute``), frozen weights, and every
parameter outside linear layers (embeddings, norms). BERT's heads are ``torch.nn.Linear``:
:func:`megatron_prt.runtime.wgrad.enable_split_backward` covers them. TE layers
(``delay_wgrad_compute``) are not wired: this integration runs the local spec.
"""

from __future__ import annotations

import functools

import torch
from megatron.core.tensor_parallel import layers as tp_layers

from ..runtime.wgrad import (
    enable_split_backward,
    make_split_capable,
    split_capable_class,
    split_capable_lookup,
    split_form,
    split_linear,
)

_SPLIT_LINEARS = (tp_layers.ColumnParallelLinear, tp_layers.RowParallelLinear)


def enable_megatron_split_backward(chunks: list) -> int:
    """Make megatron's parallel linear layers and plain ``nn.Linear`` layers of ``chunks``
    split-capable (idempotent); returns how many layers are."""
    count = 0
    for chunk in chunks:
        for layer in chunk.modules():
            if isinstance(layer, _SPLIT_LINEARS):
                make_split_capable(layer, SplitForwardImpl)
                count += 1
        count += enable_split_backward(chunk)
    return count


class SplitForwardImpl:
    """The mixin of a split-capable megatron parallel linear ([Note: split-capable by class]
    in megatron_prt/runtime/wgrad.py): its ``_forward_impl`` is :func:`_forward_impl` over
    megatron's own."""

    def _forward_impl(self, *args, **kwargs) -> torch.Tensor | tuple:
        return _forward_impl(super()._forward_impl, self, *args, **kwargs)


for _linear in _SPLIT_LINEARS:  # made at import: [Note: split-capable by class] in wgrad.py
    split_capable_class(SplitForwardImpl, _linear)


def __getattr__(name: str) -> type:  # the others when pickle asks for them
    return split_capable_lookup(SplitForwardImpl, name)


def _forward_impl(
    original,
    layer,
    input,
    weight,
    bias=None,
    gradient_accumulation_fusion=False,
    allreduce_dgrad=False,
    sequence_parallel=False,
    grad_output_buffer=None,
    wgrad_deferral_limit=None,
    tp_group=None,
    **newer,
):
    # ``newer``: arguments of later megatron-core versions, passed on as given (0.19 adds
    # ``gtp_remat_size``: above 1 the weight is sharded and gathered in megatron's Function)
    megatron_only = sequence_parallel or grad_output_buffer is not None
    megatron_only = megatron_only or newer.get("gtp_remat_size", 1) > 1
    if megatron_only or not (split_form(layer) and weight.requires_grad):
        return original(
            input=input,
            weight=weight,
            bias=bias,
            gradient_accumulation_fusion=gradient_accumulation_fusion,
            allreduce_dgrad=allreduce_dgrad,
            sequence_parallel=sequence_parallel,
            grad_output_buffer=grad_output_buffer,
            wgrad_deferral_limit=wgrad_deferral_limit,
            tp_group=tp_group,
            **newer,
        )
    reduce = functools.partial(_all_reduce, tp_group) if allreduce_dgrad else None
    fused = None
    if hasattr(weight, "main_grad"):
        kernel = _fused_wgrad if gradient_accumulation_fusion else _main_grad_wgrad
        fused = functools.partial(kernel, weight, weight.main_grad)
    return split_linear(input, weight, bias, reduce, fused)


def _all_reduce(group, grad_input: torch.Tensor) -> None:
    torch.distributed.all_reduce(grad_input, group=group)


@torch.no_grad()
def _main_grad_wgrad(weight, main_grad, inp: torch.Tensor, grad_output: torch.Tensor):
    """Under megatron's DDP without the fused kernel: the GEMM's result is added to the grad
    buffer (``main_grad``) as DDP's hook would add it (a GEMM accumulating into the buffer,
    ``addmm_``, rounds differently on some CPUs: see
    :func:`megatron_prt.runtime.wgrad._accumulate_in_place`), then the accumulator gets
    megatron's dummy so DDP's hook runs (and adds nothing), as in megatron's fusion branch."""
    grad_output, inp = tp_layers.prepare_input_tensors_for_wgrad_compute(grad_output, inp)
    main_grad.add_(grad_output.t().matmul(inp))
    return _dummy_wgrad(weight, main_grad, inp.dtype)


@torch.no_grad()
def _fused_wgrad(weight, main_grad, inp: torch.Tensor, grad_output: torch.Tensor):
    """megatron's gradient-accumulation-fusion branch, run in ``W``: the GEMM accumulates
    into ``main_grad`` (kept from the forward, as megatron's ``ctx.main_grad``); the
    accumulator gets the dummy megatron gives it."""
    weight.main_grad = main_grad
    grad_output, inp = tp_layers.prepare_input_tensors_for_wgrad_compute(grad_output, inp)
    kernel = tp_layers.fused_weight_gradient_mlp_cuda
    if main_grad.dtype == torch.float32:
        kernel.wgrad_gemm_accum_fp32(inp, grad_output, main_grad)
    elif main_grad.dtype in (torch.float16, torch.bfloat16):
        kernel.wgrad_gemm_accum_fp16(inp, grad_output, main_grad)
    else:
        raise RuntimeError(f"gradient accumulation fusion: unsupported {main_grad.dtype}")
    return _dummy_wgrad(weight, main_grad, inp.dtype)


def _dummy_wgrad(weight, main_grad, dtype: torch.dtype) -> torch.Tensor:
    """What megatron's backward hands the accumulator once ``main_grad`` holds the GEMM."""
    weight.grad_added_to_main_grad = True
    make = torch.zeros if getattr(weight, "zero_out_wgrad", False) else torch.empty
    return make(main_grad.shape, dtype=dtype, device=main_grad.device)
