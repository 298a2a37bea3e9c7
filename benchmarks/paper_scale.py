"""PRT at the paper's scale, simulated: BERT and ResNet on 8 GPUs from FLOP and byte counts.

    python benchmarks/paper_scale.py                  # writes docs/benchmarks/paper_scale.md
    python benchmarks/paper_scale.py --quick          # m=8 only, no extras; prints the report
    python benchmarks/paper_scale.py --out FILE

No GPU is used. Each model is a list of units (BERT: embedding, transformer layers, a
classification head; ResNet: stem, bottleneck blocks, pooling + fc) with forward FLOPs,
activation bytes kept for backward, parameters and the bytes of the tensor that crosses a
stage boundary after it, all computed from the architecture below. Times come from public
peak figures of an NVIDIA V100 times an achieved fraction derived from NVIDIA's published
single-GPU training throughput; a p2p hop costs a latency plus bytes over a link bandwidth.
The simulator (:mod:`megatron_prt.sim.simulate`) then times the plans from
:func:`megatron_prt.core.build_plan` for 1F1B, PRT uni (R in {2, 4}, loop/wave), Chimera-style
bi (R = 1) and PRT bi (R in {2, 4}, loop/wave), and the report sets the gains beside the
paper's (Ji et al., IEEE CLUSTER 2025, abstract only). Every PRT-generator row is timed on
two plans, the one built for the real costs and the runtime's default one built for uniform
stages, and the faster is kept (:func:`candidate_plans`). Every figure and assumption used is
stated in the report (:func:`assumptions`), and every number its summary quotes is computed
from the simulations (:func:`summary`). The section on BERT costs profiled on an H200 also
times 1F1B and PRT uni on the partitioner's fastest layer split (:func:`balanced_cost`).
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from functools import cache
from itertools import pairwise
from pathlib import Path

from megatron_prt.core import Placement, build_plan
from megatron_prt.core.plan import Plan
from megatron_prt.sim.cost import CostModel, LayerCost
from megatron_prt.sim.simulate import simulate
from megatron_prt.tune.partition import (
    DEFAULT_SLACK,
    EXHAUSTIVE_LIMIT,
    partition,
    uniform_layers,
)

RANKS = 8  # the paper used 8 GPUs; we put all of them in one pipeline
FP16 = 2  # bytes per activation element (mixed precision)
TRAIN_STATE_BYTES = 16  # per parameter: fp16 weight + grad, fp32 master + 2 Adam moments
BWD_OVER_FWD = 2.0  # backward = grad of inputs + grad of weights, each ~ one forward
GIB = 2**30
DEFAULT_OUT = "docs/benchmarks/paper_scale.md"
MICROBATCHES = (8, 16, 32)
CURVE_MICROBATCHES = (2, 4, 6, 8, 12, 16, 32)  # where "our gain = the paper's" is sought
REUSES = (2, 4)
PLACEMENTS = ("loop", "wave")

# Throughput gains of PRT reported in the paper's abstract: uni over 1F1B, bi over Chimera.
PAPER_GAINS = {
    ("BERT", "uni"): 0.5478,
    ("BERT", "bi"): 0.3038,
    ("ResNet", "uni"): 0.7659,
    ("ResNet", "bi"): 0.2645,
}


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
MAIN_LINK = "nvlink"
SENSITIVITY_LINKS = ("free", "nvswitch", "nvlink", "pcie")
V100_LINKS = ("nvlink", "nvswitch", "pcie", "free")
H200_MAIN_LINK = "nvlink4"
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
    size)."""

    name: str
    fwd_flops: float
    act_bytes: float
    params: int
    out_bytes: float


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
    return Unit("classifier", flops, act, params, 0.0)


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
    return Unit(name, flops, act, params, FP16 * convs[2].out_elements * batch)


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
    return Unit("head", flops, act, features * CLASSES + CLASSES, 0.0)


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
def ms(model: Model, flops: float) -> float:
    """Milliseconds ``flops`` take at the model's achieved FLOP/s."""
    return 1e3 * flops / (V100_PEAK_FLOPS * model.efficiency)


def layer_cost(model: Model, unit: Unit) -> LayerCost:
    fwd = ms(model, unit.fwd_flops)
    return LayerCost(fwd, BWD_OVER_FWD * fwd, unit.act_bytes, TRAIN_STATE_BYTES * unit.params)


def cut_bytes(model: Model, stage_layers: Sequence[int]) -> list[float]:
    """Bytes sent after model stage k, k = 0..D-2: the output of the last unit before the
    cut (an empty stage passes on what it received)."""
    out, done = [], 0
    for count in stage_layers[:-1]:
        done += count
        out.append(model.layers[done - 1].out_bytes if done else model.embedding.out_bytes)
    return out


def mean_hop_bytes(model: Model, placement: Placement, stage_layers: Sequence[int]) -> float:
    """Mean message over the cuts that cross ranks. The simulator charges one hop time for
    every cross-rank edge, so the mean makes the sum over a micro-batch's path exact (turns
    of a wave are same-rank copies and cost nothing)."""
    rank_of = placement.stage_to_rank
    sizes = [
        size
        for k, size in enumerate(cut_bytes(model, stage_layers))
        if rank_of[k] != rank_of[k + 1]
    ]
    return sum(sizes) / len(sizes) if sizes else 0.0


def cost_model(model: Model, placement: Placement, link: Link) -> CostModel:
    """Times in ms, bytes in bytes; the runtime's default even split of the layers
    (earlier stages take the remainder; with fewer layers than stages the last stages are
    empty), embedding on stage 0, head on stage D-1."""
    stage_layers = uniform_layers(len(model.layers), placement.depth)
    return CostModel(
        p2p_latency=1e3 * link.latency,
        p2p_bandwidth=link.bandwidth / 1e3,
        message_bytes=mean_hop_bytes(model, placement, stage_layers),
        layers=tuple(layer_cost(model, u) for u in model.layers),
        stage_layers=stage_layers,
        embedding=layer_cost(model, model.embedding),
        head=layer_cost(model, model.head),
    )


# -- H200: per-layer costs profiled on a GPU -----------------------------------------------------
REPO = Path(__file__).resolve().parents[1]
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
        return replace(part, fwd=1e3 * part.fwd, bwd=1e3 * part.bwd, grad=grad)

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


# -- variants and one simulation -----------------------------------------------------------------
IDEAL = "uniform stages"  # pseudo-model: D equal stages, forward 1, backward 2 (whole model)
IDEAL_LINK = "free"


@dataclass(frozen=True)
class Variant:
    """A schedule to time. ``role``: ``baseline`` (1F1B, Chimera-style bi), ``prt`` (R > 1)
    or ``reference`` (the PRT generator at R = 1, uni: a 1F1B order that knows the costs)."""

    label: str
    placement: Placement
    schedule: str
    role: str

    @property
    def direction(self) -> str:
        return self.placement.direction


def baselines() -> list[Variant]:
    return [
        Variant("1F1B", Placement(RANKS, 1), "1f1b", "baseline"),
        Variant("Chimera-style bi R=1", Placement(RANKS, 1, "loop", "bi"), "prt", "baseline"),
    ]


REFERENCE = Variant("R=1 loop/uni", Placement(RANKS, 1), "prt", "reference")


def prt_variants(reuses: Sequence[int]) -> list[Variant]:
    return [
        Variant(f"R={r} {pl}/{d}", Placement(RANKS, r, pl, d), "prt", "prt")
        for d in ("uni", "bi")
        for r in reuses
        for pl in PLACEMENTS
    ]


@dataclass(frozen=True)
class Job:
    """One simulation: a model name (:func:`models`, :data:`PROFILES` or :data:`IDEAL`), a
    :data:`LINKS` key, m, a variant; ``replica_sum``: bi pays the replica-gradient sum
    (profiled models only); ``partition``: ``even`` (the runtime's default split of the
    layers) or ``balanced`` (the partitioner's fastest split, profiled models only: see
    :func:`balanced_cost`)."""

    model: str
    link: str
    microbatches: int
    variant: Variant
    replica_sum: bool = False
    partition: str = "even"


@dataclass(frozen=True)
class Outcome:
    """One simulated iteration: ``ms`` makespan, ``bubble`` idle fraction of P x makespan,
    ``peak_gib`` the largest per-rank peak (activations + training state), ``balance``
    largest over smallest per-rank peak, ``hop_ms`` the time of one p2p hop, ``empty``
    model stages holding no layer, ``plan`` which plan was kept (see
    :func:`candidate_plans`), ``cost_aware_ms`` the makespan of the plan built for the real
    costs (equal to ``ms`` unless the runtime's default plan was faster), ``replica_ms``
    what the bi replica-gradient sum adds to ``ms``, ``stage_layers`` the layers of model
    stages 0..D-1 (empty for the whole-model :data:`IDEAL`), ``search`` how the
    partitioner found a balanced split (empty for the even one)."""

    job: Job
    ms: float
    bubble: float
    peak_gib: float
    balance: float
    hop_ms: float
    empty: int
    plan: str
    cost_aware_ms: float
    replica_ms: float = 0.0
    stage_layers: tuple[int, ...] = ()
    search: str = ""


@cache
def runtime_plan(placement: Placement, microbatches: int) -> Plan:
    """The plan the runtime executes: built for uniform stage times, whatever the costs."""
    return build_plan(placement, microbatches, "prt")


def job_cost(job: Job) -> CostModel:
    if job.model == IDEAL:
        return CostModel()
    if job.model in PROFILES:
        link = LINKS[job.link]
        return profiled_cost(job.model, job.variant.placement, link, job.replica_sum)
    return cost_model(models()[job.model], job.variant.placement, LINKS[job.link])


def rank_loads(cost: CostModel, placement: Placement) -> list[float]:
    """Per rank: forward + backward time of its stages for one micro-batch each."""
    times = cost.stage_times(placement)
    return [
        sum(times.fwd[placement.model_stage(k)] + times.bwd[placement.model_stage(k)] for k in ks)
        for ks in placement.rank_stages
    ]


def candidate_plans(job: Job, cost: CostModel) -> list[tuple[str, Plan]]:
    """(name, plan) pairs worth timing. The PRT generator is greedy list scheduling: given
    the real stage and hop times it usually does best, but not always (with a hop time its
    greedy choices can cascade into a worse order), so its plan for uniform stages, the one
    the runtime executes by default, is timed too and the faster one kept."""
    placement, m = job.variant.placement, job.microbatches
    if job.variant.schedule != "prt":
        return [("textbook", build_plan(placement, m, job.variant.schedule))]
    plans = [("cost-aware", build_plan(placement, m, "prt", cost.stage_times(placement)))]
    if job.model != IDEAL:
        plans.append(("runtime default", runtime_plan(placement, m)))
    return plans


def balanced_cost(job: Job, cost: CostModel) -> tuple[CostModel, str]:
    """``cost`` with the stage layers of the fastest partition the partitioner finds for the
    job's placement, m and schedule within an H200's memory (its time objective; every
    split here peaks far below it, so: the fastest found), and how it searched. The
    partitioner times partitions on the runtime's plan without the bi replica sum; the
    job's rows then time the split like every other (:func:`candidate_plans`)."""
    found = partition(
        cost.without_replica_sync(),
        job.variant.placement,
        job.microbatches,
        budget_bytes=H200_MEMORY,
        schedule=job.variant.schedule,
    )
    search = "exact" if found.exact else f"local search, {found.simulated} simulated"
    return replace(cost, stage_layers=found.stage_layers), search


def run_job(job: Job) -> list[tuple[Job, Outcome]]:
    """The job's outcome; a bi job that pays the replica-gradient sum also gives the same
    job without it, from the same plans (the sum changes no stage time, so no plan)."""
    cost, search = job_cost(job), ""
    if job.partition == "balanced":
        cost, search = balanced_cost(job, cost)
    plans = candidate_plans(job, cost)
    out = [(job, best_outcome(job, cost, plans, search))]
    free = cost.without_replica_sync()
    if job.variant.direction == "bi" and free != cost:
        unpaid = replace(job, replica_sum=False)
        out.append((unpaid, best_outcome(unpaid, free, plans, search)))
    return out


def best_outcome(
    job: Job, cost: CostModel, plans: list[tuple[str, Plan]], search: str = ""
) -> Outcome:
    timed = [(simulate(plan, cost), name) for name, plan in plans]
    result, plan_name = min(timed, key=lambda t: t[0].makespan)
    peaks = [r.peak_activation_bytes + r.param_bytes for r in result.per_rank]
    cost_aware = timed[0][0].makespan  # the first candidate: textbook or cost-aware
    return Outcome(
        job,
        result.makespan,
        result.bubble_fraction,
        max(peaks) / GIB,
        max(peaks) / min(peaks) if min(peaks) > 0 else math.inf,
        cost.hop_time,
        cost.layer_counts(job.variant.placement.depth).count(0) if cost.layers else 0,
        plan_name,
        cost_aware,
        result.replica_sync_time,
        cost.layer_counts(job.variant.placement.depth) if cost.layers else (),
        search,
    )


def job_weight(job: Job) -> float:
    """Rough relative CPU time of :func:`run_job`: the PRT planner runs a portfolio of list
    schedules over all 2 D m actions two or three times per plan (once per competing set of
    stage times, see :func:`megatron_prt.core.schedules.prt`), the textbook 1F1B plan is
    written down directly; a balanced split first searches partitions."""
    placement = job.variant.placement
    size = placement.depth * job.microbatches
    weight = 3.0 * size if job.variant.schedule == "prt" else 0.1 * size
    return weight + (5.0 * size if job.partition == "balanced" else 0.0)


def run_all(jobs: list[Job], workers: int) -> dict[Job, Outcome]:
    """Simulate every job, on ``workers`` processes (1: in this process). The pool gets
    the heaviest jobs first, one at a time, so that both processes finish together; the
    outcomes come back in the order of ``jobs`` (ties between equally fast variants go to
    the first, see :meth:`Results.compare`)."""
    if workers <= 1:
        return {j: o for job in jobs for j, o in run_job(job)}
    heaviest_first = sorted(jobs, key=job_weight, reverse=True)
    with ProcessPoolExecutor(workers) as pool:
        done = dict(zip(heaviest_first, pool.map(run_job, heaviest_first), strict=True))
    return {j: o for job in jobs for j, o in done[job]}


# -- what the report asks for --------------------------------------------------------------------
@dataclass(frozen=True)
class Comparison:
    """For one model, link, m and direction: the baseline, the fastest PRT variant and the
    PRT generator's own R = 1 order (uni: :data:`REFERENCE`; bi: the baseline itself)."""

    baseline: Outcome
    best: Outcome
    reference: Outcome
    candidates: tuple[Outcome, ...]

    @property
    def gain(self) -> float:
        """Throughput gain of the best PRT variant over the baseline (0.5 = +50%)."""
        return self.baseline.ms / self.best.ms - 1

    @property
    def reuse_gain(self) -> float:
        """Gain over the same generator at R = 1: what reuse adds on its own."""
        return self.reference.ms / self.best.ms - 1


class Results(dict):
    """Job -> Outcome, looked up by what the tables ask for."""

    def at(
        self, name: str, link: str, m: int, variant: Variant, replica_sum=False, split="even"
    ) -> Outcome:
        return self[Job(name, link, m, variant, replica_sum, split)]

    def compare(
        self,
        name: str,
        link: str,
        m: int,
        direction: str,
        replica_sum: bool = False,
        split: str = "even",
    ) -> Comparison:
        key = (name, link, m, replica_sum, split)
        here = [
            o
            for j, o in self.items()
            if (j.model, j.link, j.microbatches, j.replica_sum, j.partition) == key
            and j.variant.direction == direction
        ]
        base = next(o for o in here if o.job.variant.role == "baseline")
        prts = tuple(o for o in here if o.job.variant.role == "prt")
        ref = next((o for o in here if o.job.variant.role == "reference"), base)
        return Comparison(base, min(prts, key=lambda o: o.ms), ref, prts)

    def gains(
        self, name: str, link: str, ms_: Sequence[int], direction: str, replica_sum=False
    ) -> dict[int, float]:
        return {m: self.compare(name, link, m, direction, replica_sum).gain for m in ms_}


def crossings(gains: dict[int, float], target: float) -> list[float]:
    """The m at which the gain curve crosses ``target``, interpolated linearly in log m
    between neighbouring simulated m."""
    points = sorted(gains.items())
    out = []
    for (m0, g0), (m1, g1) in pairwise(points):
        if g0 != g1 and min(g0, g1) <= target <= max(g0, g1):
            x = math.log(m0) + (target - g0) / (g1 - g0) * (math.log(m1) - math.log(m0))
            out.append(math.exp(x))
    return out


def matching_m(gains: dict[int, float], target: float) -> str:
    found = crossings(gains, target)
    if found:
        return " and ".join(f"m ≈ {x:.1f}" for x in found)
    top_m, top = max(gains.items(), key=lambda p: p[1])
    return f"never (largest {top:+.1%}, at m = {top_m})"


# -- report --------------------------------------------------------------------------------------
def fmt_gib(x: float, limit: float = V100_MEMORY) -> str:
    flag = " (!)" if x * GIB > limit else ""
    return f"{x:.1f}{flag}"


def pct(x: float) -> str:
    return f"{x:+.1%}"


def model_rows(names: Sequence[str]) -> list[str]:
    rows = [
        "| model | micro-batch | layers (units) | params | fwd GFLOP / micro-batch | "
        "fwd ms / micro-batch | act GiB / micro-batch | stage messages MiB (min..max) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in names:
        m = models()[name]
        outs = [u.out_bytes for u in (m.embedding, *m.layers[:-1])]
        flops = sum(u.fwd_flops for u in m.units)
        rows.append(
            f"| {name} | {m.micro_batch} | {len(m.layers)} (+{m.embedding.name}, "
            f"+{m.head.name}) | {m.params / 1e6:.1f} M | {flops / 1e9:.0f} | "
            f"{ms(m, flops):.1f} | {sum(u.act_bytes for u in m.units) / GIB:.2f} | "
            f"{min(outs) / 2**20:.1f}..{max(outs) / 2**20:.1f} |"
        )
    return rows


def main_table(results: Results, names, link: str, ms_, replica_sum=False) -> list[str]:
    rows = [
        "| model | m | schedule | iteration ms | bubble | gain | reuse alone | vs 1F1B | "
        "hop ms | peak GiB/rank | max/min |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in names:
        for m in ms_:
            one_f_one_b = results.compare(name, link, m, "uni", replica_sum).baseline.ms
            for direction in ("uni", "bi"):
                c = results.compare(name, link, m, direction, replica_sum)
                rows.append(_outcome_row(c.baseline, "", "", one_f_one_b))
                rows.append(
                    _outcome_row(c.best, f"**{pct(c.gain)}**", pct(c.reuse_gain), one_f_one_b)
                )
    return rows


def _outcome_row(o: Outcome, gain: str, reuse: str, one_f_one_b: float) -> str:
    v = o.job.variant
    label = v.label if v.role == "baseline" else f"PRT {v.label}"
    if o.empty:
        label += f" ({o.empty} empty stages)"
    return (
        f"| {o.job.model} | {o.job.microbatches} | {label} | {o.ms:.1f} | {o.bubble:.1%} | "
        f"{gain} | {reuse} | {one_f_one_b / o.ms:.3f}x | {o.hop_ms:.3f} | "
        f"{fmt_gib(o.peak_gib, H200_MEMORY if o.job.model in PROFILES else V100_MEMORY)} | "
        f"{o.balance:.2f} |"
    )


def all_variants(reuses: Sequence[int]) -> list[Variant]:
    uni = [v for v in prt_variants(reuses) if v.direction == "uni"]
    bi = [v for v in prt_variants(reuses) if v.direction == "bi"]
    first, chimera = baselines()
    return [first, REFERENCE, *uni, chimera, *bi]


def candidates_table(results: Results, names, link: str, ms_, reuses, replica_sum=False):
    variants = all_variants(reuses)
    rows = [
        "| model | m | " + " | ".join(v.label for v in variants) + " |",
        "|---|---|" + "---|" * len(variants),
    ]
    for name in names:
        for m in ms_:
            cells = [_ms_cell(results.at(name, link, m, v, replica_sum)) for v in variants]
            rows.append(f"| {name} | {m} | " + " | ".join(cells) + " |")
    return rows


def _ms_cell(o: Outcome) -> str:
    return f"{o.ms:.1f}" + ("†" if o.plan == "runtime default" else "")


def paper_rows(names: Sequence[str]) -> list[tuple[str, str]]:
    """(model, link) rows of the paper comparison: the closed-form setting first."""
    return [(IDEAL, IDEAL_LINK)] + [(n, MAIN_LINK) for n in names]


def family_of(name: str) -> tuple[str, ...]:
    return ("BERT", "ResNet") if name == IDEAL else (models()[name].family,)


def paper_table(results: Results, names, ms_, curve) -> list[str]:
    rows = [
        "| model | direction | paper | "
        + " | ".join(f"ours m={m}" for m in ms_)
        + " | ours = paper at |",
        "|---|---|---|" + "---|" * len(ms_) + "---|",
    ]
    for name, link in paper_rows(names):
        for family in family_of(name):
            for direction in ("uni", "bi"):
                target = PAPER_GAINS[(family, direction)]
                gains = results.gains(name, link, curve, direction)
                where = matching_m(gains, target) if len(curve) > 1 else "n/a (--quick)"
                label = f"{name} (vs {family})" if name == IDEAL else name
                cells = " | ".join(pct(gains[m]) for m in ms_)
                rows.append(f"| {label} | {direction} | {target:+.2%} | {cells} | {where} |")
    return rows


def curve_table(results: Results, names, curve) -> list[str]:
    rows = [
        "| model | link | direction | " + " | ".join(f"m={m}" for m in curve) + " |",
        "|---|---|---|" + "---|" * len(curve),
    ]
    for name, link in paper_rows(names):
        for direction in ("uni", "bi"):
            gains = results.gains(name, link, curve, direction)
            cells = " | ".join(pct(gains[m]) for m in curve)
            rows.append(f"| {name} | {link} | {direction} | {cells} |")
    return rows


def sensitivity_table(results: Results, names, links, m: int) -> list[str]:
    rows = [
        "| model | " + " | ".join(f"{k} uni | {k} bi" for k in links) + " |",
        "|---|" + "---|---|" * len(links),
    ]
    for name in names:
        cells = []
        for link in links:
            for direction in ("uni", "bi"):
                c = results.compare(name, link, m, direction)
                p = c.best.job.variant.placement
                cells.append(f"{pct(c.gain)} (R={p.reuse} {p.placement})")
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    return rows


def empty_stage_note(names: Sequence[str], reuses: Sequence[int]) -> str:
    """Which (model, R) leave stages without a layer, computed."""
    notes = [
        f"{name} R={r}: {r * RANKS - len(models()[name].layers)} of {r * RANKS}"
        for name in names
        for r in reuses
        if r * RANKS > len(models()[name].layers)
    ]
    return "; ".join(notes) if notes else "none"


def assumptions(s: Settings) -> list[str]:
    b, r = bert_calibration(), resnet_calibration()
    link_lines = [f"  - `{k}`: {LINKS[k].label}" for k in V100_LINKS]
    return [
        "## Assumptions (all of them)",
        "",
        "What the paper's abstract gives: 8 GPUs, BERT and ResNet, the four gains above. It "
        "does not say which GPUs, interconnect, sequence length, image size, micro-batch size "
        "or number of micro-batches; everything else here is our choice, stated so that it "
        "can be changed.",
        "",
        "- **GPU**: NVIDIA V100 SXM2 32GB, FP16 tensor-core peak 125 TFLOP/s (NVIDIA, "
        "https://developer.nvidia.com/programming-tensor-cores-cuda-9-0). One pipeline of "
        "P = 8 ranks, one GPU each, no data or tensor parallelism.",
        f"- **Achieved fraction of peak**, derived rather than guessed: a published "
        f"single-GPU training rate x our training FLOPs per item / peak. BERT: {b.what}, "
        f"{b.items_per_s:g} sequences/s x {b.train_flops_per_item / 1e9:.0f} GFLOP = "
        f"**{b.efficiency:.1%}** ({b.source}). ResNet: {r.what}, {r.items_per_s:g} images/s x "
        f"{r.train_flops_per_item / 1e9:.1f} GFLOP = **{r.efficiency:.1%}** ({r.source}). "
        "These rates include the optimizer, loss and input pipeline, and were measured at "
        "the READMEs' batch sizes, not necessarily ours. Every unit of a model runs at its "
        "family's fraction: no per-kernel efficiency and no launch overhead, so smaller stages are "
        "not slower per FLOP here, which slightly favours deep pipelines. The MLM decoder "
        f"is counted over every token; if it ran only on the masked {MASKED:.0%}, BERT's "
        f"fraction would be {1 - bert_calibration(MASKED).efficiency / b.efficiency:.1%} "
        "lower: all BERT compute times would grow alike and only the ratio of hop time to "
        "compute time would move.",
        "- **FLOPs**: transformer layer forward 24bsh² + 4bs²h (Narayanan et al. 2021); "
        "convolutions 2 x multiply-adds from their shapes; backward = 2 x forward; "
        "element-wise work (LayerNorm, softmax, BatchNorm, ReLU) is not counted as FLOPs: "
        "its time is inside the achieved fraction. The calculator reproduces torchvision's "
        "parameter counts (25,557,032 / 44,549,160 / 60,192,808) and 4.09 / 7.80 / 11.51 "
        "GMAC for ResNet-50/101/152, and BERT-base's 109,482,240 parameters without the "
        "classifier (`tests/test_paper_scale.py`).",
        "- **Activation bytes** (kept from forward to backward, fp16, no recomputation): "
        "transformer layer sbh(34 + 5as/h) (Korthikanti et al. 2022, *Reducing Activation "
        "Recomputation in Large Transformer Models*, no tensor or sequence parallelism); "
        "embedding 3sbh (LayerNorm input + dropout mask); bottleneck block: per conv its "
        "output (the BatchNorm input) and the ReLU output, plus the block output (see "
        "`bottleneck_act_elements`); the stem adds the image and int64 maxpool indices.",
        "- **Training state**: 16 bytes per parameter (fp16 weight and gradient, fp32 master "
        "weight and two Adam moments; Rajbhandari et al. 2020, ZeRO). bi variants hold two "
        "replicas per rank. peak GiB/rank = the simulator's peak of in-flight activations "
        "+ training state on the worst rank; (!) marks more than a V100's 32 GiB.",
        "- **Models**: BERT-base (L=12, h=768, a=12) and BERT-large (L=24, h=1024, a=16), "
        f"vocabulary 30522, seq {BERT_BASE.seq}, {BERT_BASE.batch} sequences per micro-batch, "
        "with a sequence-classification head (pooler + 2-way linear), i.e. fine-tuning; "
        "ResNet-50/101/152 v1.5 (torchvision layout), 224x224 images, "
        f"{RESNET_BATCH} images per micro-batch, 1000 classes. Units: BERT = embedding + L "
        "layers + head; ResNet = stem + bottleneck blocks + (pool, fc, loss).",
        "- **Partition**: the runtime's default even split of the layers (blocks) over the "
        "D = R x P model stages, earlier stages taking the remainder; embedding/stem on "
        "stage 0, head on stage D-1; the same rule for every variant. With fewer layers "
        "than stages the last stages are empty (they only pass tensors on, one hop each). "
        f"Empty stages: {empty_stage_note(s.names, s.reuses)}.",
        "- **Communication**: one p2p hop = latency + message bytes / bandwidth, overlapped "
        "with compute (it delays the receiver, not the sender), no contention between "
        "concurrent messages. Message = the activation (backward: its gradient) at the "
        "cut, fp16: BERT 2sbh bytes at every cut; ResNet the block output, 8x larger "
        "after layer1 than after layer4. The simulator takes one hop time per "
        "configuration: we use the mean message over that configuration's cross-rank cuts "
        "(exact for the sum along a micro-batch's path). Links (bandwidth per direction; "
        "the latencies are our assumption, not sourced figures):",
        *link_lines,
        f"  The main tables use `{MAIN_LINK}`: a V100 has 6 NVLink 2.0 links, 300 GB/s in "
        "total both ways (NVIDIA's V100 figure), i.e. 25 GB/s per direction per link; "
        "neighbouring GPUs wired directly may share one or more links, we assume one. "
        "`nvswitch` is the case where one GPU reaches its neighbour over all six links "
        "(a switched fabric), an upper bound for V100. PCIe 3.0 x16 is 8 GT/s x 16 lanes "
        "with 128b/130b encoding = 15.75 GB/s per direction before protocol overheads, so "
        "the `pcie` column is optimistic.",
        "- **Plans**: `1F1B` = textbook PipeDream-Flush (`build_plan(..., '1f1b')`, the "
        "order megatron-core runs). Every other row is the PRT generator "
        "(`build_plan(..., 'prt', stage times)`; Chimera-style bi = R=1/bi), timed twice: "
        "with the plan built for the real stage and hop times, and with the plan built for "
        "uniform stages (what the runtime executes by default); the faster is kept († in "
        "the candidates table when it was the runtime's). PRT uni is the fastest of "
        f"R in {{{', '.join(map(str, s.reuses))}}} x {{loop, wave}}; PRT bi likewise. "
        "*gain* = baseline time / PRT time - 1 (uni over 1F1B, bi over Chimera-style bi), "
        "the paper's measure; *reuse alone* = the same against the PRT generator's own R=1 "
        "order (uni: `R=1 loop/uni`; bi: Chimera-style, so equal to *gain*). *bubble* = "
        "idle share of P x iteration time, which includes idle time from unequal ranks, not "
        "only fill and drain.",
        "- **Not modelled**: the optimizer step; in the V100 rows the gradient sum between "
        "the two replicas of every bi stage (Chimera and PRT bi alike; the H200 section "
        "includes it); data loading; kernel launch gaps (the H200 profiles include their "
        "own); smaller GEMMs running less efficiently (likewise); recomputation.",
    ]


@dataclass(frozen=True)
class Settings:
    names: tuple[str, ...]
    microbatches: tuple[int, ...]
    curve: tuple[int, ...]
    reuses: tuple[int, ...]
    sensitivity_links: tuple[str, ...]
    sensitivity_m: int
    h200_names: tuple[str, ...] = tuple(PROFILES)
    h200_links: tuple[str, ...] = H200_LINKS


def settings_of(args) -> Settings:
    names = tuple(models())
    if args.quick:
        return Settings(names, (8,), (8,), args.reuses, (), 8, h200_links=(H200_MAIN_LINK,))
    curve = tuple(sorted(set(CURVE_MICROBATCHES) | set(args.microbatches)))
    return Settings(names, tuple(args.microbatches), curve, args.reuses, SENSITIVITY_LINKS, 8)


def all_jobs(s: Settings) -> list[Job]:
    variants = all_variants(s.reuses)
    jobs = [Job(n, MAIN_LINK, m, v) for n in s.names for m in s.curve for v in variants]
    jobs += [Job(IDEAL, IDEAL_LINK, m, v) for m in s.curve for v in variants]
    for link in s.sensitivity_links:
        if link != MAIN_LINK:
            jobs += [Job(n, link, s.sensitivity_m, v) for n in s.names for v in variants]
    return jobs + h200_jobs(s)


def cpu_seconds() -> float:
    """CPU time of this process and its finished children (the simulation workers), s."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def report(argv: Sequence[str], s: Settings, results: Results, wall_s: float) -> str:
    link = LINKS[MAIN_LINK]
    lines = [
        "# PRT at the paper's scale (simulated): BERT and ResNet on 8 GPUs",
        "",
        f"Command: `{' '.join(['python benchmarks/paper_scale.py', *argv])}`  ",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}; wall time {wall_s:.0f} s (CPU {cpu_seconds():.0f} s) "
        f"for {len(results)} simulated iterations. No GPU was used: every number below is "
        "a simulator prediction from the cost model described under Assumptions.",
        "",
        *summary(results, s),
        "## Against the paper",
        "",
        "Throughput gains (uni: PRT over 1F1B; bi: PRT over Chimera). First the setting of "
        "docs/theory.md (D equal stages, free communication), then our models on "
        f"`{MAIN_LINK}`. The last column is the m at which our gain equals the paper's "
        f"(interpolated in log m over m in {{{', '.join(map(str, s.curve))}}}).",
        "",
        *paper_table(results, s.names, s.microbatches, s.curve),
        "",
        "## The models",
        "",
        *model_rows(s.names),
        "",
        f"## Iteration time, bubble and memory (P = 8, link: {link.label})",
        "",
        "Per model and m: the baseline, then the fastest PRT configuration.",
        "",
        *main_table(results, s.names, MAIN_LINK, s.microbatches),
        "",
    ]
    if len(s.curve) > 1:
        lines += [
            "## Gain by number of micro-batches",
            "",
            *curve_table(results, s.names, s.curve),
            "",
        ]
    if s.sensitivity_links:
        lines += [
            f"## How the gain depends on the link (m = {s.sensitivity_m})",
            "",
            "Gain of the best PRT configuration (in brackets) over its baseline, per link.",
            "",
            *sensitivity_table(results, s.names, s.sensitivity_links, s.sensitivity_m),
            "",
        ]
    lines += [
        f"## Every candidate (iteration ms, `{MAIN_LINK}`)",
        "",
        *candidates_table(results, s.names, MAIN_LINK, s.microbatches, s.reuses),
        "",
        *h200_section(results, s),
        *assumptions(s),
        "",
    ]
    return "\n".join(lines) + "\n"


# -- the written analysis: every number it quotes comes from the results -------------------------
def closed_form_reuse(gain: float, m: int, ranks: int = RANKS) -> float:
    """The R at which the uni closed form (docs/theory.md, section 3) gives ``gain`` over
    1F1B: 1 + gain = [(m + P - 1) / m] x [R m / (R m + P - 1)]; inf if no R does."""
    q = (1 + gain) * m / (m + ranks - 1)
    return math.inf if q >= 1 else q * (ranks - 1) / (m * (1 - q))


def largest_hop(model: Model, link: Link) -> tuple[float, float]:
    """(MiB, ms) of the largest stage message and its hop on ``link``."""
    size = max(u.out_bytes for u in (model.embedding, *model.layers[:-1]))
    return size / 2**20, 1e3 * (link.latency + size / link.bandwidth)


def summary(results: Results, s: Settings) -> list[str]:
    m8 = 8 if 8 in s.curve else s.curve[0]
    lines = ["## Summary", "", *agreement(results, s, m8)]
    if len(s.curve) > 1 and s.sensitivity_links:
        lines += causes(results, s, m8)
    else:  # the causes quote the m sweep and the other links
        lines.append("  (--quick: run without it for the causes, which need every m and link)")
    lines += memory_note(results, s, m8)
    lines += generator_note(results)
    lines += h200_summary(results, s)
    return [*lines, ""]


def h200_summary(results: Results, s: Settings) -> list[str]:
    if not s.h200_names:
        return []
    m = 8 if 8 in s.microbatches else s.microbatches[0]
    heads = " and ".join(
        f"{work(profiled(n).head) / work(mean_layer(profiled(n))):.1f} ({PROFILES[n].v100})"
        for n in s.h200_names
    )
    return [
        f"- **With per-layer costs profiled on an H200** (section below; m = {m}, NVLink 4, "
        f"the bi replica-gradient sum included): PRT uni gains "
        f"{_both(results, s, H200_MAIN_LINK, m, 'uni')} over 1F1B and PRT bi "
        f"{_both(results, s, H200_MAIN_LINK, m, 'bi')} over Chimera-style bi. Messages cost "
        "little at 450 GB/s; what holds the gains down is the pretraining head the profile "
        f"measured, as much work as {heads} layers and on one rank at every R."
        + balanced_summary(results, s, m),
    ]


def balanced_summary(results: Results, s: Settings, m: int) -> str:
    if not any(j.partition == "balanced" for j in results):
        return ""
    gains = {n: _balanced_gains(results, n, m) for n in s.h200_names}
    each = lambda i: ", ".join(f"{PROFILES[n].v100} {pct(g[i])}" for n, g in gains.items())  # noqa: E731
    return (
        " The partitioner's fastest split (fewer layers on the head's stage) speeds 1F1B up "
        f"by {each(0)}; PRT uni on its own fastest split then gains {each(1)} over 1F1B on "
        f"the even split but {each(2)} over 1F1B on its balanced one."
    )


def agreement(results: Results, s: Settings, m8: int) -> list[str]:
    uni, bi = (results.compare(IDEAL, IDEAL_LINK, m8, d) for d in ("uni", "bi"))
    ideal = results.gains(IDEAL, IDEAL_LINK, s.curve, "uni")
    peak_m = max(ideal, key=ideal.get)
    ours = ", ".join(f"{n} {pct(results.compare(n, MAIN_LINK, m8, 'uni').gain)}" for n in s.names)
    ours_bi = ", ".join(f"{n} {pct(results.compare(n, MAIN_LINK, m8, 'bi').gain)}" for n in s.names)
    need = closed_form_reuse(PAPER_GAINS[("ResNet", "uni")], m8)
    reached = [n for n in s.names for d in ("uni", "bi") if _reaches_paper(results, s, n, d)]
    return [
        f"- **Where we agree.** In the closed-form setting (D equal stages, free "
        f"communication, P = 8, m = {m8}) the best PRT uni configuration ({_short(uni.best)}) "
        f"gains {pct(uni.gain)} over 1F1B and the best PRT bi ({_short(bi.best)}) "
        f"{pct(bi.gain)} over Chimera-style bi. The paper's BERT gains (+54.78% uni, +30.38% "
        "bi) and its ResNet bi gain (+26.45%) are, within about a point uni and with m a "
        f"little off P bi (table below), what reuse R = {uni.best.job.variant.placement.reuse} "
        "buys at m ≈ P = 8 when stages are equal and communication is free.",
        f"- **Where we do not.** ResNet's uni gain (+76.59%) is above that closed form for "
        f"R ≤ {max(s.reuses)} at every m simulated (it peaks at {pct(ideal[peak_m])}, "
        f"m = {peak_m}); at m = {m8} the closed form needs R ≈ {need:.0f} "
        f"(about {need * RANKS:.0f} stages, more than ResNet-152 has blocks). "
        f"With our per-layer costs on one NVLink link, at m = {m8}: uni {ours}; bi {ours_bi}. "
        + (
            f"Over m in {{{', '.join(map(str, s.curve))}}} only {', '.join(reached)} reach "
            "the paper's figure."
            if reached
            else "No model reaches the paper's figures at any m we simulated "
            f"({', '.join(map(str, s.curve))})."
        ),
        "- **Why ours are lower**, by cause:",
    ]


def _reaches_paper(results: Results, s: Settings, name: str, direction: str) -> bool:
    target = PAPER_GAINS[(models()[name].family, direction)]
    return max(results.gains(name, MAIN_LINK, s.curve, direction).values()) >= target


def _short(o: Outcome) -> str:
    p = o.job.variant.placement
    return f"R={p.reuse} {p.placement}"


def _gain_at(results: Results, name: str, link: str, m: int, direction: str) -> str:
    if Job(name, link, m, REFERENCE) not in results:
        return "n/a"
    return pct(results.compare(name, link, m, direction).gain)


def causes(results: Results, s: Settings, m8: int) -> list[str]:
    out = []
    if "BERT-base" in s.names:
        out.append(granularity_cause(results, s, m8))
    if "ResNet-50" in s.names and "BERT-large" in s.names:
        out.append(communication_cause(results, s, m8))
    out.append(chimera_cause(results, s))
    if "ResNet-50" in s.names:
        out.append(baseline_cause(results, s, m8))
    return out


def granularity_cause(results: Results, s: Settings, m8: int) -> str:
    free = _gain_at(results, "BERT-base", "free", m8, "uni")
    return (
        "  1. *Layer granularity.* 12 BERT-base layers over 8 ranks put 2 layers on the "
        "busiest rank (1.5 on average) for 1F1B and for every R: reuse shortens fill and "
        f"drain, not this imbalance (with free communication BERT-base gains {free} uni at "
        f"m = {m8}). Stages beyond the layer count are empty "
        f"({empty_stage_note(s.names, s.reuses)}): they add hops and no work. Unequal "
        f"units (a ResNet block with a downsampling shortcut costs {downsample_ratio():.1f}x "
        "a plain one) leave a per-rank imbalance that reuse does not remove either."
    )


def downsample_ratio() -> float:
    """FLOPs of ResNet-50's first layer2 block (downsampling) over its second (plain)."""
    blocks = {u.name: u.fwd_flops for u in models()["ResNet-50"].layers}
    return blocks["layer2.0"] / blocks["layer2.1"]


def communication_cause(results: Results, s: Settings, m8: int) -> str:
    resnet, bert_large = models()["ResNet-50"], models()["BERT-large"]
    link = LINKS[MAIN_LINK]
    mib, hop = largest_hop(resnet, link)
    block_ms = ms(resnet, resnet.layers[1].fwd_flops)
    bert_mib, bert_hop = largest_hop(bert_large, link)
    chain = " → ".join(
        f"{_gain_at(results, 'ResNet-50', k, m8, 'uni')} ({k})" for k in SENSITIVITY_LINKS
    )
    chain_bi = " → ".join(_gain_at(results, "ResNet-50", k, m8, "bi") for k in SENSITIVITY_LINKS)
    return (
        "  2. *Communication.* A micro-batch crosses R·P − 1 rank boundaries each way (loop; "
        "wave: R·(P − 1), its turns stay on one rank) instead of P − 1. "
        f"ResNet's activations are large for its compute: after layer1 a 32-image "
        f"micro-batch sends {mib:.0f} MiB, {hop:.2f} ms on one NVLink link, against "
        f"{block_ms:.2f} ms for a layer1 block's forward. ResNet-50's gain at m = {m8} "
        f"goes {chain} uni and {chain_bi} bi. BERT-large sends {bert_mib:.0f} MiB per cut "
        f"({bert_hop:.2f} ms, {bert_hop / ms(bert_large, bert_large.layers[0].fwd_flops):.0%} "
        "of a layer's forward) and keeps most of its gain ("
        f"{_gain_at(results, 'BERT-large', 'free', m8, 'uni')} free, "
        f"{_gain_at(results, 'BERT-large', MAIN_LINK, m8, 'uni')} on {MAIN_LINK})."
    )


def chimera_cause(results: Results, s: Settings) -> str:
    last = s.curve[-1]
    return (
        "  3. *Chimera is the stronger baseline.* Its fill and drain span ⌊(P−1)/2⌋ = 3 "
        "stages instead of 7, so there is less bubble to remove, and the bound of "
        f"docs/theory.md shrinks fast with m: at m = {last} equal stages give PRT bi "
        f"{_gain_at(results, IDEAL, IDEAL_LINK, last, 'bi')} over Chimera, PRT uni "
        f"{_gain_at(results, IDEAL, IDEAL_LINK, last, 'uni')} over 1F1B."
    )


def baseline_cause(results: Results, s: Settings, m8: int) -> str:
    last = s.curve[-1]
    at8 = results.compare("ResNet-50", MAIN_LINK, m8, "uni")
    at_last = results.compare("ResNet-50", MAIN_LINK, last, "uni")
    ideal = results.gains(IDEAL, IDEAL_LINK, s.curve, "uni")
    resnet = results.gains("ResNet-50", MAIN_LINK, s.curve, "uni")
    return (
        "  4. *m, and what the baseline loses.* In the closed form the gain peaks at m = P "
        "and falls like 1/m after it ("
        + ", ".join(f"{pct(ideal[m])} at m = {m}" for m in s.curve if m >= RANKS)
        + "), which is why the paper's figures sit at m ≈ P. For ResNet on NVLink it grows "
        "with m instead ("
        + ", ".join(f"{pct(resnet[m])} at {m}" for m in s.curve if m >= RANKS)
        + "), and that growth is mostly not reuse: textbook 1F1B keeps a fixed warm-up of "
        "P − r − 1 forwards, so every hop sits on its critical path, while the PRT "
        f"generator's own R = 1 order is already {pct(at8.baseline.ms / at8.reference.ms - 1)} "
        f"faster at m = {m8} and {pct(at_last.baseline.ms / at_last.reference.ms - 1)} at "
        f"m = {last}; against it, reuse alone adds {pct(at8.reuse_gain)} and "
        f"{pct(at_last.reuse_gain)} (column *reuse alone*). A 1F1B baseline with this "
        "weakness on the paper's machine would inflate the measured gain: one possible "
        "reason ResNet's +76.59% exceeds the closed form."
    )


def memory_note(results: Results, s: Settings, m8: int) -> list[str]:
    pairs = []
    for name in s.names:
        c = results.compare(name, MAIN_LINK, m8, "uni")
        pairs.append(f"{name} {c.baseline.balance:.2f} → {c.best.balance:.2f}")
    last = s.microbatches[-1]
    worst = max(
        s.names,
        key=lambda n: (
            results.compare(n, MAIN_LINK, last, "uni").best.peak_gib
            / results.compare(n, MAIN_LINK, last, "uni").baseline.peak_gib
        ),
    )
    c = results.compare(worst, MAIN_LINK, last, "uni")
    text = (
        "- **Memory.** PRT spreads activation memory over the ranks, as the paper says: "
        f"largest over smallest per-rank peak, 1F1B → best PRT uni at m = {m8}: "
        f"{'; '.join(pairs)}."
    )
    if c.best.peak_gib > 1.05 * c.baseline.peak_gib:
        text += (
            " The fastest plan can hold more micro-batches in flight, though: "
            f"{worst} at m = {last} peaks at {c.best.peak_gib:.1f} GiB per rank against "
            f"{c.baseline.peak_gib:.1f} GiB for 1F1B."
        )
    return [text]


def generator_note(results: Results) -> list[str]:
    timed = [
        o
        for j, o in results.items()
        if j.link == MAIN_LINK and j.variant.schedule == "prt" and j.model != IDEAL
    ]
    won = [o for o in timed if o.plan == "runtime default"]
    if not won:
        return []
    worst = max(won, key=lambda o: o.cost_aware_ms / o.ms)
    v = worst.job.variant
    return [
        "- **A limit of the PRT generator found on the way.** In "
        f"{len(won)} of {len(timed)} timings on `{MAIN_LINK}` the plan built for uniform "
        "stages (the runtime's default) was faster than the plan built for the real stage "
        "and hop times, by up to "
        f"{worst.cost_aware_ms / worst.ms - 1:.1%} ({worst.job.model}, {v.label}, "
        f"m = {worst.job.microbatches}): the greedy list scheduler, given a hop time, makes "
        "choices that cascade into a worse order. The tables keep the faster plan (†).",
    ]


# -- the H200 section: the profiled BERTs beside the FLOP model -----------------------------------
def h200_jobs(s: Settings) -> list[Job]:
    """Every variant on every H200 link with the replica-gradient sum (:func:`run_job` adds
    the bi jobs without it)."""
    variants = all_variants(s.reuses)
    even = [
        Job(n, k, m, v, True)
        for n in s.h200_names
        for k in s.h200_links
        for m in s.microbatches
        for v in variants
    ]
    balanced = [
        Job(n, H200_MAIN_LINK, m, v, True, "balanced")
        for n in s.h200_names
        for m in s.microbatches
        for v in balanced_variants(s.reuses)
    ]
    return even + balanced


def keep_faster_split(results: Results) -> Results:
    """A balanced row keeps the even split when that is faster. The partitioner times
    splits on the runtime's plan (built for uniform stages); the rows time each split on
    the plan built for its own costs as well, and for the even split that plan can beat
    the partitioner's pick on the runtime's plan."""
    out = Results()
    for job, o in results.items():
        even = results.get(replace(job, partition="even"))
        if job.partition == "balanced" and even is not None and even.ms < o.ms:
            o = replace(even, job=job, search=f"even split kept ({o.ms:.1f} ms balanced)")
        out[job] = o
    return out


def balanced_variants(reuses: Sequence[int]) -> list[Variant]:
    """What gets a balanced split: 1F1B and every PRT uni variant."""
    return [baselines()[0], *(v for v in prt_variants(reuses) if v.direction == "uni")]


def work(part: LayerCost) -> float:
    return part.fwd + part.bwd


def mean_layer(cost: CostModel) -> LayerCost:
    n = len(cost.layers)
    return LayerCost(
        sum(u.fwd for u in cost.layers) / n,
        sum(u.bwd for u in cost.layers) / n,
        param=sum(u.param for u in cost.layers) / n,
    )


def v100_layer(name: str) -> tuple[LayerCost, LayerCost]:
    """(a layer, the head) of the FLOP model of the same shape, in ms."""
    model = models()[PROFILES[name].v100]
    return layer_cost(model, model.layers[0]), layer_cost(model, model.head)


def hop_ms(message_bytes: float, link: Link) -> float:
    return 1e3 * (link.latency + message_bytes / link.bandwidth)


def rank_imbalance(cost: CostModel, placement: Placement) -> float:
    """Compute (forward + backward) of the busiest rank over the mean rank's."""
    loads = rank_loads(cost, placement)
    return max(loads) / (sum(loads) / len(loads))


def replica_mib(name: str, reuse: int) -> float:
    """Gradient MiB the busiest rank sends its mirrored rank under bi (R = ``reuse``)."""
    placement = Placement(RANKS, reuse, "loop", "bi")
    cost = profiled_cost(name, placement, LINKS[H200_MAIN_LINK], True)
    grads = cost.stage_grad_bytes(placement)
    sent = [sum(grads[placement.model_stage(k)] for k in ks) for ks in placement.rank_stages]
    return max(sent) / 2**20


def profile_rows(names: Sequence[str]) -> list[str]:
    k4, k5 = LINKS["nvlink4"], LINKS["pcie5"]
    rows = [
        "| model | layers | layer fwd / bwd ms | embedding fwd / bwd ms | head fwd / bwd ms | "
        "head ÷ layer | message MiB | hop µs nvlink4 / pcie5 | hop ÷ layer fwd nvlink4 / "
        "pcie5 | V100 rows: head ÷ layer, hop ÷ layer fwd (nvlink) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in names:
        cost, layer = profiled(name), mean_layer(profiled(name))
        v_layer, v_head = v100_layer(name)
        v_model = models()[PROFILES[name].v100]
        v_hop = hop_ms(v_model.layers[0].out_bytes, LINKS[MAIN_LINK])
        h4, h5 = (hop_ms(cost.message_bytes, k) for k in (k4, k5))
        rows.append(
            f"| {name} | {len(cost.layers)} | {layer.fwd:.2f} / {layer.bwd:.2f} | "
            f"{cost.embedding.fwd:.2f} / {cost.embedding.bwd:.2f} | "
            f"{cost.head.fwd:.2f} / {cost.head.bwd:.2f} | {work(cost.head) / work(layer):.2f} | "
            f"{cost.message_bytes / 2**20:.0f} | {1e3 * h4:.0f} / {1e3 * h5:.0f} | "
            f"{h4 / layer.fwd:.1%} / {h5 / layer.fwd:.1%} | "
            f"{work(v_head) / work(v_layer):.3f}, {v_hop / v_layer.fwd:.1%} |"
        )
    return rows


def side_by_side(results: Results, s: Settings) -> list[str]:
    ms_ = s.microbatches
    rows = [
        "| model | direction | paper | "
        + " | ".join(f"V100 FLOP model m={m}" for m in ms_)
        + " | "
        + " | ".join(f"H200 profile m={m}" for m in ms_)
        + " |",
        "|---|---|---|" + "---|" * (2 * len(ms_)),
    ]
    for name in s.h200_names:
        v100 = PROFILES[name].v100
        for direction in ("uni", "bi"):
            flop = results.gains(v100, MAIN_LINK, ms_, direction)
            prof = results.gains(name, H200_MAIN_LINK, ms_, direction, True)
            cells = [pct(flop[m]) for m in ms_] + [pct(prof[m]) for m in ms_]
            target = PAPER_GAINS[("BERT", direction)]
            rows.append(f"| {v100} | {direction} | {target:+.2%} | " + " | ".join(cells) + " |")
    return rows


def h200_link_table(results: Results, s: Settings) -> list[str]:
    links = s.h200_links
    rows = [
        "| model | m | " + " | ".join(f"{k} uni | {k} bi" for k in links) + " |",
        "|---|---|" + "---|---|" * len(links),
    ]
    for name in s.h200_names:
        for m in s.microbatches:
            cells = []
            for k in links:
                for direction in ("uni", "bi"):
                    c = results.compare(name, k, m, direction, True)
                    cells.append(f"{pct(c.gain)} ({_short(c.best)})")
            rows.append(f"| {name} | {m} | " + " | ".join(cells) + " |")
    return rows


def replica_table(results: Results, s: Settings) -> list[str]:
    rows = [
        "| model | link | m | Chimera-style bi ms: without → with (sum) | best PRT bi ms: "
        "without → with (sum) | gain without | gain with |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in s.h200_names:
        for k in s.h200_links:
            if math.isinf(LINKS[k].bandwidth):
                continue
            for m in s.microbatches:
                off, on = (results.compare(name, k, m, "bi", paid) for paid in (False, True))
                rows.append(
                    f"| {name} | {k} | {m} | {off.baseline.ms:.1f} → {on.baseline.ms:.1f} "
                    f"({on.baseline.replica_ms:.2f}) | {off.best.ms:.1f} → {on.best.ms:.1f} "
                    f"({on.best.replica_ms:.2f}, {_short(on.best)}) | {pct(off.gain)} | "
                    f"{pct(on.gain)} |"
                )
    return rows


def h200_section(results: Results, s: Settings) -> list[str]:
    if not s.h200_names:
        return []
    link = LINKS[H200_MAIN_LINK]
    files = "; ".join(f"`{PROFILES[n].path}`" for n in s.h200_names)
    commands = "; ".join(f"`{PROFILES[n].command}`" for n in s.h200_names)
    per_param = ", ".join(f"{n} {state_bytes_per_param(n):.2f}" for n in s.h200_names)
    lines = [
        "## BERT with per-layer costs profiled on an H200",
        "",
        "The rows above price every unit from FLOP and byte counts on a V100. Here BERT-base "
        "and BERT-large are priced from costs measured by `megatron-prt profile` on one "
        "NVIDIA H200 (torch 2.11+cu130, megatron-core 0.16.1, the local "
        "non-Transformer-Engine spec, which materialises the attention scores, bf16, seq "
        f"{BERT_BASE.seq}, {BERT_BASE.batch} sequences per micro-batch, vocabulary "
        f"{BERT_BASE.vocab}): per layer, embedding and head, the measured forward and "
        "backward times, the activation bytes kept for backward and the parameter bytes. "
        f"Files: {files}, written by {commands}.",
        "",
        "What differs from the V100 rows, besides the times being measured:",
        "",
        "- **The head** is BERT's pretraining head as megatron-core builds it (LM transform, "
        "the decoder over all tokens to the vocabulary, the binary head, both losses), "
        "not the sequence classifier of the V100 rows; its parameters include the last "
        "stage's copy of the tied word embedding. The embedding's time includes megatron's "
        "forward_step overhead before the first layer.",
        f"- **Parameter bytes**: the profile's `param` is {BF16_STATE_BYTES} bytes per "
        "parameter (bf16 weight 2, fp32 main gradient 4, fp32 main weight 4, two fp32 Adam "
        f"moments 8; checked: a layer's `param` over its 12h² + 13h parameters = "
        f"{per_param}), against 16 in the V100 rows. The profiles predate the cost file's "
        "`grad` field, so the gradient the two bi replicas sum is taken as "
        f"{BF16_GRAD_BYTES} bytes per parameter (the fp32 `main_grad` megatron-core's DDP "
        f"accumulates), {BF16_GRAD_BYTES}/{BF16_STATE_BYTES} of `param`.",
        "- **The replica-gradient sum** of bi (Chimera-style and PRT alike) is simulated: "
        "after its last backward each rank sends its stages' gradients to the mirrored rank "
        "P−1−r over the same link as the pipeline's messages (one latency, bytes over the "
        "link's bandwidth, no contention with other pairs) and adds what it receives at a "
        f"third of the H200's {H200_HBM_BANDWIDTH / 1e12:g} TB/s HBM3e bandwidth (two reads, "
        "one write); a pair starts when both ranks are done. On `free` it is free too. The "
        "V100 rows leave it out.",
        "- **Links** (per direction; latencies are our assumption):",
        *(f"  - `{k}`: {LINKS[k].label}" for k in H200_LINKS),
        "  NVLink 4 on an H100/H200 SXM is 900 GB/s in total both ways per GPU over 18 "
        "links, i.e. 450 GB/s each way; through the NVSwitch of an 8-GPU HGX board one "
        "pair of GPUs can use all of it. PCIe 5.0 x16 is 32 GT/s x 16 lanes with 128b/130b "
        "encoding, 63 GB/s each way before protocol overheads (optimistic, as on V100).",
        "- **Everything else** as above: P = 8, the runtime's even split of the layers "
        "(except in the subsection on balanced splits), "
        "the same baselines and plan candidates (`candidate_plans`); (!) marks a peak over "
        f"the H200's {H200_MEMORY / 1e9:.0f} GB.",
        "",
        *h200_causes(results, s),
        "",
        "### Against the paper, beside the V100 FLOP model",
        "",
        f"Gains (uni: PRT over 1F1B; bi: PRT over Chimera-style bi); V100 on `{MAIN_LINK}`, "
        f"H200 on `{H200_MAIN_LINK}` with the replica-gradient sum.",
        "",
        *side_by_side(results, s),
        "",
        "### The profiles",
        "",
        "Means over the layers; *head ÷ layer* compares forward + backward; a hop is one "
        "message between neighbouring ranks.",
        "",
        *profile_rows(s.h200_names),
        "",
        f"### Iteration time, bubble and memory (P = 8, link: {link.label}, replica sum on)",
        "",
        *main_table(results, s.h200_names, H200_MAIN_LINK, s.microbatches, True),
        "",
        *balanced_section(results, s),
    ]
    if len(s.h200_links) > 1:
        lines += [
            "### Gain by link (replica sum on)",
            "",
            *h200_link_table(results, s),
            "",
        ]
    lines += [
        "### The replica-gradient sum",
        "",
        "bi iteration times without and with the sum (in brackets: what it adds, ms).",
        "",
        *replica_table(results, s),
        "",
        f"### Every candidate (iteration ms, `{H200_MAIN_LINK}`, replica sum on)",
        "",
        *candidates_table(results, s.h200_names, H200_MAIN_LINK, s.microbatches, s.reuses, True),
        "",
    ]
    return lines


def balanced_section(results: Results, s: Settings) -> list[str]:
    rows = [o for j, o in results.items() if j.partition == "balanced"]
    kept = sum(o.search.startswith("even split kept") for o in rows)
    exact = sorted({f"{o.job.model} {o.job.variant.label}" for o in rows if o.search == "exact"})
    return [
        f"### Balanced splits: the partitioner's fastest (`{H200_MAIN_LINK}`)",
        "",
        "Every row above uses the runtime's even split, which leaves the head on the last "
        "stage with that stage's share of the layers. Here the stage layers come from the "
        "partitioner, `megatron_prt.tune.partition.partition(cost, placement, m, "
        f"budget_bytes={H200_MEMORY:.3g}, schedule=...)`: its time objective, the fastest "
        f"partition it finds within an H200's {H200_MEMORY / 1e9:.0f} GB (every split here "
        "peaks far below, so: the fastest it finds; its default objective is the least "
        f"memory within {DEFAULT_SLACK:.0%} of the fastest). 1F1B gets the same treatment, "
        "since megatron-core runs uneven stages too (fewer layers on the head's stage, "
        "say), so *PRT balanced vs 1F1B balanced* compares like with like. The search is "
        f"exact where there are at most {EXHAUSTIVE_LIMIT} admissible splits "
        f"({', '.join(exact) or 'no row here'}) and a local search otherwise, without an "
        "optimality guarantee. It times splits on the "
        "runtime's plan (built for uniform stages) without the replica sum; each row then "
        "times its split like every other row (the plan built for its costs and the "
        "runtime's, the faster kept), and keeps the even split when that is faster "
        f"({kept} of {len(rows)} rows). Peaks: the largest per-rank peak, activations from "
        "the plan + the profile's parameter bytes.",
        "",
        *balanced_gain_table(results, s),
        "",
        *balanced_rows(results, s),
        "",
    ]


def balanced_gain_table(results: Results, s: Settings) -> list[str]:
    rows = [
        "| model | m | 1F1B ms: even → balanced | best PRT uni ms: even → balanced | "
        "PRT even vs 1F1B even | PRT balanced vs 1F1B even | PRT balanced vs 1F1B balanced |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in s.h200_names:
        for m in s.microbatches:
            even, bal = (
                results.compare(name, H200_MAIN_LINK, m, "uni", True, split)
                for split in ("even", "balanced")
            )
            vs_even = even.baseline.ms / bal.best.ms - 1
            rows.append(
                f"| {name} | {m} | {even.baseline.ms:.1f} → {bal.baseline.ms:.1f} | "
                f"{even.best.ms:.1f} ({_short(even.best)}) → {bal.best.ms:.1f} "
                f"({_short(bal.best)}) | {pct(even.gain)} | {pct(vs_even)} | "
                f"**{pct(bal.gain)}** |"
            )
    return rows


def balanced_rows(results: Results, s: Settings) -> list[str]:
    rows = [
        "| model | m | schedule | ms: even → balanced | peak GiB/rank: even → balanced | "
        "busiest ÷ mean rank: even → balanced | balanced layers per stage | search |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in s.h200_names:
        for m in s.microbatches:
            for v in balanced_variants(s.reuses):
                even, bal = (
                    results.at(name, H200_MAIN_LINK, m, v, True, split)
                    for split in ("even", "balanced")
                )
                spread = [split_imbalance(o) for o in (even, bal)]
                label = v.label if v.role == "baseline" else f"PRT {v.label}"
                rows.append(
                    f"| {name} | {m} | {label} | {even.ms:.1f} → {bal.ms:.1f} "
                    f"({bal.ms / even.ms - 1:+.1%}) | {even.peak_gib:.1f} → "
                    f"{fmt_gib(bal.peak_gib, H200_MEMORY)} | {spread[0]:.2f} → "
                    f"{spread[1]:.2f} | {','.join(map(str, bal.stage_layers))} | "
                    f"{bal.search} |"
                )
    return rows


def split_imbalance(o: Outcome) -> float:
    """Busiest rank's compute over the mean rank's, for the outcome's stage layers."""
    placement = o.job.variant.placement
    cost = replace(profiled(o.job.model), stage_layers=o.stage_layers)
    return rank_imbalance(cost, placement)


def _h200_gain(results: Results, name: str, link: str, m: int, direction: str, paid=True):
    if Job(name, link, m, REFERENCE, True) not in results:
        return "n/a"
    return pct(results.compare(name, link, m, direction, paid).gain)


def _both(results: Results, s: Settings, link: str, m: int, direction: str) -> str:
    """'BERT-base +x%, BERT-large +y%' for the profiled models."""
    return ", ".join(
        f"{PROFILES[n].v100} {_h200_gain(results, n, link, m, direction)}" for n in s.h200_names
    )


def _v100_both(results: Results, s: Settings, link: str, m: int, direction: str) -> str:
    return ", ".join(
        f"{PROFILES[n].v100} {_gain_at(results, PROFILES[n].v100, link, m, direction)}"
        for n in s.h200_names
    )


def _link_chain(results: Results, s: Settings, name: str, m: int, direction: str) -> str:
    gains = " → ".join(_h200_gain(results, name, k, m, direction) for k in s.h200_links)
    return f"{PROFILES[name].v100} {direction} {gains}"


def h200_causes(results: Results, s: Settings) -> list[str]:
    m = 8 if 8 in s.microbatches else s.microbatches[0]
    reuse = max(s.reuses)
    first = PROFILES[s.h200_names[0]]
    layer = mean_layer(profiled(first.name))
    v_layer, _ = v100_layer(first.name)
    k4, k5 = LINKS["nvlink4"], LINKS["pcie5"]
    heads, spread = [], []
    for n in s.h200_names:
        cost = profiled(n)
        heads.append(f"{work(cost.head) / work(mean_layer(cost)):.1f} ({PROFILES[n].v100})")
        model = models()[PROFILES[n].v100]
        one, many = Placement(RANKS, 1), Placement(RANKS, reuse)
        mine = [rank_imbalance(profiled_cost(n, p, k4, False), p) for p in (one, many)]
        flop = [rank_imbalance(cost_model(model, p, k4), p) for p in (one, many)]
        spread.append(
            f"{PROFILES[n].v100} {mine[0]:.2f} → {mine[1]:.2f} (V100 rows {flop[0]:.2f} → "
            f"{flop[1]:.2f})"
        )
    _, v_head = v100_layer(first.name)
    lines = [
        f"Where the H200 costs change the picture (m = {m}):",
        "",
        f"- **The head weighs.** The profiled head costs as much as {' and '.join(heads)} "
        f"layers (forward + backward); the V100 rows' classifier "
        f"{work(v_head) / work(v_layer):.1g}. The even split puts it on stage D−1 with that "
        "stage's layers, and reuse cannot split one unit: the busiest rank's compute over "
        f"the mean rank's, 1F1B → R = {reuse} loop, is {'; '.join(spread)}. Every schedule "
        "pays at least m times that rank's load, so there is less bubble for reuse to "
        f"take: with free communication PRT uni gains {_both(results, s, 'free', m, 'uni')} "
        f"over 1F1B, against {_v100_both(results, s, 'free', m, 'uni')} in the V100 rows.",
        f"- **Messages are cheap on NVLink 4.** A {first.v100} hop is "
        f"{1e3 * hop_ms(profiled(first.name).message_bytes, k4):.0f} µs, "
        f"{hop_ms(profiled(first.name).message_bytes, k4) / layer.fwd:.1%} of a layer's "
        "forward (V100 rows on one NVLink 2.0 link: "
        f"{hop_ms(models()[first.v100].layers[0].out_bytes, LINKS[MAIN_LINK]) / v_layer.fwd:.1%}"
        f"); on `pcie5` {hop_ms(profiled(first.name).message_bytes, k5) / layer.fwd:.1%}, "
        "about the V100 NVLink ratio. Gains by link, "
        f"{' → '.join(f'`{k}`' for k in s.h200_links)}: "
        + "; ".join(_link_chain(results, s, n, m, d) for n in s.h200_names for d in ("uni", "bi"))
        + ".",
        *replica_note(results, s, m),
        f"- **Against the V100 rows and the paper** (m = {m}, `{H200_MAIN_LINK}` with the "
        f"replica sum): PRT uni {_both(results, s, H200_MAIN_LINK, m, 'uni')} over 1F1B "
        f"(V100 rows on `{MAIN_LINK}`: {_v100_both(results, s, MAIN_LINK, m, 'uni')}; paper "
        f"{PAPER_GAINS[('BERT', 'uni')]:+.2%}), PRT bi "
        f"{_both(results, s, H200_MAIN_LINK, m, 'bi')} over Chimera-style bi (V100 rows: "
        f"{_v100_both(results, s, MAIN_LINK, m, 'bi')}; paper "
        f"{PAPER_GAINS[('BERT', 'bi')]:+.2%}).",
        *balanced_note(results, s, m),
    ]
    return lines


def _balanced_gains(results: Results, name: str, m: int) -> tuple[float, float, float]:
    """(1F1B balanced over 1F1B even, best PRT uni balanced over 1F1B even, over 1F1B
    balanced) as gains, on the main H200 link."""
    even, bal = (
        results.compare(name, H200_MAIN_LINK, m, "uni", True, split)
        for split in ("even", "balanced")
    )
    ms_1f1b = even.baseline.ms
    return ms_1f1b / bal.baseline.ms - 1, ms_1f1b / bal.best.ms - 1, bal.gain


def balanced_note(results: Results, s: Settings, m: int) -> list[str]:
    """What the partitioner's fastest split does to the uni gains (quoted numbers only)."""
    if not any(j.partition == "balanced" for j in results):
        return []
    at_m, spans = [], []
    for n in s.h200_names:
        own, vs_even, vs_bal = _balanced_gains(results, n, m)
        at_m.append(
            f"{PROFILES[n].v100}: 1F1B itself {pct(own)} faster, PRT uni "
            f"{_h200_gain(results, n, H200_MAIN_LINK, m, 'uni')} → {pct(vs_even)} over 1F1B "
            f"even and {pct(vs_bal)} over 1F1B balanced"
        )
        others = [_balanced_gains(results, n, mb)[2] for mb in s.microbatches if mb != m]
        if others:
            spans.append(f"{PROFILES[n].v100} {pct(min(others))} to {pct(max(others))}")
    text = (
        "- **With the partitioner's fastest split for both** (subsection below; "
        f"m = {m}), fewer layers on the head's stage: {'; '.join(at_m)}."
    )
    if spans:
        text += " At the other m, PRT balanced over 1F1B balanced: " + ", ".join(spans) + "."
    return [text]


def replica_note(results: Results, s: Settings, m: int) -> list[str]:
    paid = [k for k in s.h200_links if not math.isinf(LINKS[k].bandwidth)]
    if not paid:
        return []
    sums, shifts = [], []
    for n in s.h200_names:
        for k in paid:
            c = results.compare(n, k, m, "bi", True)
            sums.append(
                f"{c.baseline.replica_ms:.2f} ms ({c.baseline.replica_ms / c.baseline.ms:.1%} "
                f"of Chimera-style bi's iteration; {PROFILES[n].v100}, `{k}`)"
            )
            for mb in s.microbatches:
                on, off = (results.compare(n, k, mb, "bi", x).gain for x in (True, False))
                shifts.append(abs(on - off))
    mib = ", ".join(f"{replica_mib(n, 1):.0f} MiB ({PROFILES[n].v100})" for n in s.h200_names)
    return [
        "- **The replica-gradient sum is small.** The busiest rank sends its mirrored rank "
        f"{mib} of fp32 gradients under Chimera-style bi; at m = {m} the sum adds "
        f"{'; '.join(sums)}. Chimera-style and PRT bi both pay it, so it moves the PRT bi "
        f"gain by at most {100 * max(shifts):.1f} points over every m and link below.",
    ]


# -- command line --------------------------------------------------------------------------------
def parse_args(argv: Sequence[str]):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="m = 8 only, no extras, no file")
    p.add_argument("--out", help=f"markdown report (default {DEFAULT_OUT}; --quick: stdout)")
    p.add_argument(
        "--microbatches",
        type=lambda text: tuple(int(x) for x in text.split(",")),
        default=MICROBATCHES,
        help="m values of the main table, comma-separated (default 8,16,32)",
    )
    p.add_argument(
        "--reuses",
        type=lambda text: tuple(int(x) for x in text.split(",")),
        default=REUSES,
        help="R values PRT may use, comma-separated (default 2,4)",
    )
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="processes")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    started = time.perf_counter()
    s = settings_of(args)
    results = keep_faster_split(Results(run_all(all_jobs(s), args.jobs)))
    text = report(argv, s, results, time.perf_counter() - started)
    out = args.out or (None if args.quick else DEFAULT_OUT)
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            f.write(text)
        print(f"wrote {out} ({time.perf_counter() - started:.0f} s)")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
