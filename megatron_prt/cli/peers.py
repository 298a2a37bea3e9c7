"""``megatron-prt compare``'s peer rows: torch.distributed.pipelining's own schedules,
converted by :mod:`megatron_prt.runtime.peers` and simulated under the compare's costs.

torch loads only when the rows are built, so ``megatron_prt.cli`` imports without it.
"""

from __future__ import annotations

from ..bench.peers import simulated_peers
from ..sim.cost import CostModel
from ..sim.simulate import SimResult


def peer_results(
    pp: int, microbatches: int, reuse: int, cost: CostModel, split_backward: bool
) -> list[tuple[str, SimResult | None, str]]:
    """``(label, result, why)`` rows as ``megatron-prt compare`` prints them; without torch
    one row saying why its schedules are missing (:func:`simulated_peers`).
    The split-backward orders (ZB1P, ZBV, DualPipeV) only with ``split_backward``, beside
    our own zero-bubble rows: without it the table compares whole-backward schedules."""
    rows = simulated_peers(pp, microbatches, lambda placement: cost, reuse)
    return [(r.label, r.result, r.why) for r in rows if split_backward or not r.split_backward]
