"""Opt-in CPU compatibility for megatron-core 0.16.1 (local-spec models, gloo).

megatron-core assumes CUDA in a few places that a CPU run reaches. :func:`enable` replaces
exactly those, so tests, the demo and users without GPUs run the real models, and train them
with megatron's own DDP, optimizer and no-pipelining schedule:

* ``GlobalMemoryBuffer.get_tensor`` allocates on ``torch.cuda.current_device()``: CPU here.
* ``transformer.utils.get_default_causal_mask`` builds its mask with ``device="cuda"``.
* the model-parallel RNG tracker forks CUDA generator states: a CPU tracker forks the CPU
  generator instead, with the same add / fork / reset / get_states contract.
* the module attribute ``torch`` of ``core.utils`` (``local_multi_tensor_l2_norm``),
  ``distributed.param_and_grad_buffer`` (DDP's grad buffers),
  ``pipeline_parallel.schedules`` (``total_num_tokens``), ``optimizer.optimizer`` (loss
  scale tensors) and ``optimizer.clip_grads`` (grad norm, zero count) becomes a proxy of
  torch whose tensor factories turn ``device="cuda"`` into CPU and whose ``torch.cuda``
  answers ``current_device()`` with ``"cpu"``, makes ``synchronize()`` a no-op and gives
  streams that never wait. The real ``torch`` and ``torch.cuda`` modules are left alone;
  everything else is delegated to them.
* ``clip_grad_by_total_norm_fp32`` (in ``optimizer.clip_grads`` and ``optimizer.optimizer``,
  which imports the name) asserts ``torch.cuda.FloatTensor`` grads: a CPU version with the
  same contract (every grad present is scaled; the shared / tensor-parallel-duplicate filter
  belongs to the norm, which stays megatron's) checks for fp32 instead.
* ``torch.Tensor.cuda`` returns the tensor itself (process-wide): megatron's tied-embedding
  set-up calls it in ``LanguageModule.setup_embeddings_and_output_layer``.

Limits: local (non-Transformer-Engine) specs only, no TE / apex, no fused kernels; tensor and
context parallel sizes of 1; DDP without ``overlap_grad_reduce`` (CUDA streams) and without
the distributed optimizer; fp32 only (no fp16 / bf16 optimizer); megatron's own pipelined
schedules are not covered (their p2p still calls CUDA; megatron-prt's schedule replaces
them). Anything else that needs CUDA still fails loudly. Never call this in a CUDA process:
it changes module attributes for the whole process.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import operator
from collections.abc import Iterable

import torch

_ENABLED = False

# Modules whose global ``torch`` is swapped for the CPU proxy (see the module docstring).
_PROXIED_MODULES = (
    "megatron.core.utils",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
)
_FACTORIES = (
    "arange", "as_tensor", "empty", "empty_like", "full", "full_like", "ones", "ones_like",
    "rand", "randint", "randn", "tensor", "zeros", "zeros_like",
)  # fmt: skip


def enable() -> None:
    """Install the CPU replacements (idempotent)."""
    global _ENABLED
    if _ENABLED:
        return
    from megatron.core import utils
    from megatron.core.fusions import fused_softmax
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as megatron_optimizer
    from megatron.core.tensor_parallel import random
    from megatron.core.transformer import utils as transformer_utils

    utils.GlobalMemoryBuffer.get_tensor = _get_tensor
    transformer_utils.get_default_causal_mask = _causal_mask
    fused_softmax.get_default_causal_mask = _causal_mask
    _install_rng_tracker(random)
    proxy = CpuTorch()
    for name in _PROXIED_MODULES:
        importlib.import_module(name).torch = proxy
    # LanguageModule moves the tied word embedding with ``Tensor.cuda()`` before its
    # all-reduce; a method of the tensor class, so only a process-wide patch reaches it.
    torch.Tensor.cuda = _stay_on_cpu
    # optimizer.py bound the name at import, so both modules need the CPU version.
    clip_grads.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32
    megatron_optimizer.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32
    _ENABLED = True


def _install_rng_tracker(random) -> None:
    tracker_class = _cpu_tracker_class(random.CudaRNGStatesTracker)
    original_init = random.initialize_rng_tracker

    def initialize_rng_tracker(*args, force_reset: bool = False, **kwargs):
        if force_reset or not random._CUDA_RNG_STATE_TRACKER_INITIALIZED:
            random._CUDA_RNG_STATE_TRACKER = tracker_class()
            random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True

    initialize_rng_tracker.original = original_init  # type: ignore[attr-defined]
    random.initialize_rng_tracker = initialize_rng_tracker


def _cpu_device(device):
    # torch.device() reads "cuda", "cuda:1", a torch.device and a bare ordinal alike.
    if device is not None and torch.device(device).type == "cuda":
        return "cpu"
    return device


def _cpu_factory(factory):
    @functools.wraps(factory)
    def make(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        return factory(*args, **kwargs)

    return make


class CpuStream:
    """A CUDA stream on CPU: work is already ordered, every wait returns at once."""

    def wait_stream(self, stream) -> None:
        return None

    def wait_event(self, event) -> None:
        return None

    def synchronize(self) -> None:
        return None


class CpuCuda:
    """``torch.cuda`` as megatron's allocation code sees it: the current device is the CPU,
    there is nothing to synchronize and streams never wait (megatron-core 0.19's DDP waits
    on the current stream before each gradient reduce). Anything else is the real
    ``torch.cuda``."""

    @staticmethod
    def current_device() -> str:
        return "cpu"

    @staticmethod
    def synchronize(device=None) -> None:
        return None

    @staticmethod
    def Stream(*args, **kwargs) -> CpuStream:  # noqa: N802 (torch.cuda's name)
        return CpuStream()

    @staticmethod
    def current_stream(device=None) -> CpuStream:
        return CpuStream()

    @staticmethod
    def stream(stream) -> contextlib.nullcontext:
        return contextlib.nullcontext()

    def __getattr__(self, name):
        return getattr(torch.cuda, name)


class CpuTorch:
    """Stands in for ``torch`` inside one megatron module: factories allocate on CPU when
    asked for CUDA, ``cuda`` is :class:`CpuCuda`, every other attribute is torch's own."""

    cuda = CpuCuda()

    def __init__(self) -> None:
        for name in _FACTORIES:
            setattr(self, name, _cpu_factory(getattr(torch, name)))

    def __getattr__(self, name):
        return getattr(torch, name)


def clip_grad_by_total_norm_fp32(
    parameters: Iterable[torch.Tensor] | torch.Tensor,
    max_norm: float,
    total_norm: float,
    use_decoupled_grad: bool = False,
) -> None:
    """megatron's ``clip_grad_by_total_norm_fp32`` for CPU grads: scales, in place, every
    grad (``.grad`` or ``.decoupled_grad``) of ``parameters`` by ``max_norm / total_norm``
    when that is below 1. As in megatron, no parameter is filtered out here: shared and
    tensor-parallel-duplicate parameters are only left out of ``total_norm``."""
    from megatron.core.utils import to_local_if_dtensor

    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    grads = [to_local_if_dtensor(g).detach() for g in _grads(parameters, use_decoupled_grad)]
    clip_coeff = max_norm / (total_norm + 1.0e-6)  # same epsilon as megatron
    if clip_coeff < 1.0 and grads:
        torch._foreach_mul_(grads, clip_coeff)


def _grads(parameters: Iterable[torch.Tensor], use_decoupled_grad: bool) -> list[torch.Tensor]:
    attr, dtypes = ("grad", (torch.float32,))
    if use_decoupled_grad:
        attr, dtypes = ("decoupled_grad", (torch.float32, torch.bfloat16))
    grads = [getattr(p, attr, None) for p in parameters]
    grads = [g for g in grads if g is not None]
    for g in grads:
        # megatron asserts torch.cuda.FloatTensor: keep the dtype half of that check.
        assert g.dtype in dtypes, f"{attr} of dtype {g.dtype} cannot be clipped in fp32"
    return grads


def _stay_on_cpu(self, *args, **kwargs):
    return self


def _get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
    required = functools.reduce(operator.mul, tensor_shape, 1)
    buf = self.buffer.get((name, dtype))
    if buf is None or buf.numel() < required:
        buf = self.buffer[(name, dtype)] = torch.empty(required, dtype=dtype)
    return buf[0:required].view(*tensor_shape)


@functools.cache
def _causal_mask(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq), diagonal=1).bool()


def _cpu_tracker_class(base):
    class CpuRNGStatesTracker(base):
        """Named CPU generator states; ``fork`` runs its block on one of them."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)

        def add(self, name, seed):
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            self.seeds_.add(seed)
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()

        @contextlib.contextmanager
        def fork(self, name="model-parallel-rng"):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            outer = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(outer)

    return CpuRNGStatesTracker
