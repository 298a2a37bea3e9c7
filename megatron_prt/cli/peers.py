"""``megatron-prt compare``'s peer rows: torch.distributed.pipelining's own schedules,
converted by :mod:`megatron_prt.runtime.peers` and simulated under the compare's costs.

torch loads only when the rows are built, so ``megatron_prt.cli`` imports without it.
"""

from __future__ import annotations

import importlib.util

from ..bench.peers import simulated_peers
from ..sim.cost import CostModel
from ..sim.simulate import SimResult


def peer_results(
    pp: int, microbatches: int, reuse: int, cost: CostModel, split_backward: bool
) -> list[tuple[str, SimResult | None, str]]:
    """``(label, result, why)`` rows as ``megatron-prt compare`` prints them; without torch
    one row saying why its schedules are missing (they were dropped without a word).
    The split-backward orders (ZB1P, ZBV, DualPipeV) only with ``split_backward``, beside
    our own zero-bubble rows: without it the table compares whole-backward schedules."""
    if importlib.util.find_spec("torch") is None:
        return [("torch schedules", None, "torch is not installed: pip install torch for them")]
    rows = simulated_peers(pp, microbatches, lambda placement: cost, reuse)
    return [
        (row.label, row.result, row.why) for row in rows if split_backward or not row.split_backward
    ]
