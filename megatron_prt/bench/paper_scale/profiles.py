"""BERT costs profiled on one H200 (committed ``megatron-prt profile`` files), as cost
models in ms beside the analytic V100 ones (:mod:`megatron_prt.sim.analytic`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path

from ...core import Placement
from ...sim.analytic import (
    BERT_BASE,
    BERT_LARGE,
    H200_HBM_BANDWIDTH,
    BertShape,
    Link,
    bert_layer_params,
)
from ...sim.cost import CostModel, LayerCost
from ...tune.partition import (
    uniform_layers,
)

# -- H200: per-layer costs profiled on a GPU -----------------------------------------------------
REPO = Path(__file__).resolve().parents[3]  # the checkout: profiles are committed files
BF16_STATE_BYTES = 18  # the profile's param: bf16 weight 2 + fp32 main grad, main weight, 2 moments
BF16_GRAD_BYTES = 4  # fp32 main_grad: what megatron-core's DDP accumulates and what bi sums


@dataclass(frozen=True)
class Profile:
    """A cost file written by ``megatron-prt profile`` on one H200 for the BERT of ``shape``;
    ``v100`` names the FLOP model of the same shape, ``path`` is relative to the repo."""

    name: str
    v100: str
    shape: BertShape
    path: str

    @property
    def command(self) -> str:
        c = self.shape
        return (
            f"megatron-prt profile --model bert --num-layers {c.layers} --hidden-size "
            f"{c.hidden} --num-attention-heads {c.heads} --seq-length {c.seq} "
            f"--micro-batch-size {c.batch} --vocab-size {c.vocab} --bf16 --device cuda "
            f"-o {self.path}"
        )


PROFILES = {
    p.name: p
    for p in (
        Profile(
            "BERT-base (H200)",
            "BERT-base",
            BERT_BASE,
            "docs/benchmarks/costs/bert-base-h200-bf16.json",
        ),
        Profile(
            "BERT-large (H200)",
            "BERT-large",
            BERT_LARGE,
            "docs/benchmarks/costs/bert-large-h200-bf16.json",
        ),
    )
}


@cache
def profiled(name: str) -> CostModel:
    """The profile of ``name`` with times in ms and ``grad`` set on every part (the profile
    predates the ``grad`` field: fp32 main grads, BF16_GRAD_BYTES / BF16_STATE_BYTES of
    ``param``). Fails if the file is missing or does not describe the profile's shape."""
    p = PROFILES[name]
    path = REPO / p.path
    if not path.is_file():
        raise FileNotFoundError(
            f"{path}: H200 cost profile missing (it is committed; regenerate on a GPU with "
            f"`{p.command}`)"
        )
    raw = CostModel.load(str(path))
    c = p.shape
    if len(raw.layers) != c.layers or raw.message_bytes != 2 * c.seq * c.batch * c.hidden:
        raise ValueError(
            f"{path}: {len(raw.layers)} layers, {raw.message_bytes:g}-byte messages; "
            f"expected {c.layers} layers of bf16 {c.seq} x {c.batch} x {c.hidden} for {name}"
        )

    def in_ms(part: LayerCost) -> LayerCost:
        grad = part.param * BF16_GRAD_BYTES / BF16_STATE_BYTES if part.grad is None else part.grad
        return replace(part.times_scaled(1e3), grad=grad)  # every time, the optional ones too

    return replace(
        raw,
        fwd_time=1e3 * raw.fwd_time,
        bwd_time=1e3 * raw.bwd_time,
        layers=tuple(in_ms(u) for u in raw.layers),
        embedding=in_ms(raw.embedding),
        head=in_ms(raw.head),
        grad_bytes=None,
    )


def state_bytes_per_param(name: str) -> float:
    """The profile's ``param`` bytes of a transformer layer over its parameter count."""
    return profiled(name).layers[0].param / bert_layer_params(PROFILES[name].shape)


def profiled_cost(name: str, placement: Placement, link: Link, replica_sum: bool) -> CostModel:
    """The profile on ``link``, the runtime's default even split of the layers. With
    ``replica_sum`` (and a link that is not free) bi also pays the replica-gradient sum:
    over the same link to the mirrored rank, the received gradients added at a third of
    the H200's HBM bandwidth."""
    cost = replace(
        profiled(name),
        p2p_latency=1e3 * link.latency,
        p2p_bandwidth=link.bandwidth / 1e3,
        stage_layers=uniform_layers(len(profiled(name).layers), placement.depth),
    )
    if not replica_sum or math.isinf(link.bandwidth):
        return cost
    return replace(
        cost,
        replica_latency=1e3 * link.latency,
        replica_bandwidth=link.bandwidth / 1e3,
        replica_add_bandwidth=H200_HBM_BANDWIDTH / 3 / 1e3,
    )
