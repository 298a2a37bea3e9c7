"""``megatron-prt compare``'s peer rows: torch.distributed.pipelining's own schedules,
converted by :mod:`megatron_prt.runtime.peers` and simulated under the compare's costs.

torch loads only when the rows are built, so ``megatron_prt.cli`` imports without it.
"""

from __future__ import annotations

from ..bench.peers import simulated_peers
from ..sim.cost import CostModel
from ..sim.simulate import SimResult


def peer_results(
    pp: int, microbatches: int, reuse: int, cost: CostModel
) -> list[tuple[str, SimResult | None, str]]:
    """``(label, result, why)`` rows as ``cmd_compare`` prints them; ``[]`` without torch."""
    rows = simulated_peers(pp, microbatches, lambda placement: cost, reuse)
    return [(row.label, row.result, row.why) for row in rows]
