"""Split a layer list into the stages a rank owns, for any placement and partition."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

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
    tag_layer_split(stages.values(), [count for _, count in ranges])
    return stages


# [Note: every rank builds the same layer split] Each rank builds only its own stages, so
# ranks given different splits (two plan files, a stage_layers on one rank only) trained a
# model whose stages overlap or leave layers out, without a word: no rank sees another's
# layers. build_stages (and megatron's runtime, from its flags) tags the stages with the whole
# split, and the start-up check compares it across ranks (runtime/startup.py).
SPLIT_ATTR = "prt_stage_layers"  # on a stage module: every model stage's layer count


def tag_layer_split(modules: Iterable[torch.nn.Module], counts: Sequence[int]) -> None:
    """Record ``counts`` (layers of every model stage ``0..D-1``) on ``modules``."""
    for module in modules:
        setattr(module, SPLIT_ATTR, tuple(int(count) for count in counts))  # numpy ints too


def layer_split_of(stages: Mapping[int, torch.nn.Module]) -> tuple[int, ...] | None:
    """The split :func:`tag_layer_split` recorded on ``stages`` (looked up through
    wrappers such as DDP); None when none was."""
    for module in stages.values():
        for inner in module.modules():
            counts = getattr(inner, SPLIT_ATTR, None)
            if counts is not None:
                return counts
    return None
