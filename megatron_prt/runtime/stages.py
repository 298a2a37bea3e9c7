"""Split a layer list into the stages a rank owns, for any placement and partition."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..core.placement import ConfigError, Placement


def layer_ranges(num_layers: int, depth: int, stage_layers: Sequence[int] | None = None):
    """Model stage k -> (first layer, layer count); even split unless ``stage_layers`` given."""
    if stage_layers is None:
        if num_layers < depth:
            raise ConfigError(
                f"{num_layers} layers cannot fill D = {depth} stages; lower --reuse or give "
                "explicit stage_layers"
            )
        base, extra = divmod(num_layers, depth)
        stage_layers = [base + (1 if k < extra else 0) for k in range(depth)]
    if len(stage_layers) != depth or sum(stage_layers) != num_layers or min(stage_layers) < 0:
        raise ConfigError(
            f"stage_layers {list(stage_layers)} must be {depth} counts >= 0 summing to {num_layers}"
        )
    out, first = [], 0
    for count in stage_layers:
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
