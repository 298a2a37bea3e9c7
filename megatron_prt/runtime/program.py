"""Pieces of the executor's compiled program (:mod:`megatron_prt.runtime.executor`): a
compute action's resolved operands and the freeing of handed-on outputs."""

from __future__ import annotations

import torch

from ..core.actions import Action, Op


class Compute:
    """A compute action's operands, resolved when the program is compiled. ``where``: its
    (stage, mb), under which its output, saved input and input-gradient are kept;
    ``local_in`` / ``remote_in``: its tensor input's producer (stage, mb) on this rank or
    message key (both None: none); ``local_next``: F's consumer stage on this rank, if
    any; ``is_loss``: F's output is the loss (nothing consumes it); ``input_from``: B's
    stage input came from this rank's (stage, mb)."""

    __slots__ = (
        "action",
        "input_from",
        "is_loss",
        "local_in",
        "local_next",
        "mb",
        "remote_in",
        "stage",
        "where",
    )

    def __init__(
        self,
        action: Action,
        local_in: tuple | None,
        remote_in: tuple | None,
        *,
        local_next: int | None,
        is_loss: bool,
        input_from: tuple | None,
    ) -> None:
        self.action, self.stage, self.mb = action, action.stage, action.mb
        self.where = (action.stage, action.mb)
        self.local_in, self.remote_in = local_in, remote_in
        self.local_next, self.is_loss, self.input_from = local_next, is_loss, input_from


def is_recv(action: Action) -> bool:
    return action.op in (Op.RECV_F, Op.RECV_B)


_DEAD: dict[tuple, torch.Tensor] = {}  # one shared placeholder per (device, dtype)


def free_data(out: torch.Tensor) -> None:
    """Megatron's trick: a handed-on output's data is not needed for its backward (autograd
    holds what it saved), only its grad_fn; drop the storage. Every freed output points at
    one shared 1-element placeholder, never read."""
    if out.grad_fn is None:  # outside autograd (a first stage without layers hands on the
        return  # caller's input): nothing needs its grad_fn, and the data is not ours to free
    key = (out.device, out.dtype)
    if key not in _DEAD:
        _DEAD[key] = torch.empty((1,), device=out.device, dtype=out.dtype)
    out.data = _DEAD[key]
