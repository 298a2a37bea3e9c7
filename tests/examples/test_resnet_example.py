"""examples/resnet_pipeline.py: a ResNet split into D = R * P stages.

* Parity: a narrow resnet18 in float64 run with PRT on 2 gloo ranks gives the losses and
  gradients of the unpipelined model to 1e-10 relative -- with GroupNorm against the
  whole batch, and with training-mode BatchNorm against a reference that normalises each
  micro-batch on its own, as a pipeline does.
* The layer list matches torchvision's ResNet (names, shapes; outputs where torchvision
  imports), the data loaders, and a short torchrun run whose loss goes down.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_prt.core import Placement, build_plan
from megatron_prt.runtime import PipelineRuntime, build_stages, reduce_replica_grads, sync_replicas
from megatron_prt.runtime.local import all_ok, run_local
from megatron_prt.runtime.stages import layer_ranges

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "resnet_pipeline.py"


def _load_example():
    spec = importlib.util.spec_from_file_location("resnet_pipeline", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["resnet_pipeline"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


rp = _load_example()

TOL = 1e-10
ARCH, WIDTH, CLASSES, IMAGE, M, MB = "resnet18", 8, 5, 16, 4, 2
SPECS = rp.layer_specs(ARCH, CLASSES, WIDTH)


def make_layer(norm: str, i: int) -> torch.nn.Module:
    torch.manual_seed(100 + i)  # every rank builds the same layer i
    return rp.build_layer(ARCH, SPECS[i], rp.NORMS[norm]).double()


def micro_batches():
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(MB, 3, IMAGE, IMAGE, generator=g, dtype=torch.float64) for _ in range(M)]
    ys = [torch.randint(CLASSES, (MB,), generator=g) for _ in range(M)]
    return xs, ys


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits, target)


def reference(norm: str):
    """Unpipelined micro-batch losses, per-layer gradients of their mean and per-layer
    buffers after the step. GroupNorm: the whole batch in one pass; BatchNorm: one
    micro-batch at a time, as a pipeline normalises (per-micro-batch statistics)."""
    layers = [make_layer(norm, i) for i in range(len(SPECS))]
    model = torch.nn.Sequential(*layers)
    xs, ys = micro_batches()
    if norm == "group":
        logits = model(torch.cat(xs)).split(MB)
    else:
        logits = [model(x) for x in xs]
    losses = [loss_fn(out, y) for out, y in zip(logits, ys, strict=True)]
    (sum(losses) / M).backward()
    grads = [[p.grad.clone() for p in layer.parameters()] for layer in layers]
    buffers = [[b.clone() for b in layer.buffers()] for layer in layers]
    return [v.item() for v in losses], grads, buffers


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / max(float(want.abs().max()), 1e-30))


def _pipelined_errors(rank, world, config, ref):
    """Largest relative loss, gradient and (uni) buffer error on this rank's stages."""
    norm, reuse, placement_name, direction = config
    placement = Placement(world, reuse, placement_name, direction)
    plan = build_plan(placement, M)
    stages = build_stages(placement, rank, lambda i: make_layer(norm, i), len(SPECS))
    sync_replicas(placement, stages)
    runtime = PipelineRuntime(plan, stages, loss_fn, dtype=torch.float64, timeout_s=30)
    xs, ys = micro_batches()
    losses = runtime.step(xs, ys)
    reduce_replica_grads(placement, stages)
    runtime.close()
    ref_losses, ref_grads, ref_buffers = ref
    err = {"loss": 0.0, "grad": 0.0, "buffer": 0.0}
    for mb, loss in enumerate(losses):
        if loss is not None:
            err["loss"] = max(err["loss"], abs(float(loss) - ref_losses[mb]) / ref_losses[mb])
    ranges = layer_ranges(len(SPECS), placement.depth)
    for stage, module in stages.items():
        first, _ = ranges[placement.model_stage(stage)]
        for offset, layer in enumerate(module):
            for got, want in zip(layer.parameters(), ref_grads[first + offset], strict=True):
                err["grad"] = max(err["grad"], _rel(got.grad, want))
            if direction == "uni":  # bi replicas each see only their pipeline's micro-batches
                for got, want in zip(layer.buffers(), ref_buffers[first + offset], strict=True):
                    err["buffer"] = max(err["buffer"], _rel(got.double(), want.double()))
    seen = {mb for mb, loss in enumerate(losses) if loss is not None}
    return err, seen


def _parity_worker(rank, world, configs):
    refs: dict = {}
    results = []
    for config in configs:
        ref = refs.setdefault(config[0], reference(config[0]))
        results.append(_pipelined_errors(rank, world, config, ref))
    return results


def test_pipelined_resnet_matches_unpipelined_model():
    configs = [
        ("group", 2, "loop", "uni"),
        ("group", 2, "wave", "bi"),
        ("group", 3, "loop", "uni"),  # D = 6: uneven split of the 10 layers
        ("batch", 2, "wave", "uni"),
        ("batch", 2, "loop", "bi"),
    ]
    per_rank = all_ok(run_local(2, _parity_worker, configs, deadline_s=120))
    for index, config in enumerate(configs):
        seen = set()
        for results in per_rank:
            err, rank_seen = results[index]
            seen |= rank_seen
            for what, value in err.items():
                assert value <= TOL, f"{config}: {what} differs by {value:.3g}"
        assert seen == set(range(M)), f"{config}: losses missing"


def test_layer_list_has_torchvision_names_and_shapes():
    specs = rp.layer_specs("resnet50", 1000)
    layers = [rp.build_layer("resnet50", spec) for spec in specs]
    names = {
        spec.prefix + key
        for spec, layer in zip(specs, layers, strict=True)
        for key in layer.state_dict()
    }
    assert len(names) == 320  # torchvision resnet50's state_dict
    assert {
        "conv1.weight",
        "bn1.running_var",
        "layer1.0.downsample.0.weight",
        "layer4.2.conv3.weight",
        "fc.bias",
    } <= names
    x = torch.randn(1, 3, 40, 40)
    with torch.no_grad():
        for layer, shape in zip(layers, rp.activation_shapes(specs, 40), strict=True):
            x = layer.eval()(x)
            assert tuple(x.shape[1:]) == shape


def _torchvision():
    try:  # a CPU torch with torchvision's CUDA wheel fails at import with a RuntimeError
        import torchvision
    except Exception as exc:
        pytest.skip(f"torchvision not importable: {exc}")
    return torchvision


def test_torchvision_weights_load_and_give_the_same_outputs():
    torchvision = _torchvision()
    reference_model = torchvision.models.resnet18(num_classes=7).eval()
    with torch.no_grad():  # non-trivial BatchNorm state, so a mix-up shows
        for module in reference_model.modules():
            if isinstance(module, torch.nn.BatchNorm2d):
                module.running_mean.normal_()
                module.running_var.uniform_(0.5, 2.0)
    state = reference_model.state_dict()
    specs = rp.layer_specs("resnet18", 7)
    layers = [rp.build_layer("resnet18", spec) for spec in specs]
    assert [
        k
        for s, m in zip(specs, layers, strict=True)
        for k in rp.load_torchvision_state(m, s, state)
    ] == []
    x = torch.randn(2, 3, 48, 48)
    with torch.no_grad():
        got = torch.nn.Sequential(*layers).eval()(x)
        assert torch.allclose(got, reference_model(x), rtol=1e-5, atol=1e-5)


def test_image_folder_loader(tmp_path):
    image = pytest.importorskip("PIL.Image")
    for label, name in enumerate(("cat", "dog")):
        (tmp_path / name).mkdir()
        for k in range(3):
            color = (200 * label, 10 * k, 50)
            image.new("RGB", (12, 10), color).save(tmp_path / name / f"{k}.png")
    (tmp_path / "dog" / "notes.txt").write_text("not an image")
    data = rp.image_folder_set(tmp_path, 8)
    assert data.classes == ["cat", "dog"]
    assert data.images.shape == (6, 3, 8, 8) and data.images.dtype == torch.uint8
    assert data.labels.tolist() == [0, 0, 0, 1, 1, 1]
    assert data.images[3, 0].float().mean() == 200  # dog's red channel survives the resize
    x, y = data.batch(torch.tensor([0, 5]))
    assert x.shape == (2, 3, 8, 8) and x.dtype == torch.float32 and y.tolist() == [0, 1]


def test_step_batches_agree_across_ranks():
    data = rp.synthetic_set(16, n=100)
    train, held_out = rp.split(100, 0.2, seed=1)
    assert len(held_out) == 20 and not set(train.tolist()) & set(held_out.tolist())
    a, b = (rp.StepBatches(data, train, 4, 5, seed=2) for _ in range(2))
    for _ in range(6):  # crosses an epoch boundary (80 train images, 20 per step)
        (xa, ya), (xb, yb) = a.next(), b.next()
        assert all(torch.equal(p, q) for p, q in zip(xa + ya, xb + yb, strict=True))


def test_example_trains_under_torchrun(tmp_path):
    try:
        import sklearn  # noqa: F401

        data = "digits"  # the example's default
    except ImportError:
        data = "synthetic"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--standalone",
        str(EXAMPLE),
        "--arch",
        "resnet18",
        "--reuse",
        "2",
        "--placement",
        "wave",
        "--direction",
        "bi",
        "--microbatches",
        "4",
        "--micro-batch-size",
        "8",
        "--steps",
        "12",
        "--data",
        data,
        "--trace",
        str(tmp_path / "t"),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    losses = [float(line.split()[3]) for line in lines if line.startswith("step ")]
    assert len(losses) == 12
    assert sum(losses[-3:]) < sum(losses[:3]), losses
    (evaluation,) = [line for line in lines if line.startswith("eval:")]
    assert 0.0 <= float(evaluation.split()[4]) <= 1.0
    assert (tmp_path / "t.json").exists()
