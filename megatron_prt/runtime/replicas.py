"""Direction ``bi``: every model stage k has two weight replicas, stage k (pipeline 0) on
rank(k) and stage D+k (pipeline 1) on the mirrored rank. These helpers keep them equal.

* :func:`sync_replicas` copies pipeline 0's weights onto pipeline 1's replica (call once
  after building the model, before training).
* :func:`reduce_replica_grads` sums the two replicas' gradients after a step, so both hold
  the gradient of the whole batch and identical optimizer steps keep them identical.

Each rank issues all its transfers as one batch, so no pair order can deadlock.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist

from ..core.placement import Placement


def _pairs(placement: Placement):
    d = placement.depth
    return [(k, d + k) for k in range(d)] if placement.direction == "bi" else []


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors]) if tensors else torch.empty(0)


def _unflat(flat: torch.Tensor, tensors) -> None:
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()


def _exchange(placement, stages, group, payload, apply, both_ways: bool) -> None:
    rank = dist.get_rank(group)
    ops, pending = [], []
    for owner_stage, replica_stage in _pairs(placement):
        owner, replica = placement.rank_of(owner_stage), placement.rank_of(replica_stage)
        if owner == replica == rank:
            mine, theirs = payload(stages[owner_stage]), payload(stages[replica_stage])
            apply(stages[replica_stage], mine.clone(), theirs)
            if both_ways:
                apply(stages[owner_stage], theirs, mine)
            continue
        for here, there, sends in (
            (owner_stage, replica_stage, True),
            (replica_stage, owner_stage, both_ways),
        ):
            if placement.rank_of(here) != rank:
                continue
            peer = placement.rank_of(there)
            peer_global = peer if group is None else dist.get_global_rank(group, peer)
            flat = payload(stages[here])
            if sends:
                ops.append(dist.P2POp(dist.isend, flat, peer_global, group))
            if here == replica_stage or both_ways:
                buf = torch.empty_like(flat)
                ops.append(dist.P2POp(dist.irecv, buf, peer_global, group))
                pending.append((stages[here], buf, flat))
    for work in dist.batch_isend_irecv(ops) if ops else []:
        work.wait()
    for module, received, own in pending:
        apply(module, received, own)


def sync_replicas(placement: Placement, stages: Mapping[int, torch.nn.Module], group=None) -> None:
    """Pipeline-1 replicas take pipeline 0's parameters (and buffers)."""

    def payload(module):
        return _flat([t.detach() for t in (*module.parameters(), *module.buffers())])

    def apply(module, received, _own):
        with torch.no_grad():
            _unflat(received, [*module.parameters(), *module.buffers()])

    _exchange(placement, stages, group, payload, apply, both_ways=False)


def reduce_replica_grads(
    placement: Placement, stages: Mapping[int, torch.nn.Module], group=None
) -> None:
    """Both replicas of every model stage end with the sum of their gradients."""

    def params(module):
        return [p for p in module.parameters() if p.requires_grad]

    def payload(module):
        return _flat(
            [p.grad if p.grad is not None else torch.zeros_like(p) for p in params(module)]
        )

    def apply(module, received, own):
        total = own + received
        for p in params(module):
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        _unflat(total, [p.grad for p in params(module)])

    _exchange(placement, stages, group, payload, apply, both_ways=True)
