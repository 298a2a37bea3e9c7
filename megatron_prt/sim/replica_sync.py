"""The gradient sums after the step, when each rank runs them, and what they cost.

Direction ``bi``: the runtime (:func:`megatron_prt.runtime.replicas.reduce_replica_grads`,
called after the step) pairs stage ``k`` of pipeline 0 with its replica ``D + k`` of
pipeline 1, which sits on the mirrored rank ``P-1-rank(k)``. So every rank exchanges with
exactly one peer, the mirrored rank, and sends it the gradients of *all* its stages
(pipeline 0's and pipeline 1's), receiving as many bytes back; then it adds what it
received. Nothing overlaps the backward passes: a rank starts once its own step is over and
finishes only when its peer has started too, so a pair begins at the later of the two
ranks' last compute ends. With odd P the middle rank is its own mirror: it sums its
replicas in place and waits for no one.

Tied embeddings (megatron's path, :func:`megatron_prt.megatron.model.tie_grads`, after the
replica sum): each pipeline's first and last stage hold a copy of the tied weight
(:meth:`~megatron_prt.core.placement.Placement.end_pairs`); a rank holding one sends its
copy's gradient to the rank holding the other and adds the one it receives, all its pairs
in one batch (every first and last stage sits on rank 0 or P-1, so a rank has at most one
peer); both copies on one rank (wave with even R) add in place and wait for no one.

Durations come from :meth:`megatron_prt.sim.cost.CostModel.replica_sync_time` for both
(a pairwise exchange and add; the tied sum runs over the process group, the replica sum
over the runtime's transport, which on CPU is shared memory: one set of figures prices the
tied sum low there); ``tests/sim/test_sim_replicas.py`` and ``tests/sim/test_sim_tied.py``
check the pairing and the bytes against the runtime.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..core.placement import Placement
from .cost import CostModel


@dataclass(frozen=True)
class GradSum:
    """One rank's share of a gradient sum after the step (replicas or tied copies). Times
    in the cost model's unit, sizes in bytes.

    ``peer``: the rank it exchanges with (``None``: all its copies are local);
    ``sent_bytes``: gradient bytes it sends to ``peer`` (and receives from it);
    ``added_bytes``: gradient bytes it adds into its own; ``ready``: end of its last
    compute action; ``start``/``end``: the exchange (``start - ready`` is spent waiting)."""

    rank: int
    peer: int | None
    sent_bytes: float
    added_bytes: float
    ready: float
    start: float
    end: float


def replica_syncs(
    placement: Placement, cost: CostModel, ready: Sequence[float]
) -> tuple[GradSum, ...]:
    """Per rank (empty for ``uni``): its replica-gradient sum, given ``ready[rank]``, the end
    of the rank's last compute action."""
    pairs = placement.replica_pairs()
    if not pairs:
        return ()
    grad = cost.stage_grad_bytes(placement)
    size = [grad[placement.model_stage(a)] for a, _ in pairs]
    return _timed(cost, ready, *_exchanges(placement, pairs, size, local_adds=1))


def tied_syncs(
    placement: Placement, cost: CostModel, ready: Sequence[float]
) -> tuple[GradSum, ...]:
    """Per rank (empty when ``cost.tied_grad_bytes`` is 0): its tied embedding sum, given
    ``ready[rank]``, when the rank is done with the step and any replica sum. Ranks holding
    no first or last stage take no part (zero time at ``ready``)."""
    if not cost.tied_grad_bytes:
        return ()
    pairs = placement.end_pairs()
    size = [cost.tied_grad_bytes] * len(pairs)
    # both copies on one rank: each takes the sum, two adds (exchange_pairs' local case)
    return _timed(cost, ready, *_exchanges(placement, pairs, size, local_adds=2))


def _exchanges(placement: Placement, pairs, size: Sequence[float], local_adds: int):
    """Per rank: bytes sent, bytes added, the peer (``None``: none) of the stage ``pairs``
    whose copies of ``size[i]`` bytes are summed; a pair on one rank adds ``local_adds``
    times its size in place."""
    sent = [0.0] * placement.ranks
    added = [0.0] * placement.ranks
    peer: list[int | None] = [None] * placement.ranks
    for (a, b), nbytes in zip(pairs, size, strict=True):
        rank_a, rank_b = placement.rank_of(a), placement.rank_of(b)
        if rank_a == rank_b:
            added[rank_a] += local_adds * nbytes
            continue
        for here, there in ((rank_a, rank_b), (rank_b, rank_a)):
            sent[here] += nbytes
            added[here] += nbytes
            peer[here] = there
    return sent, added, peer


def _timed(cost: CostModel, ready, sent, added, peer) -> tuple[GradSum, ...]:
    """Each rank's sum: a pair starts when both ranks are ready; a rank alone at once."""
    out = []
    for rank, other in enumerate(peer):
        start = ready[rank] if other is None else max(ready[rank], ready[other])
        took = cost.replica_sync_time(sent[rank], added[rank], remote=other is not None)
        out.append(GradSum(rank, other, sent[rank], added[rank], ready[rank], start, start + took))
    return tuple(out)
