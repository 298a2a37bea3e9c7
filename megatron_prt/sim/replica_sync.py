"""Direction ``bi``: when each rank sums its replica gradients, and what that costs.

The runtime (:func:`megatron_prt.runtime.replicas.reduce_replica_grads`, called after the
step) pairs stage ``k`` of pipeline 0 with its replica ``D + k`` of pipeline 1, which sits
on the mirrored rank ``P-1-rank(k)``. So every rank exchanges with exactly one peer, the
mirrored rank, and sends it the gradients of *all* its stages (pipeline 0's and pipeline
1's), receiving as many bytes back; then it adds what it received. Nothing overlaps the
backward passes: a rank starts once its own step is over and finishes only when its peer
has started too, so a pair begins at the later of the two ranks' last compute ends. With
odd P the middle rank is its own mirror: it sums its replicas in place and waits for no one.

Durations come from :meth:`megatron_prt.sim.cost.CostModel.replica_sync_time`;
``tests/sim/test_sim_replicas.py`` checks the pairing and the bytes against the runtime.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..core.placement import Placement
from .cost import CostModel


@dataclass(frozen=True)
class ReplicaSync:
    """One rank's replica-gradient sum. Times in the cost model's unit, sizes in bytes.

    ``peer``: the rank it exchanges with (``None``: its replicas are all local);
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
) -> tuple[ReplicaSync, ...]:
    """Per rank (empty for ``uni``): its replica-gradient sum, given ``ready[rank]``, the end
    of the rank's last compute action."""
    pairs = placement.replica_pairs()
    if not pairs:
        return ()
    grad = cost.stage_grad_bytes(placement)
    sent = [0.0] * placement.ranks
    added = [0.0] * placement.ranks
    peer: list[int | None] = [None] * placement.ranks
    for a, b in pairs:
        rank_a, rank_b = placement.rank_of(a), placement.rank_of(b)
        size = grad[placement.model_stage(a)]
        if rank_a == rank_b:  # both replicas here: one in-place sum
            added[rank_a] += size
            continue
        for here, there in ((rank_a, rank_b), (rank_b, rank_a)):
            sent[here] += size
            added[here] += size
            peer[here] = there
    out = []
    for rank in range(placement.ranks):
        mirror = peer[rank]
        start = ready[rank] if mirror is None else max(ready[rank], ready[mirror])
        took = cost.replica_sync_time(sent[rank], added[rank], remote=mirror is not None)
        out.append(
            ReplicaSync(rank, mirror, sent[rank], added[rank], ready[rank], start, start + took)
        )
    return tuple(out)
