"""Numerical parity: every plan variant, run on gloo ranks, gives the non-pipelined losses,
gradients and optimizer trajectory (float64, 1e-10 relative)."""

from __future__ import annotations

import functools
import itertools

import pytest
import torch
from parity_models import (
    NUM_LAYERS,
    batch,
    check_grid_results,
    loss_fn,
    make_layer,
    reference,
    rel_err,
    train_errors,
)

from megatron_prt.core import Placement, build_plan
from megatron_prt.runtime import PipelineRuntime, build_stages, sync_replicas
from megatron_prt.runtime.callbacks import ModuleCallbacks, StageCallbacks
from megatron_prt.runtime.local import all_ok, run_local
from megatron_prt.runtime.stages import layer_ranges

TOL = 1e-10
STEPS = 3


_rel = rel_err


def _check_config(rank, kind, p, r, placement, direction, m, refs, transport, device="cpu"):
    """Errors of one configuration on this rank; ``device`` cuda runs it on NCCL ranks
    (scripts/gpu_parity.py). References live on the CPU."""
    plan = build_plan(Placement(p, r, placement, direction), m)
    stages = build_stages(plan.placement, rank, lambda i: make_layer(kind, i), NUM_LAYERS)
    stages = {stage: module.to(device) for stage, module in stages.items()}
    if direction == "bi":  # replicas start different; sync must make them equal
        with torch.no_grad():
            for stage, module in stages.items():
                if stage >= plan.placement.depth:
                    for param in module.parameters():
                        param.add_(1.0)
        sync_replicas(plan.placement, stages)
    runtime = PipelineRuntime(
        plan,
        stages,
        loss_fn,
        dtype=torch.float64,
        timeout_s=30,
        transport=transport,
        device=device,
    )
    xs, ys = batch(kind, m)
    fwd = runtime.step(xs, ys, forward_only=True)
    ref_losses = refs[0]
    fwd_err = max(
        (abs(float(loss) - ref_losses[0][mb]) for mb, loss in enumerate(fwd) if loss is not None),
        default=0.0,
    )
    ranges = layer_ranges(NUM_LAYERS, plan.placement.depth)
    err, seen = train_errors(runtime, stages, plan.placement, refs, xs, ys, STEPS, ranges)
    err["fwd_only"] = fwd_err
    return err, seen


def _worker(rank, world, configs, transport):
    refs, out = {}, []
    for config in configs:
        kind, _, r, placement, direction, m = config
        if (kind, m) not in refs:
            refs[(kind, m)] = reference(kind, m, STEPS)
        err, seen = _check_config(
            rank, kind, world, r, placement, direction, m, refs[(kind, m)], transport
        )
        out.append((config, err, seen))
    return out


def grid(p: int, full: bool):
    ms = sorted({1, p - 1, p, 2 * p + 1} - {0})
    for kind, r, placement, direction, m in itertools.product(
        ("mlp", "transformer"), (1, 2, 3), ("loop", "wave"), ("uni", "bi"), ms
    ):
        if direction == "bi" and m < 2:
            continue
        if not full and (kind, placement) == ("transformer", "wave") and r != 2:
            continue  # CI subset; `make test-all` runs the whole grid
        if not full and m not in (p, 2 * p + 1) and not (m == 1 and r == 3):
            continue
        yield (kind, p, r, placement, direction, m)


def _run_grid(p: int, full: bool, transport: str):
    configs = list(grid(p, full))
    results = all_ok(run_local(p, _worker, configs, transport, deadline_s=1200))
    check_grid_results(configs, results, TOL, lambda config: config[-1])
    return len(configs)


@pytest.mark.parametrize("transport", ["shm", "torch"])
@pytest.mark.parametrize("p", [2, 3])
def test_parity_subset(p, transport):
    assert _run_grid(p, full=False, transport=transport) > 0


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["shm", "torch"])
@pytest.mark.parametrize("p", [2, 3, 4])
def test_parity_full_grid(p, transport):
    assert _run_grid(p, full=True, transport=transport) > 0


def _empty_stage_worker(rank, world):
    plan = build_plan(Placement(world, 2), 3)
    counts = (5, 0, 4, 3)  # stage 1 hands its input on
    stages = build_stages(plan.placement, rank, lambda i: make_layer("mlp", i), 12, counts)
    runtime = PipelineRuntime(plan, stages, loss_fn, dtype=torch.float64, timeout_s=30)
    xs, ys = batch("mlp", 3)
    losses = runtime.step(xs, ys)
    grads = {s: [p.grad.clone() for p in m.parameters()] for s, m in stages.items()}
    return losses, grads


def test_a_stage_without_layers_passes_values_and_gradients():
    ref_losses, ref_grads, _ = reference("mlp", 3, steps=1)
    results = all_ok(run_local(2, _empty_stage_worker))
    ranges = layer_ranges(NUM_LAYERS, 4, (5, 0, 4, 3))
    for rank, (losses, grads) in enumerate(results):
        for mb, loss in enumerate(losses):
            if loss is not None:
                assert _rel(loss, torch.tensor(ref_losses[0][mb], dtype=torch.float64)) <= TOL
        for stage, stage_grads in grads.items():
            first, count = ranges[stage]
            want = [g for layer in ref_grads[first : first + count] for g in layer]
            assert len(stage_grads) == len(want), (rank, stage)
            for got, ref in zip(stage_grads, want, strict=True):
                assert _rel(got, ref) <= TOL, (rank, stage)


class _Detaching(torch.nn.Module):
    """A layer that cuts the graph: the layers before it get no gradient."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x.detach())


def _cut_layer(cut: int, index: int) -> torch.nn.Module:
    layer = make_layer("mlp", index)
    return _Detaching(layer) if index == cut else layer


def _cut_worker(rank, world, reuse, cut, split, deallocate):
    plan = build_plan(Placement(world, reuse, "wave"), 3)
    stages = build_stages(plan.placement, rank, functools.partial(_cut_layer, cut), NUM_LAYERS)
    runtime = PipelineRuntime(
        plan, stages, loss_fn, dtype=torch.float64, timeout_s=30, split_backward=split,
        deallocate_outputs=deallocate,
    )  # fmt: skip
    runtime.step(*batch("mlp", 3))
    return {s: [p.grad for p in m.parameters()] for s, m in stages.items()}


@pytest.mark.parametrize(
    ("world", "reuse", "cut", "split", "deallocate"),
    [
        (2, 2, 6, False, True),  # the cut's stage takes its input from the same rank
        (2, 2, 6, True, False),
        (2, 2, 3, False, True),  # from the other rank
        (1, 3, 4, False, False),
    ],
)
def test_a_stage_that_detaches_its_input_gives_the_layers_before_zero_gradients(
    world, reuse, cut, split, deallocate
):
    """The stage's input got no gradient (None) and the backward of the stage before was
    seeded as a loss's (ones): wrong gradients without a word (deallocate_outputs=False),
    else a shape error or a misleading 'a stage must return one tensor' TypeError."""
    model = torch.nn.Sequential(*(_cut_layer(cut, i) for i in range(NUM_LAYERS)))
    xs, ys = batch("mlp", 3)
    sum(loss_fn(model(x), y) for x, y in zip(xs, ys, strict=True)).div(3).backward()
    ranges = layer_ranges(NUM_LAYERS, world * reuse)
    for grads in all_ok(run_local(world, _cut_worker, reuse, cut, split, deallocate)):
        for stage, stage_grads in grads.items():
            first, count = ranges[stage]
            want = [p.grad for layer in model[first : first + count] for p in layer.parameters()]
            for got, ref in zip(stage_grads, want, strict=True):
                if ref is None:  # before the cut
                    assert got is None or not got.any(), stage
                else:
                    assert _rel(got, ref) <= TOL, stage


def _accumulating_worker(rank, world, calls, transport, frozen=()):
    plan = build_plan(Placement(world, 2, "loop", "bi"), 4)
    stages = build_stages(plan.placement, rank, lambda i: make_layer("mlp", i), NUM_LAYERS)
    for stage, module in stages.items():  # both replicas of each model stage in `frozen`
        module.requires_grad_(plan.placement.model_stage(stage) not in frozen)
    runtime = PipelineRuntime(
        plan, stages, loss_fn, dtype=torch.float64, timeout_s=30, transport=transport
    )
    batches = iter([batch("mlp", 4, seed=7), batch("mlp", 4, seed=8)])
    for call in calls:
        runtime.step(*next(batches)) if call == "step" else runtime.reduce_replica_grads()
    runtime.close()
    return {s: [p.grad for p in m.parameters()] for s, m in stages.items()}


@pytest.mark.parametrize("transport", ["torch", "shm"])
@pytest.mark.parametrize(
    "calls",
    [
        ("step", "step", "reduce"),
        ("step", "reduce", "step", "reduce"),  # was: the first sum counted twice
        ("step", "reduce", "step", "reduce", "reduce"),
    ],
    ids=["once", "after-each-step", "twice-at-the-end"],
)
def test_bi_replica_sums_of_an_accumulation_are_its_gradients(calls, transport):
    """Gradients accumulated over two steps: a sum once at the end and a sum after each step
    give both replicas the two batches' gradients."""
    model = torch.nn.Sequential(*(make_layer("mlp", i) for i in range(NUM_LAYERS)))
    for seed in (7, 8):
        xs, ys = batch("mlp", 4, seed=seed)
        sum(loss_fn(model(x), y) for x, y in zip(xs, ys, strict=True)).div(4).backward()
    depth = 4
    ranges = layer_ranges(NUM_LAYERS, depth)
    for grads in all_ok(run_local(2, _accumulating_worker, calls, transport)):
        for stage, stage_grads in grads.items():
            first, count = ranges[stage % depth]
            want = [p.grad for layer in model[first : first + count] for p in layer.parameters()]
            for got, ref in zip(stage_grads, want, strict=True):
                assert _rel(got, ref) <= TOL, stage


@pytest.mark.parametrize("transport", ["torch", "shm"])
def test_bi_replica_sums_skip_a_frozen_stage(transport):
    """A model stage frozen on both replicas has nothing to sum: its empty payload is not
    sent (on NCCL it set the wire to the host for every later payload), the other stages
    sum as before."""
    model = torch.nn.Sequential(*(make_layer("mlp", i) for i in range(NUM_LAYERS)))
    depth, frozen = 4, (1,)
    ranges = layer_ranges(NUM_LAYERS, depth)
    first, count = ranges[frozen[0]]
    model[first : first + count].requires_grad_(False)
    xs, ys = batch("mlp", 4, seed=7)
    sum(loss_fn(model(x), y) for x, y in zip(xs, ys, strict=True)).div(4).backward()
    calls = ("step", "reduce")
    for grads in all_ok(run_local(2, _accumulating_worker, calls, transport, frozen)):
        for stage, stage_grads in grads.items():
            first, count = ranges[stage % depth]
            want = [p.grad for layer in model[first : first + count] for p in layer.parameters()]
            for got, ref in zip(stage_grads, want, strict=True):
                assert (got is None) if ref is None else _rel(got, ref) <= TOL, stage


class _Recording(StageCallbacks):
    """Wraps the default callbacks, recording every call and checking its arguments."""

    def __init__(self, inner: ModuleCallbacks) -> None:
        self.inner, self.calls = inner, []

    def begin(self, inputs, targets, forward_only):
        self.calls.append(("begin", forward_only))
        self.inner.begin(inputs, targets, forward_only)

    def forward(self, stage, mb, x):
        placement = self.inner.placement
        assert (x is None) == placement.is_first(stage), (stage, mb)
        assert x is None or (x.requires_grad and x.grad_fn is None), "x: a detached leaf"
        out = self.inner.forward(stage, mb, x)
        self.calls.append(("F", stage, mb))
        return out

    def loss_grad(self, stage, mb, loss):
        assert self.inner.placement.is_last(stage) and loss.dim() == 0, (stage, mb)
        self.calls.append(("loss_grad", stage, mb))
        return self.inner.loss_grad(stage, mb, loss)

    def backward(self, stage, mb, out, grad):
        assert (grad is not None) and (out.grad_fn is not None), (stage, mb)
        self.calls.append(("B", stage, mb))
        self.inner.backward(stage, mb, out, grad)


def _recording_worker(rank, world, placement, direction):
    plan = build_plan(Placement(world, 2, placement, direction), 4)
    stages = build_stages(plan.placement, rank, lambda i: make_layer("mlp", i), NUM_LAYERS)
    inner = ModuleCallbacks(stages, loss_fn, plan.placement, 4, torch.device("cpu"), rank)
    callbacks = _Recording(inner)
    runtime = PipelineRuntime(
        plan, stages, None, dtype=torch.float64, timeout_s=30, callbacks=callbacks
    )
    xs, ys = batch("mlp", 4)
    losses = runtime.step(xs, ys)
    if direction == "bi":
        runtime.reduce_replica_grads()
    grads = {s: [p.grad.clone() for p in m.parameters()] for s, m in stages.items()}
    runtime.close()
    return losses, grads, callbacks.calls, [str(a) for a in plan.ranks[rank]]


@pytest.mark.parametrize("placement, direction", [("wave", "uni"), ("loop", "bi")])
def test_custom_callbacks_see_the_documented_calls_and_keep_parity(placement, direction):
    ref_losses, ref_grads, _ = reference("mlp", 4, steps=1)
    results = all_ok(run_local(2, _recording_worker, placement, direction))
    layout = Placement(2, 2, placement, direction)
    depth = layout.depth
    ranges = layer_ranges(NUM_LAYERS, depth)
    seen = set()
    for losses, grads, calls, planned in results:
        assert calls[0] == ("begin", False)
        computes = [c for c in calls[1:] if c[0] in ("F", "B")]
        assert [f"{s}{op}{mb}" for op, s, mb in computes] == planned  # the plan's order
        seeds = [(s, mb) for what, s, mb in calls[1:] if what == "loss_grad"]
        assert seeds == [(s, mb) for op, s, mb in computes if op == "B" and layout.is_last(s)]
        for mb, loss in enumerate(losses):
            if loss is not None:
                seen.add(mb)
                assert _rel(loss, torch.tensor(ref_losses[0][mb], dtype=torch.float64)) <= TOL
        for stage, stage_grads in grads.items():
            first, count = ranges[stage % depth]
            want = [g for layer in ref_grads[first : first + count] for g in layer]
            for got, ref in zip(stage_grads, want, strict=True):
                assert _rel(got, ref) <= TOL, stage
    assert seen == set(range(4))


def _bn_stage(index):
    """A bf16 BatchNorm stage whose buffers differ per stage (num_batches_tracked > 256)."""
    module = torch.nn.BatchNorm1d(3).to(torch.bfloat16)
    module.running_mean.fill_(0.5 + index)
    module.num_batches_tracked.fill_(257 + index)
    return module


def _synced_buffers(rank, world):
    placement = Placement(world, 1, "loop", "bi")
    stages = {stage: _bn_stage(stage) for stage in placement.rank_stages[rank]}
    sync_replicas(placement, stages, timeout_s=30)
    return {s: {k: v.clone() for k, v in m.state_dict().items()} for s, m in stages.items()}


@pytest.mark.parametrize("world", [1, 2])
def test_sync_replicas_copies_integer_buffers_exactly(world):
    """One cat of a bf16 stage's tensors promoted num_batches_tracked to bf16: 257 became
    256 on the replica."""
    placement = Placement(world, 1, "loop", "bi")
    for state in all_ok(run_local(world, _synced_buffers)):
        for stage, buffers in state.items():
            want = _bn_stage(stage % placement.depth).state_dict()
            for name, value in buffers.items():
                assert value.dtype == want[name].dtype and torch.equal(value, want[name]), (
                    stage,
                    name,
                )
