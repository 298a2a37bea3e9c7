"""Costs from a run's own trace: per model stage, the median forward and backward time of
the runtime's spans (``PipelineRuntime(trace=True)``, gathered from every rank with
:func:`megatron_prt.runtime.trace.gather_spans`), as a per-layer cost model for
:func:`megatron_prt.tune.search_plans.tune_layout` (``--pipeline-reuse auto``, and the same
steps by hand for the plain-PyTorch runtime: see docs/tune.md)."""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Sequence

from ..core.actions import Op
from ..core.placement import ConfigError, Placement
from ..sim.cost import CostModel, LayerCost


def stage_times(placement: Placement, gathered: list) -> tuple[list[float], list[float], float]:
    """Per model stage: median forward and backward seconds over every traced span of
    every rank (``gathered[rank][iteration]``: spans ``(action, start, end)``); a split
    backward counts as its I plus its W. Also W's share of the backward (0 when whole)."""
    fwd, bwd = defaultdict(list), defaultdict(list)
    i_w: dict = defaultdict(float)
    w_total = b_total = 0.0
    for rank, rank_iterations in enumerate(gathered):
        for iteration, spans in enumerate(rank_iterations):
            for action, start, end in spans:
                k = placement.model_stage(action.stage)
                if action.op is Op.F:
                    fwd[k].append(end - start)
                elif action.op is Op.B:
                    bwd[k].append(end - start)
                else:
                    i_w[(rank, iteration, action.stage, action.mb)] += end - start
                    w_total += (end - start) if action.op is Op.W else 0.0
                    b_total += end - start
    for (_, _, stage, _), seconds in i_w.items():
        bwd[placement.model_stage(stage)].append(seconds)
    missing = [k for k in range(placement.depth) if not fwd[k] or not bwd[k]]
    if missing:
        raise ConfigError(
            f"no traced forward or backward for model stages {missing}; trace a training "
            "step (PipelineRuntime(trace=True), not forward only) on every rank and gather "
            "every rank's spans"
        )
    medians = [statistics.median(fwd[k]) for k in range(placement.depth)]
    back = [statistics.median(bwd[k]) for k in range(placement.depth)]
    return medians, back, (w_total / b_total if b_total else 0.0)


def measured_cost(
    placement: Placement, stage_layers: Sequence[int], gathered: list, split_backward: bool
) -> CostModel:
    """A per-layer cost model in seconds: each model stage's measured time spread evenly
    over its layers (the split is fixed, so only stage sums matter); a stage without
    layers keeps its time as the embedding (stage 0) or head (last stage)."""
    fwd, bwd, w_share = stage_times(placement, gathered)
    counts = tuple(stage_layers)
    layers: list[LayerCost] = []
    ends: dict[int, LayerCost] = {}
    for k, n in enumerate(counts):
        if n:
            layers += [LayerCost(fwd[k] / n, bwd[k] / n)] * n
        elif k in (0, placement.depth - 1):
            ends[k] = LayerCost(fwd[k], bwd[k])
    return CostModel(
        layers=tuple(layers),
        embedding=ends.get(0),
        head=ends.get(placement.depth - 1),
        stage_layers=counts,
        wgrad_fraction=w_share if split_backward else None,
    )
