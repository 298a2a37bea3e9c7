"""megatron's activation recomputation, as rules on layer counts: which layers of a model
stage megatron recomputes and what each keeps (the cost model prices them,
:mod:`megatron_prt.sim.cost`, "Activation recomputation").

A setting is megatron's ``(recompute_granularity, recompute_method, recompute_num_layers)``
(same names, same values; ``(None, None, None)``: off). megatron applies it per model chunk,
which under PRT is a model stage.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..core.placement import ConfigError
from .layer_cost import LayerCost

RECOMPUTE_GRANULARITIES = ("full", "selective")
RECOMPUTE_METHODS = ("uniform", "block")

# What megatron does with one transformer layer of a stage: keeps everything (no
# recomputation), recomputes it and keeps its input (full; selective: all but the attention
# core), or recomputes it inside a uniform block whose first layer keeps the block's input.
KEPT, RECOMPUTED_KEEPS_INPUT, RECOMPUTED_IN_BLOCK = "kept", "recomputed", "in_block"

Setting = tuple  # (granularity, method, num_layers)


def check_recompute(granularity: str | None, method: str | None, num_layers: int | None) -> None:
    """megatron's TransformerConfig rules for its recomputation settings, with its flag
    names in the messages; raises :class:`ConfigError`."""
    if granularity is None:
        if method is not None or num_layers is not None:
            raise ConfigError(
                "--recompute-method and --recompute-num-layers need --recompute-granularity full"
            )
        return
    if granularity not in RECOMPUTE_GRANULARITIES:
        raise ConfigError(f"--recompute-granularity must be full or selective, got {granularity!r}")
    if granularity == "selective" and (method is not None or num_layers is not None):
        raise ConfigError(
            "--recompute-granularity selective takes no --recompute-method or "
            "--recompute-num-layers (megatron's rule); drop them"
        )
    if granularity == "full" and (method not in RECOMPUTE_METHODS or not _count(num_layers)):
        raise ConfigError(
            "--recompute-granularity full needs --recompute-method uniform|block and "
            f"--recompute-num-layers N >= 1, got {method!r} and {num_layers!r}"
        )


def layer_roles(setting: Setting, counts: Sequence[int]) -> list[str]:
    """What megatron does with each transformer layer (in model order) when model stages
    hold ``counts`` layers: :data:`KEPT`, :data:`RECOMPUTED_KEEPS_INPUT` or
    :data:`RECOMPUTED_IN_BLOCK` (full, uniform: the first layer of each block of
    ``num_layers`` keeps the block's input; full, block: the first ``num_layers`` layers of
    each stage are recomputed one by one; selective: every layer)."""
    granularity, method, count = setting
    roles = []
    for layers in counts:
        for i in range(layers):
            if granularity is None or (method == "block" and i >= count):
                roles.append(KEPT)
            elif granularity == "full" and method == "uniform" and i % count:
                roles.append(RECOMPUTED_IN_BLOCK)
            else:
                roles.append(RECOMPUTED_KEEPS_INPUT)
    return roles


def runs_whole_blocks(setting: Setting, counts: Sequence[int]) -> bool:
    """Whether megatron can run stages of ``counts`` layers: full + uniform recomputes whole
    blocks of ``num_layers`` per stage (and fails with an ``IndexError`` on a partial one)."""
    granularity, method, count = setting
    if granularity != "full" or method != "uniform":
        return True
    return all(layers % count == 0 for layers in counts)


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def fold_blocks(
    layers: Sequence[LayerCost], unit: int, granularity: str, inputs: Sequence[float]
) -> tuple[LayerCost, ...]:
    """Every block of ``unit`` layers as one recomputed layer
    (:meth:`~megatron_prt.sim.cost.CostModel.folded_recompute`): the first layer's kept
    bytes (``inputs[i]``: layer i's input, kept where it has no ``full_act``), the summed
    times, parameters and gradients, the last layer's message out."""
    folded = []
    for first in range(0, len(layers), unit):
        block = layers[first : first + unit]
        pairs = zip(block, inputs[first : first + unit], strict=True)
        recomputed = [layer.recomputed(granularity, size) for layer, size in pairs]
        bwd = sum(bwd for _, bwd in recomputed)
        wgrads = [layer.wgrad for layer in block]
        folded.append(
            LayerCost(
                fwd=sum(layer.fwd for layer in block),
                bwd=bwd,
                act=recomputed[0][0],
                param=sum(layer.param for layer in block),
                grad=sum(layer.grad_bytes for layer in block),
                # [Note: full recomputation has no W], as stage_wgrad_times prices it;
                # a W measured in the split form may exceed this whole-form backward:
                # at most all of it, as stage_wgrad_times bounds it
                wgrad=0.0
                if granularity == "full"
                else (None if any(w is None for w in wgrads) else min(sum(wgrads), bwd)),
                out_bytes=block[-1].out_bytes,
            )
        )
    return tuple(folded)
