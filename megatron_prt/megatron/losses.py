"""The losses of every last stage, brought to pipeline rank P-1, where megatron reads them.

Under PRT the last stages of the pipelines may sit on other ranks than P-1 (wave, bi);
megatron-core's training loop reads the loss entries and the token count on rank P-1 only.
"""

from __future__ import annotations

import pickle

import torch
import torch.distributed as dist

from ..runtime.errors import PipelineError
from ..runtime.p2p import wire_device
from ..runtime.replicas import wait_args
from .config import ReuseConfig


def gather_on_last_rank(
    reuse: ReuseConfig, group, store: dict, num_tokens, device, timeout_s: float | None = None
):
    """megatron reads losses on pipeline rank P-1: bring every last stage's entries there.
    ``timeout_s`` bounds the wait for a sender on gloo as the schedule's own waits are
    (None, and NCCL: the process group's timeout)."""
    placement = reuse.placement
    last_rank = placement.ranks - 1
    senders = sorted({placement.rank_of(p[-1]) for p in placement.pipelines} - {last_rank})
    rank = dist.get_rank(group)
    if senders and rank in senders:
        payload = (_to_cpu(store), num_tokens)
        try:
            _send_object(payload, dist.get_global_rank(group, last_rank), group, device, timeout_s)
        except RuntimeError as exc:  # gloo/NCCL: the receiver closed or a timeout
            raise PipelineError(
                f"rank {rank}: sending the losses of its last stages to rank {last_rank}: "
                f"{str(exc).splitlines()[0]} (rank {last_rank} may have failed or be stuck)"
            ) from exc
        store = {}
    elif senders and rank == last_rank:
        for sender in senders:
            try:
                theirs, tokens = _recv_object(
                    dist.get_global_rank(group, sender), group, device, timeout_s
                )
            except RuntimeError as exc:  # gloo/NCCL: peer closed or a timeout
                raise PipelineError(
                    f"rank {rank}: waiting on rank {sender} for the losses of its last stages: "
                    f"{str(exc).splitlines()[0]} (rank {sender} may have failed or be stuck)"
                ) from exc
            store.update(_to_device(theirs, device))
            num_tokens = num_tokens + tokens
    entries = [store[mb] for mb in sorted(store)] if rank == last_rank else []
    return entries, num_tokens.to(device)


def _send_object(obj, peer: int, group, device, timeout_s: float | None) -> None:
    """``obj`` pickled to ``peer``: its size, then its bytes (``send_object_list``'s wire,
    with waits bounded as :func:`_recv_object`'s)."""
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    wire = wire_device(group, device)
    size = torch.tensor([data.numel()], dtype=torch.int64, device=wire)
    for tensor in (size, data.to(wire)):
        dist.isend(tensor, peer, group).wait(*wait_args(timeout_s, group))


def _recv_object(peer: int, group, device, timeout_s: float | None):
    """What :func:`_send_object` sent from ``peer``; each wait at most ``timeout_s`` on gloo."""
    wire = wire_device(group, device)
    size = torch.zeros(1, dtype=torch.int64, device=wire)
    dist.irecv(size, peer, group).wait(*wait_args(timeout_s, group))
    data = torch.empty(int(size.item()), dtype=torch.uint8, device=wire)
    dist.irecv(data, peer, group).wait(*wait_args(timeout_s, group))
    return pickle.loads(data.cpu().numpy().tobytes())


def _to_cpu(obj):
    return _map_tensors(obj, lambda t: t.detach().cpu())


def _to_device(obj, device):
    return _map_tensors(obj, lambda t: t.to(device))


def _map_tensors(obj, fn):
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_tensors(v, fn) for v in obj)
    return obj
