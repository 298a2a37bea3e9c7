"""Analytic cost source: per-layer costs of BERT and ResNet from FLOP and byte counts, for
the simulator (:mod:`megatron_prt.sim.simulate`), without a GPU or a profile.

A model is a list of units (BERT: embedding, transformer layers, a classification head;
ResNet v1.5: stem, bottleneck blocks, pooling + fc) with forward FLOPs, activation bytes kept
for backward, parameters and the bytes of the tensor that crosses a stage boundary after it,
all computed from the architecture. Times come from the public peak FLOP/s of an NVIDIA V100
times an achieved fraction of it (:class:`Calibration`: NVIDIA's published single-GPU
training throughput over our FLOP count); a p2p hop costs a latency plus bytes over a
:class:`Link`'s bandwidth. :func:`cost_model` turns a model, a placement and a link into the
same :class:`~megatron_prt.sim.cost.CostModel` a profiled JSON file gives (times in ms,
bytes in bytes). Standard library only (like all of megatron_prt.sim).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cache

from ..core import Placement
from .cost import CostModel, LayerCost

FP16 = 2  # bytes per activation element (mixed precision)
TRAIN_STATE_BYTES = 16  # per parameter: fp16 weight + grad, fp32 master + 2 Adam moments
BWD_OVER_FWD = 2.0  # backward = grad of inputs + grad of weights, each ~ one forward
GIB = 2**30


# -- hardware: public figures -------------------------------------------------------------------
@dataclass(frozen=True)
class Link:
    """One p2p hop between neighbouring pipeline ranks: ``bandwidth`` bytes/s in one
    direction, ``latency`` s per message (``bandwidth`` inf and ``latency`` 0: free)."""

    key: str
    label: str
    bandwidth: float
    latency: float


LINKS = {
    "nvlink": Link("nvlink", "NVLink 2.0, one link (25 GB/s, 10 us)", 25e9, 10e-6),
    "nvswitch": Link("nvswitch", "NVSwitch, 6 NVLink 2.0 links (150 GB/s, 10 us)", 150e9, 10e-6),
    "pcie": Link("pcie", "PCIe 3.0 x16 (15.75 GB/s, 20 us)", 15.75e9, 20e-6),
    "free": Link("free", "free (no communication cost)", math.inf, 0.0),
    "nvlink4": Link(
        "nvlink4", "NVLink 4 through NVSwitch, 18 links (450 GB/s, 10 us)", 450e9, 10e-6
    ),
    "pcie5": Link("pcie5", "PCIe 5.0 x16 (63 GB/s, 20 us)", 63.0e9, 20e-6),
}
H200_LINKS = ("free", "nvlink4", "pcie5")

V100_PEAK_FLOPS = 125e12  # FP16 tensor-core peak, FLOP/s (NVIDIA)
V100_MEMORY = 32 * GIB  # V100 SXM2 32GB (the DGX-1 32G of the calibration runs)
H200_MEMORY = 141e9  # H200 SXM 141 GB HBM3e (NVIDIA)
H200_HBM_BANDWIDTH = 4.8e12  # bytes/s (NVIDIA); summing replica gradients reads 2, writes 1


# -- models: units of FLOPs and bytes -----------------------------------------------------------
@dataclass(frozen=True)
class Unit:
    """One partitionable piece for one micro-batch: ``fwd_flops`` FLOPs (a multiply-add is
    2), ``act_bytes`` kept from its forward for its backward, ``params`` parameters,
    ``out_bytes`` of its output (what a stage ending with it sends; its gradient is the same
    size); ``in_bytes`` of its input when ``act_bytes`` leaves it out (kept as the previous
    unit's output: held again only by a stage the unit begins, which received it)."""

    name: str
    fwd_flops: float
    act_bytes: float
    params: int
    out_bytes: float
    in_bytes: float = 0.0


@dataclass(frozen=True)
class Model:
    """``embedding`` (stage 0), ``layers`` (split over the stages), ``head`` (last stage);
    ``micro_batch`` describes one micro-batch; ``efficiency`` is the achieved fraction of
    peak FLOP/s its units run at."""

    name: str
    family: str
    micro_batch: str
    embedding: Unit
    layers: tuple[Unit, ...]
    head: Unit
    efficiency: float

    @property
    def units(self) -> tuple[Unit, ...]:
        return (self.embedding, *self.layers, self.head)

    @property
    def params(self) -> int:
        return sum(u.params for u in self.units)


# BERT: Devlin et al. 2019 sizes, vocabulary 30522, 512 positions, 2 token types.
@dataclass(frozen=True)
class BertShape:
    """``layers`` L, ``hidden`` h, ``heads`` a, ``seq`` s tokens, ``batch`` b sequences per
    micro-batch, ``vocab`` V, ``positions`` and ``types`` embedding rows, ``classes`` of
    the classifier."""

    layers: int
    hidden: int
    heads: int
    seq: int = 512
    batch: int = 8
    vocab: int = 30522
    positions: int = 512
    types: int = 2
    classes: int = 2


BERT_BASE = BertShape(layers=12, hidden=768, heads=12)
BERT_LARGE = BertShape(layers=24, hidden=1024, heads=16)


def bert_layer_flops(c: BertShape) -> float:
    """Forward FLOPs of one transformer layer: 24bsh^2 (QKV, projection, MLP GEMMs) +
    4bs^2h (scores and weighted sum) (Narayanan et al. 2021)."""
    b, s, h = c.batch, c.seq, c.hidden
    return 24 * b * s * h**2 + 4 * b * s**2 * h


def bert_layer_act_bytes(c: BertShape) -> float:
    """Bytes one layer keeps for backward, fp16, no recomputation, no tensor parallelism:
    sbh(34 + 5as/h) (Korthikanti et al. 2022, "Reducing Activation Recomputation")."""
    b, s, h, a = c.batch, c.seq, c.hidden, c.heads
    return s * b * h * (34 + 5 * a * s / h)


def bert_layer_params(c: BertShape) -> int:
    """QKV + output projection (4h^2 + 4h), MLP (8h^2 + 5h), two LayerNorms (4h)."""
    return 12 * c.hidden**2 + 13 * c.hidden


def bert_embedding(c: BertShape) -> Unit:
    """Word + position + type lookups, LayerNorm, dropout: no GEMM, so no FLOPs counted;
    keeps the LayerNorm input (2sbh bytes) and the dropout mask (sbh)."""
    sbh = c.seq * c.batch * c.hidden
    params = (c.vocab + c.positions + c.types) * c.hidden + 2 * c.hidden
    return Unit("embedding", 0.0, 3 * sbh, params, FP16 * sbh)


def bert_classifier(c: BertShape) -> Unit:
    """Pooler (dense + tanh on the first token) and a linear classifier, as in sequence
    classification fine-tuning (the abstract says BERT, not which task; a classifier keeps
    the head small, see the report)."""
    b, h = c.batch, c.hidden
    flops = 2 * b * h * h + 2 * b * h * c.classes
    act = b * h * (FP16 + FP16 + 1 + FP16)  # pooler input, tanh output, dropout mask, fc input
    params = h * h + h + h * c.classes + c.classes
    sent = FP16 * c.seq * b * h  # the last layer's whole output, which its stage receives
    return Unit("classifier", flops, act, params, 0.0, in_bytes=sent)


def bert_mlm_head_flops(c: BertShape, decoded: float = 1.0) -> float:
    """Forward FLOPs of the pretraining MLM head: the h x h transform and the h x V decoder
    over a ``decoded`` fraction of the tokens (used only to calibrate against NVIDIA's
    pretraining throughput)."""
    tokens = c.batch * c.seq
    return decoded * (2 * tokens * c.hidden**2 + 2 * tokens * c.hidden * c.vocab)


def bert(name: str, c: BertShape, efficiency: float) -> Model:
    layer = Unit(
        "layer",
        bert_layer_flops(c),
        bert_layer_act_bytes(c),
        bert_layer_params(c),
        FP16 * c.seq * c.batch * c.hidden,
    )
    micro = f"{c.batch} sequences x {c.seq} tokens"
    return Model(
        name,
        "BERT",
        micro,
        bert_embedding(c),
        (layer,) * c.layers,
        bert_classifier(c),
        efficiency,
    )


# ResNet v1.5 (torchvision): bottleneck blocks, stride on the 3x3 conv, 224x224 inputs.
RESNET_BLOCKS = {50: (3, 4, 6, 3), 101: (3, 4, 23, 3), 152: (3, 8, 36, 3)}
RESNET_WIDTHS = (64, 128, 256, 512)
EXPANSION = 4
IMAGE = 224
RESNET_BATCH = 32  # images per micro-batch
CLASSES = 1000


@dataclass(frozen=True)
class Conv:
    """A bias-free convolution producing an ``out_hw`` x ``out_hw`` map, one image."""

    cin: int
    cout: int
    kernel: int
    out_hw: int

    @property
    def macs(self) -> int:
        return self.cin * self.cout * self.kernel**2 * self.out_hw**2

    @property
    def params(self) -> int:
        return self.cin * self.cout * self.kernel**2 + 2 * self.cout  # + BatchNorm scale, shift

    @property
    def out_elements(self) -> int:
        return self.cout * self.out_hw**2


def bottleneck_convs(cin: int, width: int, stride: int, hw_in: int) -> list[Conv]:
    """conv1 1x1, conv2 3x3 (stride), conv3 1x1 (x4 channels), then the 1x1 downsample
    shortcut when the shape changes."""
    hw_out = hw_in // stride
    convs = [Conv(cin, width, 1, hw_in), Conv(width, width, 3, hw_out)]
    convs.append(Conv(width, width * EXPANSION, 1, hw_out))
    if stride != 1 or cin != width * EXPANSION:
        convs.append(Conv(cin, width * EXPANSION, 1, hw_out))
    return convs


def bottleneck_act_elements(convs: list[Conv]) -> int:
    """Elements kept for backward, one image. conv1 and conv2 each keep their output (the
    BatchNorm input) and the ReLU output (the next conv's input); conv3 keeps its output
    (BatchNorm input) and the block output after the add and ReLU; the shortcut keeps its
    BatchNorm input. The block input was kept as the previous unit's output."""
    first, second, third, *shortcut = convs
    kept = 2 * first.out_elements + 2 * second.out_elements + 2 * third.out_elements
    return kept + sum(c.out_elements for c in shortcut)


def bottleneck(name: str, convs: list[Conv], batch: int) -> Unit:
    flops = 2 * sum(c.macs for c in convs) * batch
    act = FP16 * bottleneck_act_elements(convs) * batch
    params = sum(c.params for c in convs)
    received = FP16 * convs[0].cin * convs[0].out_hw ** 2 * batch  # conv1: 1x1, stride 1
    return Unit(name, flops, act, params, FP16 * convs[2].out_elements * batch, received)


def resnet_stem(batch: int) -> Unit:
    """conv 7x7/2 (3 -> 64) + BatchNorm + ReLU + maxpool 3x3/2. Keeps the image, the
    BatchNorm input, the ReLU output and the maxpool indices (int64)."""
    conv = Conv(3, 64, 7, IMAGE // 2)
    pooled = conv.cout * (IMAGE // 4) ** 2
    act = FP16 * (3 * IMAGE**2 + 2 * conv.out_elements) + 8 * pooled
    return Unit("stem", 2 * conv.macs * batch, act * batch, conv.params, FP16 * pooled * batch)


def resnet_head(batch: int) -> Unit:
    """Global average pool + fc (2048 -> 1000) + softmax cross-entropy (fp32 probabilities)."""
    features = RESNET_WIDTHS[-1] * EXPANSION
    flops = 2 * features * CLASSES * batch
    act = (FP16 * features + 4 * CLASSES) * batch
    received = FP16 * features * (IMAGE // 32) ** 2 * batch  # layer4's output map
    return Unit("head", flops, act, features * CLASSES + CLASSES, 0.0, received)


def resnet_blocks(depth: int, batch: int) -> tuple[Unit, ...]:
    blocks, cin, hw = [], 64, IMAGE // 4
    for stage, (count, width) in enumerate(zip(RESNET_BLOCKS[depth], RESNET_WIDTHS, strict=True)):
        for i in range(count):
            stride = 2 if stage > 0 and i == 0 else 1
            convs = bottleneck_convs(cin, width, stride, hw)
            blocks.append(bottleneck(f"layer{stage + 1}.{i}", convs, batch))
            cin, hw = width * EXPANSION, hw // stride
    return tuple(blocks)


def resnet(depth: int, efficiency: float, batch: int = RESNET_BATCH) -> Model:
    micro = f"{batch} images {IMAGE}x{IMAGE}"
    return Model(
        f"ResNet-{depth}",
        "ResNet",
        micro,
        resnet_stem(batch),
        resnet_blocks(depth, batch),
        resnet_head(batch),
        efficiency,
    )


# -- calibration: achieved fraction of peak from published throughput ---------------------------
@dataclass(frozen=True)
class Calibration:
    """A measured single-GPU training rate (``items_per_s``) and the training FLOPs of one
    item by our own counts; ``source`` says where the rate is published."""

    what: str
    items_per_s: float
    train_flops_per_item: float
    source: str

    @property
    def efficiency(self) -> float:
        return self.items_per_s * self.train_flops_per_item / V100_PEAK_FLOPS


MASKED = 0.15  # BERT's masked-token fraction, for the "decoder on masked tokens only" bound


def bert_calibration(decoded: float = 1.0) -> Calibration:
    """BERT-large pretraining, seq 512, 8 sequences per GPU, mixed precision, 1 x V100 32GB:
    30.08 sequences/s. Our FLOPs: 24 layers + the MLM head over a ``decoded`` fraction of
    the tokens (default all), x3 for forward + backward."""
    c = replace(BERT_LARGE, batch=1)
    fwd = c.layers * bert_layer_flops(c) + bert_mlm_head_flops(c, decoded)
    return Calibration(
        "BERT-large pretraining, seq 512, batch 8, 1 x V100 32GB, mixed precision",
        30.08,
        (1 + BWD_OVER_FWD) * fwd,
        "NVIDIA DeepLearningExamples, PyTorch/LanguageModeling/BERT/README.md "
        '("Pre-training NVIDIA DGX-1 With 32G")',
    )


def resnet_calibration() -> Calibration:
    """ResNet-50 v1.5 training, mixed precision, 1 x V100 32GB: 1156 images/s."""
    one_image = sum(u.fwd_flops for u in resnet(50, 1.0, batch=1).units)
    return Calibration(
        "ResNet-50 v1.5 training, 1 x V100 32GB, mixed precision",
        1156.0,
        (1 + BWD_OVER_FWD) * one_image,
        "NVIDIA DeepLearningExamples, PyTorch/Classification/ConvNets/resnet50v1.5/README.md "
        '("Training performance: NVIDIA DGX-1 32GB")',
    )


@cache
def models() -> dict[str, Model]:
    bert_eff = bert_calibration().efficiency
    resnet_eff = resnet_calibration().efficiency
    out = [bert("BERT-base", BERT_BASE, bert_eff), bert("BERT-large", BERT_LARGE, bert_eff)]
    out += [resnet(depth, resnet_eff) for depth in RESNET_BLOCKS]
    return {m.name: m for m in out}


# -- cost model per configuration ---------------------------------------------------------------
def flops_ms(model: Model, flops: float) -> float:
    """Milliseconds ``flops`` take at the model's achieved FLOP/s."""
    return 1e3 * flops / (V100_PEAK_FLOPS * model.efficiency)


def layer_cost(model: Model, unit: Unit) -> LayerCost:
    fwd = flops_ms(model, unit.fwd_flops)
    params = TRAIN_STATE_BYTES * unit.params
    return LayerCost(
        fwd,
        BWD_OVER_FWD * fwd,
        unit.act_bytes,
        params,
        in_act=unit.in_bytes or None,
        out_bytes=unit.out_bytes,
    )


def mean_hop_bytes(cost: CostModel, placement: Placement, stage_layers: Sequence[int]) -> float:
    """Mean message over the cuts that cross ranks (what a report shows as one hop; the
    simulator prices every cut on its own message: :meth:`CostModel.cut_message_bytes`)."""
    rank_of = placement.stage_to_rank
    sizes = [
        size
        for k, size in enumerate(cost.cut_message_bytes(stage_layers))
        if rank_of[k] != rank_of[k + 1]
    ]
    return sum(sizes) / len(sizes) if sizes else 0.0


def cost_model(model: Model, placement: Placement, link: Link) -> CostModel:
    """Times in ms, bytes in bytes; the runtime's default even split of the layers
    (:meth:`CostModel.layer_counts`: earlier stages take the remainder; with fewer layers
    than stages the last stages are empty), embedding on stage 0, head on stage D-1."""
    even = CostModel(
        layers=tuple(layer_cost(model, u) for u in model.layers),
        embedding=layer_cost(model, model.embedding),
        head=layer_cost(model, model.head),
    )
    stage_layers = even.layer_counts(placement.depth)
    return replace(
        even,
        p2p_latency=1e3 * link.latency,
        p2p_bandwidth=link.bandwidth / 1e3,
        message_bytes=mean_hop_bytes(even, placement, stage_layers),
        stage_layers=stage_layers,
    )
