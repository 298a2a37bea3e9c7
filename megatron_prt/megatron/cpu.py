"""Opt-in CPU compatibility for megatron-core 0.16.1 (local-spec models, gloo).

megatron-core assumes CUDA in a few places that a CPU run reaches. :func:`enable` replaces
exactly those, process-wide, so tests, the demo and users without GPUs run the real models:

* ``GlobalMemoryBuffer.get_tensor`` allocates on ``torch.cuda.current_device()``: CPU here.
* ``transformer.utils.get_default_causal_mask`` builds its mask with ``device="cuda"``.
* the model-parallel RNG tracker forks CUDA generator states: a CPU tracker forks the CPU
  generator instead, with the same add / fork / reset / get_states contract.

Limits: local (non-Transformer-Engine) specs only; no fused kernels; tensor and context
parallel sizes of 1. Anything else that needs CUDA still fails loudly. Never call this in a
CUDA process: it changes module attributes for the whole process.
"""

from __future__ import annotations

import contextlib
import functools
import operator

import torch

_ENABLED = False


def enable() -> None:
    """Install the CPU replacements (idempotent)."""
    global _ENABLED
    if _ENABLED:
        return
    from megatron.core import utils
    from megatron.core.fusions import fused_softmax
    from megatron.core.tensor_parallel import random
    from megatron.core.transformer import utils as transformer_utils

    utils.GlobalMemoryBuffer.get_tensor = _get_tensor
    transformer_utils.get_default_causal_mask = _causal_mask
    fused_softmax.get_default_causal_mask = _causal_mask
    tracker_class = _cpu_tracker_class(random.CudaRNGStatesTracker)
    original_init = random.initialize_rng_tracker

    def initialize_rng_tracker(*args, force_reset: bool = False, **kwargs):
        if force_reset or not random._CUDA_RNG_STATE_TRACKER_INITIALIZED:
            random._CUDA_RNG_STATE_TRACKER = tracker_class()
            random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True

    initialize_rng_tracker.original = original_init  # type: ignore[attr-defined]
    random.initialize_rng_tracker = initialize_rng_tracker
    _ENABLED = True


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
