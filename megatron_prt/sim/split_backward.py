"""Split backward against 1F1B, simulated: the table of docs/theory.md, section 8.

Equal stages, free messages, F = I = W (whole model: forward 1, backward 2, half of it
weight-gradient work). For every P and m, the fastest split-backward plan over placements,
directions and reuse factors under 1F1B's activation memory, next to 1F1B and to the
split-backward lower bound of its configuration. Regenerate the table in the docs with
``python -m megatron_prt.sim.split_backward``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import product

from ..core.placement import Placement
from ..core.schedules import build_plan
from ..core.zerobubble import split_lower_bound
from .cost import CostModel
from .simulate import SimResult, simulate

TARGET_COST = CostModel(fwd_time=1.0, bwd_time=2.0, wgrad_fraction=0.5)


@dataclass(frozen=True)
class TargetRow:
    pp: int
    microbatches: int
    one_f_one_b: tuple[float, float]  # (bubble, peak activation of the busiest rank)
    zb_h1: tuple[float, float]  # split backward at R=1 (ZB-H1's setting)
    best_label: str  # the fastest split-backward configuration
    best: tuple[float, float]
    best_bound: float  # bubble of the lower bound of that configuration
    best_uni_label: str  # the fastest one among uni (one weight replica, as 1F1B)
    best_uni: tuple[float, float]


def _measure(result: SimResult) -> tuple[float, float]:
    return result.bubble_fraction, max(r.peak_activation_bytes for r in result.per_rank)


def target_row(
    pp: int, microbatches: int, reuses: Sequence[int] = (1, 2, 3, 4), cost: CostModel = TARGET_COST
) -> TargetRow:
    """One row: 1F1B, split backward at R=1, and the best split-backward configuration
    (ties: less memory, then the order tried: R, placement, direction ascending)."""
    base = _measure(simulate(build_plan(Placement(pp), microbatches, "1f1b"), cost))
    found = []
    for reuse, placement, direction in product(reuses, ("loop", "wave"), ("uni", "bi")):
        if reuse == 1 and placement == "wave":
            continue  # same as loop
        config = Placement(pp, reuse, placement, direction)
        result = simulate(build_plan(config, microbatches, "zb"), cost)
        found.append((_measure(result), config, result))
    (bubble, peak), config, result = min(found, key=lambda f: f[0])
    times = cost.split_form().stage_times(config)
    bound = split_lower_bound(config, result.plan.mb_pipeline, times)
    busy = sum(r.busy for r in result.per_rank)
    label = f"R={config.reuse} {config.placement}/{config.direction}"
    zb_h1 = next(f[0] for f in found if f[1].reuse == 1 and f[1].direction == "uni")
    uni, uni_config, _ = min((f for f in found if f[1].direction == "uni"), key=lambda f: f[0])
    return TargetRow(
        pp,
        microbatches,
        base,
        zb_h1,
        label,
        (bubble, peak),
        1 - busy / (pp * bound),
        f"R={uni_config.reuse} {uni_config.placement}",
        uni,
    )


def target_rows(pps: Sequence[int] = (4, 8), factors: Sequence[int] = (1, 2, 3, 4)):
    return [target_row(pp, k * pp) for pp in pps for k in factors]


def markdown_table(rows: Sequence[TargetRow]) -> str:
    """The rows as the Markdown table of docs/theory.md (peaks in units of one micro-batch's
    activation through the whole model)."""
    lines = [
        "| P | m | 1F1B bubble | 1F1B peak | ZB R=1 bubble | ZB R=1 peak | best split "
        "backward | its bubble | its peak | its bound | best uni | its bubble | its peak |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row.pp} | {row.microbatches} | {row.one_f_one_b[0]:.1%} | "
            f"{row.one_f_one_b[1]:.3f} | {row.zb_h1[0]:.1%} | {row.zb_h1[1]:.3f} | "
            f"{row.best_label} | {row.best[0]:.1%} | {row.best[1]:.3f} | {row.best_bound:.1%} | "
            f"{row.best_uni_label} | {row.best_uni[0]:.1%} | {row.best_uni[1]:.3f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":  # pragma: no cover - regenerates the docs' table
    print(markdown_table(target_rows()))
