"""Activation memory held for backward, measured per rank.

What counts
-----------
"Activation bytes held for backward" of one (stage, micro-batch), here and in the cost
model's per-layer ``act`` (:mod:`megatron_prt.megatron.profile`), are the bytes of

* every tensor autograd saves while that stage's forward runs (seen through
  :func:`torch.autograd.graph.saved_tensors_hooks`, so custom autograd Functions count too),
  measured by *storage*: each distinct storage counts once, at its full size (the q, k and v
  views of one fused projection are one buffer);
* minus parameter storages (weights, also through views such as ``weight.t()``: they are
  ``param`` bytes, not activations);
* plus what the executor itself keeps for the backward: the stage input (its gradient is
  read after the backward) and, when the next stage runs on the same rank (a ``wave`` turn,
  ``bi`` stages sharing a rank), the stage output handed over (kept until this stage's
  backward). A sent output counts only without ``deallocate_outputs``: by default the
  executor frees its data once sent, keeping only its graph.

Split backward (``I`` then ``W``): ``I`` releases the (stage, micro-batch)'s forward
storages like ``B`` and the owner then holds what ``W`` needs, each split layer's input and
output gradient (:func:`megatron_prt.runtime.wgrad.held_tensors`), until its ``W`` releases
them; an input also saved by the forward is the same storage, counted once.

Not counted: gradients between stages, received activations not yet consumed, memory a
forward frees before it returns, parameters, gradients and optimizer state.

On a rank a storage held by several (stage, micro-batch) owners counts once while any of
them holds it, so :attr:`ActivationMeter.held_bytes` is the memory really kept alive (a
cache saved by every micro-batch, such as megatron's causal mask, counts once). An owner's
storages are released when its backward has run. The meter keeps a reference to each
storage it counts, which autograd holds anyway until that backward, so an address cannot
be reused while counted.

Against a simulator prediction from profiled per-layer ``act`` (which frees a stage's
bytes when its backward ends) the measured peak is higher by exactly: a cache saved by
every micro-batch, once per rank (megatron's causal mask, ``seq**2`` bytes: the profiler
leaves caches out); an output handed to a stage on the same rank while the consumer's
forward has not begun or its backward has ended (the executor keeps the producer's output
object, and with it the storage, from the producer's forward to its backward; the
simulator counts it inside the consumer's activation only: one message per hand-off
pending at the peak, seen on wave placements); without ``deallocate_outputs``, every sent
output until its stage's backward.

On CUDA the meter also reports the allocator's view: the peak of
``torch.cuda.max_memory_allocated`` over the step, minus what was allocated when the step
began. That includes everything above plus transient workspace, messages in flight and
gradient buffers allocated on the first backward, so it is an upper bound for the
saved-tensor count.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Iterable, Iterator
from typing import Any

import torch

_Key = tuple  # (device, address) of a storage, or ("tensor", id) where there is none


class ActivationMeter:
    """Counts the activation bytes held for backward, by owner (any hashable, the executor
    uses ``(stage, mb)``). Storages under ``params`` are never counted. All sizes in
    bytes; ``device``: on CUDA the allocator's peak is reported too."""

    def __init__(
        self, params: Iterable[torch.Tensor] = (), device: torch.device | str = "cpu"
    ) -> None:
        self.device = torch.device(device)
        self._param_storages = {_storage_of(p)[0] for p in params}
        self._storages: dict[_Key, tuple[object, int]] = {}  # key -> (kept alive, bytes)
        self._owners: dict[_Key, set[Hashable]] = {}
        self._owned: dict[Hashable, set[_Key]] = {}
        self.held_bytes = 0
        self.peak_bytes = 0
        self.timeline: list[tuple[str, int]] = []  # (event label, bytes held after it)
        self._allocator_base = None
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self._allocator_base = torch.cuda.memory_allocated(self.device)

    def saving(self, owner: Hashable) -> contextlib.AbstractContextManager[None]:
        """While inside, every tensor autograd saves is held by ``owner``."""
        return self.saving_for(lambda: owner)

    @contextlib.contextmanager
    def saving_for(self, current_owner: Callable[[], Hashable]) -> Iterator[None]:
        """While inside, every tensor autograd saves is held by ``current_owner()`` (asked
        at each save: a profiler attributes saves to the part of the model running)."""

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            self.hold(current_owner(), tensor)
            # A detached alias shares storage and version counter; returning the tensor
            # itself would make a saved output reference its own grad_fn.
            return tensor.detach()

        with torch.autograd.graph.saved_tensors_hooks(pack, _unpack):
            yield

    def hold(self, owner: Hashable, tensor: torch.Tensor) -> None:
        """``owner`` keeps ``tensor``'s storage alive until :meth:`release`."""
        key, keep, nbytes = _storage_of(tensor)
        if nbytes == 0 or key in self._param_storages:
            return
        owners = self._owners.setdefault(key, set())
        if not owners:
            self._storages[key] = (keep, nbytes)
            self.held_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.held_bytes)
        owners.add(owner)
        self._owned.setdefault(owner, set()).add(key)

    def release(self, owner: Hashable) -> None:
        """``owner``'s backward ran: what only it held is freed."""
        for key in self._owned.pop(owner, ()):
            owners = self._owners[key]
            owners.discard(owner)
            if not owners:
                del self._owners[key]
                _, nbytes = self._storages.pop(key)
                self.held_bytes -= nbytes

    def mark(self, label: str) -> None:
        """Record the bytes held now, after the event ``label`` (e.g. ``"2F1"``)."""
        self.timeline.append((label, self.held_bytes))

    def storages(self, owner: Hashable) -> dict[tuple, int]:
        """``{storage key: bytes}`` of what ``owner`` holds (storages it shares, in full)."""
        return {key: self._storages[key][1] for key in self._owned.get(owner, ())}

    def stats(self) -> dict[str, Any]:
        """``peak_bytes``, ``held_bytes`` (now; 0 after a full step), ``timeline`` and, on
        CUDA, ``allocator_peak_bytes`` (see the module docstring)."""
        out: dict[str, Any] = {
            "peak_bytes": self.peak_bytes,
            "held_bytes": self.held_bytes,
            "timeline": list(self.timeline),
        }
        if self._allocator_base is not None:
            peak = torch.cuda.max_memory_allocated(self.device)
            out["allocator_peak_bytes"] = peak - self._allocator_base
        return out


def saved_activation_bytes(
    fn: Callable[[], Any], params: Iterable[torch.Tensor] = ()
) -> tuple[Any, int]:
    """Run ``fn()`` and return ``(its result, bytes of the distinct non-parameter storages
    autograd saved while it ran)``. The result keeps the graph (and so those bytes) alive."""
    meter = ActivationMeter(params)
    with meter.saving(None):
        result = fn()
    return result, meter.held_bytes


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _storage_of(tensor: torch.Tensor) -> tuple[_Key, object, int]:
    """``(key, object keeping the memory alive, bytes)`` of the storage under ``tensor``."""
    try:
        storage = tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):  # no plain storage (sparse, wrapper types)
        return ("tensor", id(tensor)), tensor, tensor.numel() * tensor.element_size()
    address = storage.data_ptr()
    if address == 0:  # empty, or meta
        return ("tensor", id(tensor)), tensor, 0
    return (str(storage.device), address), storage, storage.nbytes()
