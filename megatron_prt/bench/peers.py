"""Peer rows for the simulated benchmarks: torch.distributed.pipelining's own schedules
(:mod:`megatron_prt.runtime.peers`) timed by our simulator under the costs our rows get.

torch loads only inside :func:`simulated_peers`; without it there are no peer rows.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

from ..core.placement import Placement
from ..core.validate import validate
from ..sim.cost import CostModel
from ..sim.simulate import SimResult, simulate
from .report import md_table


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
    split another depth give a row with the reason. ``[]`` where torch is not installed."""
    if importlib.util.find_spec("torch") is None:
        return []
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
        rows.append(PeerRow(label, simulate(plan, cost), "", peer.split_backward))
    return rows


def peer_table(model: str, microbatches: int, rows: list[PeerRow], one_f_one_b_ms: float):
    """Markdown rows for a paper-scale report: iteration time, bubble, speed over our 1F1B
    (``one_f_one_b_ms``) and the largest per-rank peak (activations + weights), GiB."""
    header = ("model", "m", "schedule", "iteration ms", "bubble", "vs 1F1B", "peak GiB/rank")
    cells = []
    for row in rows:
        res = row.result
        if res is None:
            cells.append((model, microbatches, row.label, "n/a", "", "", row.why))
            continue
        peak = max(r.peak_activation_bytes + r.param_bytes for r in res.per_rank)
        cells.append(
            (
                model,
                microbatches,
                row.label,
                f"{res.makespan:.1f}",
                f"{res.bubble_fraction:.1%}",
                f"{one_f_one_b_ms / res.makespan:.3f}x",
                f"{peak / 2**30:.1f}",
            )
        )
    return md_table(header, "lllrrrr", cells)


def paper_scale_peers(model: str, link: str, microbatches: int, reuse: int = 2) -> list[PeerRow]:
    """:func:`simulated_peers` for one paper-scale job: its model and link's costs on
    :data:`.paper_scale.jobs.RANKS` ranks, as :func:`.paper_scale.jobs.job_cost` gives them."""
    from .paper_scale.jobs import RANKS, Job, Variant, job_cost

    def cost_of(placement: Placement) -> CostModel:
        return job_cost(Job(model, link, microbatches, Variant("peer", placement, "", "peer")))

    return simulated_peers(RANKS, microbatches, cost_of, reuse)
