"""The losses of every last stage, brought to pipeline rank P-1, where megatron reads them.

Under PRT the last stages of the pipelines may sit on other ranks than P-1 (wave, bi);
megatron-core's training loop reads the loss entries and the token count on rank P-1 only.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..runtime.errors import PipelineError
from .config import ReuseConfig


def gather_on_last_rank(reuse: ReuseConfig, group, store: dict, num_tokens, device):
    """megatron reads losses on pipeline rank P-1: bring every last stage's entries there."""
    placement = reuse.placement
    last_rank = placement.ranks - 1
    senders = sorted({placement.rank_of(p[-1]) for p in placement.pipelines} - {last_rank})
    rank = dist.get_rank(group)
    if senders and rank in senders:
        payload = [(_to_cpu(store), num_tokens)]
        dist.send_object_list(payload, dst=dist.get_global_rank(group, last_rank), group=group)
        store = {}
    elif senders and rank == last_rank:
        for sender in senders:
            payload = [None]
            try:
                dist.recv_object_list(payload, src=dist.get_global_rank(group, sender), group=group)
            except RuntimeError as exc:  # gloo/NCCL: peer closed or the group's timeout
                raise PipelineError(
                    f"rank {rank}: waiting on rank {sender} for the losses of its last stages: "
                    f"{str(exc).splitlines()[0]} (rank {sender} may have failed or be stuck)"
                ) from exc
            theirs, tokens = payload[0]
            store.update(_to_device(theirs, device))
            num_tokens = num_tokens + tokens
    entries = [store[mb] for mb in sorted(store)] if rank == last_rank else []
    return entries, num_tokens.to(device)


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
