"""The layer rule of the training flags, for the commands that price a layout from a cost
file (``plan``, ``simulate``, ``compare``; ``tune`` and ``partition`` apply it themselves).

A cost file without ``stage_layers`` is split evenly over the D = R*P stages, and the
training flags, the runtime and the tuner refuse an even split that leaves a stage without
a layer (:func:`megatron_prt.core.layers.check_layers_fill_stages`). The simulator itself
prices empty stages (the paper-scale report shows what they cost), so these commands check
first: a layout that cannot be trained is refused (or, in ``compare``, shown as n/a), not
priced as if it could.
"""

from __future__ import annotations

from ..core.layers import check_layers_fill_stages
from ..core.placement import ConfigError
from ..sim.cost import CostModel
from ..sim.simulate import SimResult


def check_even_split(cost: CostModel, depth: int, path: str | None) -> None:
    """Refuse ``depth`` stages that the even split of ``cost.layers`` leaves empty
    (:class:`ConfigError` naming ``--costs path``); a file's own ``stage_layers`` and a
    cost file without per-layer costs pass."""
    if cost.layers and not cost.stage_layers:
        what = f"--costs {path}: layer count"
        check_layers_fill_stages(len(cost.layers), depth, what, "--reuse or --pp")


def filled_rows(
    rows: list[tuple[str, SimResult | None, str]], cost: CostModel, path: str | None
) -> list[tuple[str, SimResult | None, str]]:
    """``compare``'s ``(label, result, why)`` rows, a priced row whose layout
    :func:`check_even_split` refuses turned into an n/a row with the reason."""
    out = []
    for label, result, why in rows:
        if result is not None:
            try:
                check_even_split(cost, result.plan.placement.depth, path)
            except ConfigError as exc:
                result, why = None, str(exc)
        out.append((label, result, why))
    return out
