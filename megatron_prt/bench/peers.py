"""Peer rows for the simulated benchmarks: torch.distributed.pipelining's own schedules
(:mod:`megatron_prt.runtime.peers`) timed by our simulator under the costs our rows get,
their split orders in the plain layers' form (:meth:`~megatron_prt.sim.cost.CostModel.
plain_form`: torch splits a plain backward with autograd, not with megatron-prt's layers).

torch loads only inside :func:`simulated_peers`; without it one row says why there are none.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

from ..core.placement import Placement
from ..core.validate import validate
from ..sim.cost import CostModel
from ..sim.simulate import SimResult, simulate


@dataclass(frozen=True)
class PeerRow:
    """One torch schedule: ``result`` of simulating it, or ``None`` and ``why`` not;
    ``split_backward`` whether its order splits the backward (I and W)."""

    label: str
    result: SimResult | None
    why: str = ""
    split_backward: bool = False


def simulated_peers(
    ranks: int, microbatches: int, cost_of: Callable[[Placement], CostModel], reuse: int = 2
) -> list[PeerRow]:
    """Every torch schedule for ``ranks`` x ``microbatches``, simulated under
    ``cost_of(its placement)``; refused configurations and costs whose ``stage_layers``
    split another depth give a row with the reason; where torch is not installed, one row
    saying so."""
    if importlib.util.find_spec("torch") is None:
        return [PeerRow("torch schedules", None, "torch is not installed: pip install torch")]
    from ..runtime.peers import peer_placement, peer_plans

    rows = []
    for peer, plan, why in peer_plans(ranks, microbatches, reuse):
        placement = plan.placement if plan else peer_placement(peer, ranks, reuse)
        label = peer.label + (f" R={placement.reuse}" if placement.reuse > 1 else "")
        if plan is None:
            rows.append(PeerRow(label, None, why, peer.split_backward))
            continue
        cost = cost_of(placement)
        split = len(cost.stage_layers)
        if split and split != placement.depth:
            why = f"the costs' stage_layers split {split} stages, this needs {placement.depth}"
            rows.append(PeerRow(label, None, why, peer.split_backward))
            continue
        validate(plan)
        # torch splits plain layers' backward with autograd: not our split layers' form
        plain = cost.plain_form() if peer.split_backward else cost
        rows.append(PeerRow(label, simulate(plan, plain), "", peer.split_backward))
    return rows
