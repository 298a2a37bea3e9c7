"""Weights by their name in the unpipelined model, so that differently split models can hold
the same values.

A chunk names its transformer layers by local index (``decoder.layers.0`` is the chunk's
first layer, wherever it sits in the model); :func:`global_name` turns that into the layer's
index in the whole model (megatron's ``layer_number`` - 1). With tied embeddings the last
stage's own ``output_layer.weight`` is a copy of the word embedding and takes its name.
:func:`global_state` collects every rank's chunks under those names; :func:`load_global`
loads such a state into any split of the same model (replicas and tied copies included).
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist

_LAYER = re.compile(r"(decoder|encoder)\.layers\.(\d+)\.(.*)")


def global_name(chunk: torch.nn.Module, name: str, tied: bool) -> str:
    """``name`` (from ``chunk.named_parameters()``, wrappers' ``module.`` prefixes allowed)
    as the unpipelined model names it."""
    inner = chunk
    while hasattr(inner, "module"):
        inner = inner.module
    while name.startswith("module."):
        name = name.removeprefix("module.")
    match = _LAYER.match(name)
    if match:
        block = getattr(inner, match.group(1))
        number = block.layers[int(match.group(2))].layer_number
        return f"{match.group(1)}.layers.{number - 1}.{match.group(3)}"
    if tied and name == "output_layer.weight":
        return "embedding.word_embeddings.weight"
    return name


def local_state(chunks, tied: bool) -> dict[str, torch.Tensor]:
    """This rank's parameters (copies) by global name; the first chunk holding a name wins."""
    state: dict[str, torch.Tensor] = {}
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            state.setdefault(global_name(chunk, name, tied), param.detach().cpu().clone())
    return state


def global_state(chunks, tied: bool, group=None) -> dict[str, torch.Tensor]:
    """Every rank's :func:`local_state` of ``chunks`` merged (lowest rank wins a name held
    twice). Collective over ``group``: every rank gets the whole model's weights. Refused
    under tensor parallelism (each rank's shard has its layer's name: one would win)."""
    _refuse_tensor_parallel()
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, local_state(chunks, tied), group=group)
    state: dict[str, torch.Tensor] = {}
    for part in gathered:
        for name, tensor in part.items():
            state.setdefault(name, tensor)
    return state


def load_global(chunks, state: dict[str, torch.Tensor], tied: bool) -> None:
    """Copy ``state`` (by global name) into every parameter of ``chunks``; raises KeyError
    naming a parameter the state lacks."""
    with torch.no_grad():
        for chunk in chunks:
            for name, param in chunk.named_parameters():
                key = global_name(chunk, name, tied)
                if key not in state:
                    raise KeyError(f"no weights for {name} (global name {key}) in the state")
                param.copy_(state[key])


def _refuse_tensor_parallel() -> None:
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return
    size = parallel_state.get_tensor_model_parallel_world_size()
    if size > 1:
        raise ValueError(
            f"global_state merges every rank's weights by name, and under tensor parallelism "
            f"(size {size}) each rank holds a shard under its layer's name: the lowest rank's "
            "would stand for the whole tensor; save and load through "
            "megatron_prt.megatron.checkpoint (it keeps each shard's place) or use TP size 1"
        )
