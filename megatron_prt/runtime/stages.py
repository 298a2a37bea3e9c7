"""Split a layer list into the stages a rank owns, for any placement and partition."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..core.layers import stage_layer_counts
from ..core.placement import Placement


def layer_ranges(num_layers: int, depth: int, stage_layers: Sequence[int] | None = None):
    """Model stage k -> (first layer, layer count); even split unless ``stage_layers`` given
    (:func:`megatron_prt.core.layers.stage_layer_counts`)."""
    counts = stage_layer_counts(
        num_layers, depth, stage_layers, fix="lower --reuse or give explicit stage_layers"
    )
    out, first = [], 0
    for count in counts:
        out.append((first, count))
        first += count
    return out


def build_stages(
    placement: Placement,
    rank: int,
    make_layer: Callable[[int], torch.nn.Module],
    num_layers: int,
    stage_layers: Sequence[int] | None = None,
) -> dict[int, torch.nn.Sequential]:
    """This rank's stages, each an ``nn.Sequential`` of its layers (global layer ids
    ``make_layer(i)``). For ``bi`` the replica stage ``D + k`` gets its own copy of model
    stage ``k``; call :func:`megatron_prt.runtime.replicas.sync_replicas` to make the copies
    equal across ranks."""
    ranges = layer_ranges(num_layers, placement.depth, stage_layers)
    stages = {}
    for stage in placement.rank_stages[rank]:
        first, count = ranges[placement.model_stage(stage)]
        stages[stage] = torch.nn.Sequential(*(make_layer(i) for i in range(first, first + count)))
    return stages
