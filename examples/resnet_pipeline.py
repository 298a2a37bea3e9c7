"""Train a ResNet with PRT: the paper's vision workload on the plain-PyTorch runtime.

    torchrun --standalone --nproc-per-node 2 examples/resnet_pipeline.py \\
        --arch resnet18 --reuse 2 --placement wave --microbatches 4 --micro-batch-size 8

The ResNet is flattened into a layer list -- the stem (conv1, bn1, relu, maxpool), every
residual block, the head (avgpool, flatten, fc) -- and each of the D = R * P stages gets a
contiguous slice (``--stage-layers`` sets the counts; default an even split). Parameter
names are torchvision's once a layer's prefix is added (``conv1.weight``,
``layer2.0.downsample.0.weight``, ``fc.bias``), so ``--weights`` loads a torchvision ResNet
state dict (a head with another class count stays initialised).

Every step prints the mean loss and accuracy of its micro-batches (summed over the ranks
that hold last stages) and images/s; the end prints training throughput after the warm-up
step and the eval-mode accuracy on a held-out split (``--eval-fraction``).

Data (``--data``, read by ``examples/image_data.py``): ``digits`` (scikit-learn's 1797 8x8
handwritten digits, upsampled; the offline default), ``synthetic`` (class-conditional
gratings, no dependency) or a directory in ImageFolder layout ``root/<class>/*.jpg|png``
(mini-ImageNet and the like; needs Pillow).

BatchNorm under micro-batching: as in any pipeline, each stage normalises one micro-batch at
a time, so training statistics are per micro-batch (of ``--micro-batch-size`` images, not
the whole step) and running statistics take one update per micro-batch. With ``--direction
bi`` each weight replica sees only its pipeline's micro-batches, so the replicas' running
statistics drift apart while their weights stay equal; before evaluation pipeline 0's
statistics are copied onto the replicas. ``--norm group`` (GroupNorm) has no batch
dependence at all: then the pipelined step equals the whole-batch step exactly.

Works the same on CUDA: ``--device cuda`` (one GPU per rank, backend nccl).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from megatron_prt.core import ConfigError, Placement, Plan, build_plan
from megatron_prt.core.layers import check_layers_fill_stages, check_stage_layers, layer_counts_arg
from megatron_prt.core.paths import check_trace_prefix
from megatron_prt.runtime import (
    PipelineRuntime,
    build_stages,
    sync_replicas,
)
from megatron_prt.runtime.cpu import keep_freed_memory
from megatron_prt.runtime.trace import gather_spans, write_measured

sys.path.insert(0, str(Path(__file__).resolve().parent))  # image_data lives beside this file
from image_data import (
    ImageSet,
    StepBatches,
    image_folder_set,  # noqa: F401 (the tests reach it through this module)
    load_data,
    split,
    synthetic_set,  # noqa: F401
)

NormLayer = Callable[[int], nn.Module]

# -- model: torchvision's ResNet, one layer per pipeline unit --------------------------------


def conv3x3(in_planes: int, out_planes: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_planes, out_planes, 3, stride=stride, padding=1, bias=False)


def conv1x1(in_planes: int, out_planes: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_planes, out_planes, 1, stride=stride, bias=False)


class BasicBlock(nn.Module):
    """Two 3x3 convolutions and a shortcut (resnet18/34); torchvision's attribute names."""

    expansion = 1

    def __init__(self, inplanes: int, planes: int, stride: int, norm: NormLayer) -> None:
        super().__init__()
        self.conv1 = conv3x3(inplanes, planes, stride)
        self.bn1 = norm(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = conv3x3(planes, planes)
        self.bn2 = norm(planes)
        self.downsample = _shortcut(inplanes, planes * self.expansion, stride, norm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + identity)


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (carrying the stride, as torchvision's V1.5), 1x1 expand (resnet50+)."""

    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int, norm: NormLayer) -> None:
        super().__init__()
        self.conv1 = conv1x1(inplanes, planes)
        self.bn1 = norm(planes)
        self.conv2 = conv3x3(planes, planes, stride)
        self.bn2 = norm(planes)
        self.conv3 = conv1x1(planes, planes * self.expansion)
        self.bn3 = norm(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = _shortcut(inplanes, planes * self.expansion, stride, norm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        return self.relu(self.bn3(self.conv3(out)) + identity)


def _shortcut(inplanes: int, outplanes: int, stride: int, norm: NormLayer) -> nn.Module | None:
    """Projection shortcut where the shape changes; identity (None) otherwise."""
    if stride == 1 and inplanes == outplanes:
        return None
    return nn.Sequential(conv1x1(inplanes, outplanes, stride), norm(outplanes))


class Stem(nn.Module):
    """torchvision's conv1/bn1/relu/maxpool: 7x7 stride 2, then 3x3 max-pool stride 2."""

    def __init__(self, width: int, norm: NormLayer) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 7, stride=2, padding=3, bias=False)
        self.bn1 = norm(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.maxpool(self.relu(self.bn1(self.conv1(x))))


class Head(nn.Module):
    """torchvision's avgpool, flatten, fc."""

    def __init__(self, features: int, num_classes: int) -> None:
        super().__init__()
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(features, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.avgpool(x), 1))


ARCHS: dict[str, tuple[type[nn.Module], tuple[int, ...]]] = {
    "resnet18": (BasicBlock, (2, 2, 2, 2)),
    "resnet34": (BasicBlock, (3, 4, 6, 3)),
    "resnet50": (Bottleneck, (3, 4, 6, 3)),
    "resnet101": (Bottleneck, (3, 4, 23, 3)),
    "resnet152": (Bottleneck, (3, 8, 36, 3)),
}


@dataclass(frozen=True)
class LayerSpec:
    """One pipeline layer: ``kind`` stem|block|head, torchvision's name ``prefix`` of its
    parameters, channels in, block width ``planes``, channels out, and ``downscale``, the
    factor it divides the image side by (ceil at every halving)."""

    kind: str
    prefix: str
    inplanes: int
    planes: int
    outplanes: int
    downscale: int = 1


def layer_specs(arch: str, num_classes: int, width: int = 64) -> list[LayerSpec]:
    """The flattened layer list of ``arch``: stem, every block in order, head. ``width`` is
    the stem's channel count (torchvision: 64; smaller gives a cheap test model)."""
    block, counts = ARCHS[arch]
    specs = [LayerSpec("stem", "", 3, width, width, 4)]
    inplanes = width
    for group, count in enumerate(counts):
        planes = width * 2**group
        for index in range(count):
            outplanes = planes * block.expansion
            downscale = 2 if group > 0 and index == 0 else 1
            prefix = f"layer{group + 1}.{index}."
            specs.append(LayerSpec("block", prefix, inplanes, planes, outplanes, downscale))
            inplanes = outplanes
    specs.append(LayerSpec("head", "", inplanes, inplanes, num_classes))
    return specs


def batch_norm(channels: int) -> nn.Module:
    return nn.BatchNorm2d(channels)


def group_norm(channels: int) -> nn.Module:
    """GroupNorm: no batch dependence, so pipelining is exact. Up to 32 groups of at least
    4 channels: a group of one channel at 1x1 resolution would normalise to 0 every time."""
    return nn.GroupNorm(math.gcd(32, max(1, channels // 4)), channels)


NORMS: dict[str, NormLayer] = {"batch": batch_norm, "group": group_norm}


def build_layer(arch: str, spec: LayerSpec, norm: NormLayer = batch_norm) -> nn.Module:
    """The module of one layer, initialised like torchvision (He-normal convolutions, unit
    norm scales). Seed the global RNG first to get the same layer on every rank."""
    if spec.kind == "stem":
        layer: nn.Module = Stem(spec.outplanes, norm)
    elif spec.kind == "head":
        layer = Head(spec.inplanes, spec.outplanes)
    else:
        layer = ARCHS[arch][0](spec.inplanes, spec.planes, spec.downscale, norm)
    for module in layer.modules():
        if isinstance(module, nn.Conv2d):
            nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
    return layer


def load_torchvision_state(
    layer: nn.Module, spec: LayerSpec, state: dict[str, torch.Tensor]
) -> list[str]:
    """Copy ``state`` (a torchvision ResNet's ``state_dict``) into ``layer``; returns the
    names left as initialised because ``state`` lacks them or holds another shape (the fc
    of a checkpoint with another class count)."""
    own = layer.state_dict()
    found = {
        key: state[spec.prefix + key]
        for key, value in own.items()
        if spec.prefix + key in state and state[spec.prefix + key].shape == value.shape
    }
    layer.load_state_dict({**own, **found})
    return [spec.prefix + key for key in own if key not in found]


def activation_shapes(specs: Sequence[LayerSpec], image_size: int) -> list[tuple[int, ...]]:
    """Per-image output shape of every layer: what a stage boundary after it sends."""
    shapes: list[tuple[int, ...]] = []
    side = image_size
    for spec in specs:
        if spec.kind == "head":
            shapes.append((spec.outplanes,))
            continue
        for _ in range(spec.downscale.bit_length() - 1):
            side = math.ceil(side / 2)  # every stride-2 conv and pool here rounds up
        shapes.append((spec.outplanes, side, side))
    return shapes


# -- training ------------------------------------------------------------------------------------


class ScoredLoss:
    """Cross-entropy that also sums, where the last stages run, each micro-batch's loss,
    correct predictions and sample count, without a host sync (kept as a tensor)."""

    def __init__(self, device: torch.device) -> None:
        self.totals = torch.zeros(4, dtype=torch.float64, device=device)

    def __call__(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss = nn.functional.cross_entropy(logits, target)
        with torch.no_grad():
            correct = (logits.argmax(1) == target).sum()
            one = torch.ones((), device=logits.device)
            row = torch.stack([loss.float(), one, correct.float(), one * target.numel()])
            self.totals += row.to(torch.float64)
        return loss

    def take(self) -> tuple[float, float, int]:
        """Collective: (mean micro-batch loss, accuracy, samples) over all ranks since the
        last take."""
        totals, self.totals = self.totals, torch.zeros_like(self.totals)
        dist.all_reduce(totals)  # only the ranks with last stages counted anything
        loss_sum, batches, correct, seen = totals.tolist()
        return loss_sum / max(batches, 1), correct / max(seen, 1), int(seen)


def evaluate(
    runtime: PipelineRuntime,
    stages: Mapping[int, nn.Module],
    placement: Placement,
    data: ImageSet,
    index: torch.Tensor,
    micro_batch_size: int,
    scorer: ScoredLoss,
) -> tuple[float, float, int]:
    """Collective: (loss, accuracy, images) of the eval-mode model on ``index`` (whole
    steps of micro-batches; the remainder is left out, so 0 images if ``index`` cannot
    fill one step). ``scorer`` must be ``runtime``'s loss function. bi: pipeline 0's
    BatchNorm running statistics are copied onto the replicas first, so both pipelines
    predict alike."""
    sync_replicas(placement, stages)
    for module in stages.values():
        module.eval()
    m = runtime.plan.num_microbatches
    per_step = m * micro_batch_size
    for start in range(0, len(index) - per_step + 1, per_step):
        chunks = index[start : start + per_step].view(m, micro_batch_size)
        xs, ys = zip(*(data.batch(chunk) for chunk in chunks), strict=True)
        runtime.step(list(xs), list(ys), forward_only=True)
    for module in stages.values():
        module.train()
    return scorer.take()


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arch", choices=sorted(ARCHS), default="resnet18")
    parser.add_argument("--width", type=int, default=64, help="stem channels (torchvision: 64)")
    parser.add_argument("--norm", choices=sorted(NORMS), default="batch")
    parser.add_argument("--reuse", type=int, default=2)
    parser.add_argument("--placement", choices=("loop", "wave"), default="loop")
    parser.add_argument("--direction", choices=("uni", "bi"), default="uni")
    parser.add_argument(
        "--stage-layers",
        type=layer_counts_arg,
        help="layers per stage, e.g. 3,3,2,2 (default: even)",
    )
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--weight-decay", type=float, default=5e-4)
    parser.add_argument("--data", default="digits", help="digits | synthetic | ImageFolder dir")
    parser.add_argument("--image-size", type=int, default=32, help="side images are resized to")
    parser.add_argument("--eval-fraction", type=float, default=0.2)
    parser.add_argument("--weights", help="torchvision ResNet state_dict (.pth) to start from")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--trace", metavar="PREFIX", help="write PREFIX.json/.png of the last step")
    args = parser.parse_args(argv)
    if args.weights and args.norm != "batch":  # same names and shapes, another meaning
        parser.error(
            f"--weights with --norm {args.norm}: torchvision's norm weights are BatchNorm's "
            "(they scale batch statistics, which this norm does not use); use --norm batch"
        )
    return args


def checked_layout(args: argparse.Namespace, num_layers: int) -> tuple[Placement, Plan]:
    """The placement and plan the flags give, checked against the model's layers before any
    collective: a bad flag stops every rank, rank 0 saying why in one line (status 2)."""
    try:
        placement = Placement(dist.get_world_size(), args.reuse, args.placement, args.direction)
        plan = build_plan(placement, args.microbatches)
        if args.stage_layers is None:
            layers = f"--arch {args.arch}'s layer count"
            check_layers_fill_stages(num_layers, placement.depth, layers, "--reuse")
        else:
            check_stage_layers(
                args.stage_layers, num_layers, placement.depth, name="--stage-layers"
            )
        if args.trace:
            check_trace_prefix(args.trace, "--trace")
        return placement, plan
    except ConfigError as exc:
        if dist.get_rank() == 0:
            print(f"{Path(__file__).name}: error: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)


def init_distributed(device_name: str) -> torch.device:
    """Join the torchrun group: nccl and one GPU per local rank on CUDA, gloo on CPU."""
    device = torch.device(device_name)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if device.type == "cpu":
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_ranks))
        keep_freed_memory()  # no page-fault churn from re-allocating activations
    return device


def build_model(
    args: argparse.Namespace, placement: Placement, specs: list[LayerSpec], rank: int
) -> dict[int, nn.Sequential]:
    """This rank's stages, on the CPU (bi replicas not yet synced). Layer i is seeded by
    ``args.seed + i``, so every rank that builds it builds the same one; ``--weights``
    then overwrites what the checkpoint holds."""
    state = (
        torch.load(args.weights, map_location="cpu", weights_only=True) if args.weights else None
    )

    def make_layer(i: int) -> nn.Module:
        torch.manual_seed(args.seed + i)
        layer = build_layer(args.arch, specs[i], NORMS[args.norm])
        if state is not None:
            kept = load_torchvision_state(layer, specs[i], state)
            if kept:
                print(f"rank {rank}: not in --weights, left initialised: {' '.join(kept)}")
        return layer

    return build_stages(placement, rank, make_layer, len(specs), args.stage_layers)


def train_step(
    runtime: PipelineRuntime,
    stages: Mapping[int, nn.Module],
    optimizer: torch.optim.Optimizer,
    batches: StepBatches,
) -> None:
    """One optimizer step on the next ``m`` micro-batches; the losses land in the scorer."""
    optimizer.zero_grad()
    xs, ys = batches.next()
    runtime.step(xs, ys)
    # bi: both replicas get the whole batch's gradient, so equal steps keep them equal
    runtime.reduce_replica_grads()
    optimizer.step()


def train(
    runtime: PipelineRuntime,
    stages: Mapping[int, nn.Module],
    optimizer: torch.optim.Optimizer,
    batches: StepBatches,
    scorer: ScoredLoss,
    steps: int,
) -> float:
    """Run ``steps`` steps, rank 0 printing each one's loss, accuracy and images/s; returns
    the seconds spent after step 0 (which warms up allocators and kernels)."""
    images = runtime.plan.num_microbatches * batches.size
    timed = 0.0
    for step in range(steps):
        start = time.perf_counter()
        train_step(runtime, stages, optimizer, batches)
        if runtime.device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        timed += elapsed if step > 0 else 0.0
        loss, accuracy, _ = scorer.take()
        if dist.get_rank() == 0:
            print(
                f"step {step}: loss {loss:.4f} acc {accuracy:.3f} "
                f"({images / elapsed:.1f} images/s)",
                flush=True,
            )
    return timed


def describe(
    args: argparse.Namespace,
    placement: Placement,
    specs: Sequence[LayerSpec],
    data: ImageSet,
    split_sizes: tuple[int, int],
) -> str:
    """The run's one-line header."""
    return (
        f"{args.arch} ({args.norm} norm): {len(specs)} layers in D={placement.depth} stages "
        f"on P={placement.ranks} ranks, R={placement.reuse} "
        f"{placement.placement}/{placement.direction}, m={args.microbatches} x "
        f"{args.micro_batch_size} images; data {args.data}: {split_sizes[0]} train / "
        f"{split_sizes[1]} eval, {len(data.classes)} classes, {args.image_size} px"
    )


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    device = init_distributed(args.device)
    rank = dist.get_rank()
    data = load_data(args.data, args.image_size)  # every rank: the same deterministic set
    train_index, eval_index = split(len(data.labels), args.eval_fraction, args.seed)
    specs = layer_specs(args.arch, len(data.classes), args.width)
    placement, plan = checked_layout(args, len(specs))
    stages = {s: m.to(device) for s, m in build_model(args, placement, specs, rank).items()}
    sync_replicas(placement, stages)  # bi: replica weights equal pipeline 0's
    params = [p for module in stages.values() for p in module.parameters()]
    optimizer = torch.optim.SGD(
        params, lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay
    )
    scorer = ScoredLoss(device)
    with warnings.catch_warnings():  # evaluate() syncs the running statistics it names
        warnings.filterwarnings("ignore", "stage.* keep BatchNorm running statistics")
        runtime = PipelineRuntime(plan, stages, scorer, device=device, trace=bool(args.trace))
    batches = StepBatches(data, train_index, args.microbatches, args.micro_batch_size, args.seed)
    if rank == 0:
        print(describe(args, placement, specs, data, (len(train_index), len(eval_index))))
    timed = train(runtime, stages, optimizer, batches, scorer, args.steps)
    if args.trace:
        spans = gather_spans(runtime)
        if rank == 0:
            print("wrote", *write_measured(args.trace, spans, runtime))
    loss, accuracy, seen = evaluate(
        runtime, stages, placement, data, eval_index, args.micro_batch_size, scorer
    )
    if rank == 0:
        images = args.microbatches * args.micro_batch_size * (args.steps - 1)
        if timed > 0:
            print(f"train: {images / timed:.1f} images/s after step 0")
        if seen:
            print(f"eval: loss {loss:.4f} accuracy {accuracy:.3f} on {seen} images", flush=True)
        else:
            print("eval: skipped, fewer held-out images than one step takes", flush=True)
    runtime.close()
    dist.barrier()  # nobody tears the group down while a peer still writes its trace
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
