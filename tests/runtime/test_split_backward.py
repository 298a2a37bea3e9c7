"""Split backward (I then W) on the plain-PyTorch runtime: the same losses, gradients and
optimizer trajectory as the non-pipelined model (float64, 1e-10 relative), for W placed at
once, a few actions later or at the end of each rank's order; the split layer defers its
weight GEMMs to W; the memory meter counts what I keeps for W."""

from __future__ import annotations

import copy
import functools
import itertools
import json

import pytest
import torch
from parity_models import (
    NUM_LAYERS,
    batch,
    check_grid_results,
    loss_fn,
    make_layer,
    reference,
    train_errors,
)
from test_runtime_parity import STEPS, TOL, _rel

from megatron_prt.core import Placement, build_plan
from megatron_prt.core.actions import Op
from megatron_prt.core.placement import ConfigError
from megatron_prt.core.plan import Plan
from megatron_prt.core.validate import validate
from megatron_prt.core.zerobubble import one_f_one_b_peak, zero_bubble
from megatron_prt.runtime import PipelineRuntime, build_stages, sync_replicas
from megatron_prt.runtime.local import all_ok, run_local
from megatron_prt.runtime.memory import saved_activation_bytes
from megatron_prt.runtime.split_plan import split_backward_plan
from megatron_prt.runtime.stages import layer_ranges
from megatron_prt.runtime.wgrad import (
    apply_weight_grads,
    deferring_weight_grads,
    enable_split_backward,
    held_tensors,
    measure_split_memory,
    split_backward_pass,
    split_forward,
)
from megatron_prt.sim.cost import CostModel, LayerCost
from megatron_prt.sim.simulate import simulate

# W at once, two compute actions later, at the end of the rank; "zb": core's zero-bubble plan
W_DELAYS = (0, 2, None, "zb")


def _split_plan(p, r, placement, direction, m, w_delay):
    layout = Placement(p, r, placement, direction)
    if w_delay == "zb":
        plan = build_plan(layout, m, schedule="zb")
    else:
        plan = split_backward_plan(build_plan(layout, m), w_delay)
    validate(plan)
    return plan


def _check_config(rank, kind, p, r, placement, direction, m, w_delay, refs):
    """Errors of one split configuration on this rank (as test_runtime_parity's check)."""
    plan = _split_plan(p, r, placement, direction, m, w_delay)
    stages = build_stages(plan.placement, rank, lambda i: make_layer(kind, i), NUM_LAYERS)
    if direction == "bi":  # replicas start different; sync must make them equal
        with torch.no_grad():
            for stage, module in stages.items():
                if stage >= plan.placement.depth:
                    for param in module.parameters():
                        param.add_(1.0)
        sync_replicas(plan.placement, stages)
    runtime = PipelineRuntime(plan, stages, loss_fn, dtype=torch.float64, timeout_s=30)
    assert runtime.plan.split_backward
    xs, ys = batch(kind, m)
    ranges = layer_ranges(NUM_LAYERS, plan.placement.depth)
    err, seen = train_errors(runtime, stages, plan.placement, refs, xs, ys, STEPS, ranges)
    runtime.close()
    return err, seen


def _worker(rank, world, configs):
    refs, out = {}, []
    for config in configs:
        kind, _, r, placement, direction, m, w_delay = config
        if (kind, m) not in refs:
            refs[(kind, m)] = reference(kind, m, STEPS)
        err, seen = _check_config(
            rank, kind, world, r, placement, direction, m, w_delay, refs[(kind, m)]
        )
        out.append((config, err, seen))
    return out


def grid(p: int, full: bool):
    """Every (kind, R, placement, direction, m) of the runtime parity grid, W placements in
    turn (all three across the grid); the subset keeps transformer wave, m in {P, 2P+1}."""
    ms = sorted({1, p - 1, p, 2 * p + 1} - {0})
    combos = itertools.product(
        ("mlp", "transformer"), (1, 2, 3), ("loop", "wave"), ("uni", "bi"), ms
    )
    index = 0
    for kind, r, placement, direction, m in combos:
        if direction == "bi" and m < 2:
            continue
        if not full and not (kind == "transformer" and placement == "wave" and m >= p):
            continue
        yield (kind, p, r, placement, direction, m, W_DELAYS[index % len(W_DELAYS)])
        index += 1


def _run_grid(p: int, full: bool) -> int:
    configs = list(grid(p, full))
    results = all_ok(run_local(p, _worker, configs, deadline_s=1800))
    check_grid_results(configs, results, TOL, lambda config: config[5])
    return len(configs)


@pytest.mark.parametrize("p", [2, 3])
def test_split_parity_subset(p):
    assert _run_grid(p, full=False) >= 8  # every W placement, zero-bubble plans included


@pytest.mark.slow
@pytest.mark.parametrize("p", [2, 3, 4])
def test_split_parity_full_grid(p):
    assert _run_grid(p, full=True) > 0


@pytest.mark.parametrize("w_delay", W_DELAYS[:3])
def test_split_plans_are_valid_and_keep_each_rank_order(w_delay):
    plan = build_plan(Placement(3, 2, "wave", "bi"), 7)
    split = _split_plan(3, 2, "wave", "bi", 7, w_delay)
    for before, after in zip(plan.ranks, split.ranks, strict=True):
        renamed = [(a.stage, Op.B if a.op is Op.I else a.op, a.mb) for a in after if a.op != Op.W]
        assert renamed == [tuple(a) for a in before]
        weights = [a for a in after if a.op is Op.W]
        assert sorted(weights) == sorted(a._replace(op=Op.W) for a in before if a.op is Op.B)
        if w_delay is None:
            assert all(a.op is Op.W for a in after[-len(weights) :])


def _mlp():
    torch.manual_seed(3)
    layers = []
    for _ in range(3):
        layers += [torch.nn.Linear(6, 5).double(), torch.nn.GELU(), torch.nn.Linear(5, 6).double()]
    return torch.nn.Sequential(*layers, torch.nn.LayerNorm(6).double())


def test_input_grad_defers_exactly_the_linear_weight_gemms():
    plain, split = _mlp(), _mlp()
    assert enable_split_backward(split) == 6
    x = torch.randn(4, 2, 6, dtype=torch.float64)
    x_plain, x_split = x.clone().requires_grad_(), x.clone().requires_grad_()
    plain(x_plain).pow(2).sum().backward()
    with split_forward():
        loss = split(x_split).pow(2).sum()
    with deferring_weight_grads() as work:
        loss.backward()
    assert len(work) == 6
    torch.testing.assert_close(x_split.grad, x_plain.grad, rtol=1e-12, atol=0)
    linear = [m for m in split.modules() if isinstance(m, torch.nn.Linear)]
    assert all(m.weight.grad is None and m.bias.grad is None for m in linear)
    norm = split[-1]  # not split-capable: its gradient comes with the input gradient
    torch.testing.assert_close(norm.weight.grad, plain[-1].weight.grad, rtol=1e-12, atol=0)
    held = held_tensors(work)
    assert len(held) == 12  # each layer's input and output gradient
    apply_weight_grads(work)
    for got, want in zip(split.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-12, atol=0)


def test_split_layers_under_autocast_give_autocast_gradients():
    """A bfloat16 autocast region around float32 layers: the split backward's GEMMs run in
    bfloat16 as autocast's own (was: "expected m1 and m2 to have the same dtype")."""
    plain, split = _mlp(), _mlp()
    plain, split = plain.float(), split.float()
    enable_split_backward(split)
    x = torch.randn(4, 2, 6)
    x_plain, x_split = x.clone().requires_grad_(), x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss_plain = plain(x_plain).float().pow(2).sum()
        with split_forward():
            loss_split = split(x_split).float().pow(2).sum()
    loss_plain.backward()
    with deferring_weight_grads() as work:
        loss_split.backward()
    assert work and x_split.grad.dtype == torch.float32
    torch.testing.assert_close(x_split.grad, x_plain.grad, rtol=0, atol=0)
    apply_weight_grads(work)
    for got, want in zip(split.parameters(), plain.parameters(), strict=True):
        assert got.grad.dtype == torch.float32
        torch.testing.assert_close(got.grad, want.grad, rtol=0, atol=0)


def test_split_layers_without_deferral_are_plain_linear_and_fire_hooks():
    plain, split = _mlp(), _mlp()
    enable_split_backward(split)
    fired = []
    first = split[0].weight
    first.register_post_accumulate_grad_hook(lambda p: fired.append(p.grad.clone()))
    x = torch.randn(3, 6, dtype=torch.float64)
    for model in (plain, split):
        model(x).sum().backward()
    for got, want in zip(split.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-12, atol=0)
    with split_forward():
        loss = split(x).sum()
    with deferring_weight_grads() as work:
        loss.backward()
    assert len(fired) == 1  # the deferred weight has not been touched yet
    apply_weight_grads(work)
    assert len(fired) == 2 and torch.equal(fired[-1], first.grad)


def test_in_place_weight_grads_skip_the_engine_and_equal_its_result(monkeypatch):
    """W in place (the plain runtime's stages) stores the first gradient of a step itself and
    adds later ones, bit for bit what the engine's accumulators give, without calling it;
    a parameter with a hook still goes through the engine (so the hook fires)."""
    engine, split = _mlp(), _mlp()
    enable_split_backward(split)
    x = torch.randn(4, 6, dtype=torch.float64)

    def deferred(model):
        with split_forward():
            loss = model(x).pow(2).sum()
        with deferring_weight_grads() as work:
            loss.backward()
        return work

    for _ in range(2):  # a fresh step's first W (no .grad yet), then an accumulating one
        apply_weight_grads(deferred(engine))
        work = deferred(split)
        with monkeypatch.context() as patched:
            patched.setattr(torch.autograd, "backward", _engine_called)
            apply_weight_grads(work, in_place=True)
        for got, want in zip(split.parameters(), engine.parameters(), strict=True):
            assert torch.equal(got.grad, want.grad)
    fired = []
    split[0].weight.register_post_accumulate_grad_hook(lambda p: fired.append(1))
    apply_weight_grads(deferred(split), in_place=True)
    assert fired == [1]


def _engine_called(*args, **kwargs):
    raise AssertionError("in-place W called the autograd engine")


def _memory_worker(rank, world, w_delay):
    plan = _split_plan(world, 2, "loop", "uni", 4, w_delay)
    stages = build_stages(plan.placement, rank, lambda i: make_layer("mlp", i), NUM_LAYERS)
    runtime = PipelineRuntime(
        plan, stages, loss_fn, dtype=torch.float64, timeout_s=30, measure_memory=True
    )
    xs, ys = batch("mlp", 4)
    runtime.step(xs, ys)
    stats = runtime.memory_stats()
    runtime.close()
    return stats["peak_bytes"], stats["held_bytes"], stats["timeline"]


def test_memory_counts_what_input_grad_keeps_until_weight_grad():
    at_once = all_ok(run_local(2, _memory_worker, 0))
    at_end = all_ok(run_local(2, _memory_worker, None))
    for (peak_now, held_now, timeline_now), (peak_late, held_late, timeline_late) in zip(
        at_once, at_end, strict=True
    ):
        assert held_now == held_late == 0
        assert peak_late >= peak_now
        for (label, held), (next_label, next_held) in itertools.pairwise(timeline_now):
            if "I" in label:  # W right after: it frees what I kept for it
                assert "W" in next_label and next_held < held, (label, next_label)
        last_i = max(i for i, (label, _) in enumerate(timeline_late) if "I" in label)
        assert timeline_late[last_i][1] > 0  # every W's operands are still held


def _trace_worker(rank, world):
    plan = build_plan(Placement(world, 2, "wave", "uni"), 4)
    stages = build_stages(plan.placement, rank, lambda i: make_layer("mlp", i), NUM_LAYERS)
    runtime = PipelineRuntime(
        plan, stages, loss_fn, dtype=torch.float64, timeout_s=30, trace=True, split_backward=True
    )
    xs, ys = batch("mlp", 4)
    losses = runtime.step(xs, ys)
    spans = [(str(a), start, end) for a, start, end in runtime.trace()]
    grads = {s: [p.grad.clone() for p in m.parameters()] for s, m in stages.items()}
    runtime.close()
    return spans, [str(a) for a in runtime.plan.ranks[rank]], losses, grads


def test_split_backward_flag_splits_a_b_plan_traced_in_plan_order():
    ref_losses, ref_grads, _ = reference("mlp", 4, steps=1)
    ranges = layer_ranges(NUM_LAYERS, 4)
    for spans, planned, losses, grads in all_ok(run_local(2, _trace_worker)):
        assert any("I" in label for label in planned) and not any("B" in a for a in planned)
        assert [label for label, _, _ in spans] == planned
        ends = {label: end for label, _, end in spans}
        for label, start, _ in spans:
            if "W" in label:
                assert start >= ends[label.replace("W", "I")]
        for mb, loss in enumerate(losses):
            if loss is not None:
                assert abs(float(loss) - ref_losses[0][mb]) <= TOL * abs(ref_losses[0][mb])
        for stage, stage_grads in grads.items():
            first, count = ranges[stage]
            want = [g for layer in ref_grads[first : first + count] for g in layer]
            for got, ref in zip(stage_grads, want, strict=True):
                assert _rel(got, ref) <= TOL, stage


class _Checkpointed(torch.nn.Module):
    """A layer under torch's non-reentrant checkpoint (what PyTorch recommends)."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=False)


@pytest.mark.parametrize("shape", [(6, 6), (2, 3, 6)])
@pytest.mark.parametrize("reentrant", [False, True])
def test_a_checkpointed_region_recomputes_in_its_forwards_form(shape, reentrant):
    """Inside split_backward_pass a recomputation takes the form its forward took: torch's
    non-reentrant checkpoint gets the split layers' saved tensors back (wrong weight
    gradients, or torch's metadata error, before); a reentrant one, whose first forward
    ran without grad, recomputes plain and leaves nothing for W."""
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.GELU(), torch.nn.Linear(6, 6))
    plain = plain.double()
    split = copy.deepcopy(plain)
    enable_split_backward(split)
    x = torch.randn(*shape, dtype=torch.float64)
    checkpoint = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=reentrant)
    checkpoint(plain, x.requires_grad_()).square().sum().backward()
    with split_forward():
        out = checkpoint(split, x.detach().requires_grad_())
    with deferring_weight_grads() as work, split_backward_pass():
        out.square().sum().backward()
    assert len(work) == (0 if reentrant else 2)
    apply_weight_grads(work)
    for got, want in zip(split.parameters(), plain.parameters(), strict=True):
        assert _rel(got.grad, want.grad) <= TOL


class _Doubled(torch.nn.Module):
    """A parametrization: the layer's weight is made anew, twice the stored one, at each
    access."""

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return 2.0 * weight


def _parametrized_before(layer: torch.nn.Linear) -> torch.nn.Linear:
    torch.nn.utils.parametrize.register_parametrization(layer, "weight", _Doubled())
    return layer


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.nn.utils.parametrizations.weight_norm(torch.nn.Linear(6, 6)),
        lambda: torch.nn.utils.weight_norm(torch.nn.Linear(6, 6)),  # the older hook form
        lambda: _parametrized_before(torch.nn.Linear(6, 6)),
        lambda: torch.nn.Linear(6, 6),  # parametrized once split-capable (below)
    ],
    ids=["weight_norm", "weight_norm_hook", "parametrized_before", "parametrized_after"],
)
def test_a_layer_whose_weight_is_made_anew_recomputes_in_its_forwards_form(make):
    """The form a forward took was kept on its weight: a parametrized or weight-normed
    layer makes its weight anew at each access, so under a non-reentrant checkpoint its
    recompute found no form, ran plain and handed the split nodes a plain linear's tensors
    (gradients of every layer around it 64-97% off, without a word)."""
    models = []
    for _ in range(2):  # the same weights twice (the hook form of weight norm cannot be copied)
        torch.manual_seed(0)
        models.append(torch.nn.Sequential(make(), torch.nn.GELU(), torch.nn.Linear(6, 6)).double())
    plain, split = models
    enable_split_backward(split)
    if not torch.nn.utils.parametrize.is_parametrized(plain[0]) and "weight_g" not in dict(
        plain[0].named_parameters()
    ):
        for model in (plain, split):  # parametrized after split-capable: still split
            torch.nn.utils.parametrize.register_parametrization(model[0], "weight", _Doubled())
    x = torch.randn(6, 6, dtype=torch.float64)
    checkpoint = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)
    checkpoint(plain, x.requires_grad_()).square().sum().backward()
    x_split = x.detach().requires_grad_()
    with split_forward():
        out = checkpoint(split, x_split)
    with deferring_weight_grads() as work, split_backward_pass():
        out.square().sum().backward()
    apply_weight_grads(work)
    assert _rel(x_split.grad, x.grad) <= TOL
    for got, want in zip(split.parameters(), plain.parameters(), strict=True):
        assert _rel(got.grad, want.grad) <= TOL


def test_a_split_capable_model_pickles_and_loads_as_one(tmp_path):
    """torch.save of a whole model whose layers were made split-capable failed (the class
    made for them could not be found by name), or loaded none (an override bound on the
    layer); a class made on demand (attention's own linear subclass) loads in a process that
    never made it."""
    import subprocess
    import sys

    model = torch.nn.Sequential(torch.nn.MultiheadAttention(6, 2).out_proj, *_mlp()).double()
    assert enable_split_backward(model) == 7
    path = tmp_path / "model.pt"
    torch.save(model, path)
    x = torch.randn(4, 6, dtype=torch.float64)
    torch.save((x, model(x)), tmp_path / "io.pt")
    loads = (
        "import sys, torch; m = torch.load(sys.argv[1], weights_only=False); "
        "x, y = torch.load(sys.argv[2]); "
        "print([type(layer).__name__ for layer in m][:2], torch.equal(m(x), y))"
    )
    done = subprocess.run(
        [sys.executable, "-c", loads, str(path), str(tmp_path / "io.pt")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    names = "['SplitCapableNonDynamicallyQuantizableLinear', 'SplitCapableLinear']"
    assert done.stdout.strip() == f"{names} True"


def _ddp_worker(rank, world):
    from torch.nn.parallel import DistributedDataParallel

    from megatron_prt.runtime.callbacks import ModuleCallbacks

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    model = model.double()
    plain = copy.deepcopy(model)
    enable_split_backward(model)
    ddp, ddp_plain = DistributedDataParallel(model), DistributedDataParallel(plain)
    in_place = ModuleCallbacks({0: ddp}, loss_fn, Placement(2, 1), 1, torch.device("cpu"), rank)
    torch.manual_seed(10 + rank)  # each rank its own data: DDP averages the gradients
    x = torch.randn(3, 4, dtype=torch.float64)
    ddp_plain(x).sum().backward()
    with split_forward():
        out = ddp(x)
    with deferring_weight_grads() as work:
        out.sum().backward()
    apply_weight_grads(work, in_place=in_place.in_place_weight_grads)
    return [p.grad for p in model.parameters()], [p.grad for p in plain.parameters()]


def test_weight_gradients_of_a_ddp_stage_are_reduced():
    """The plain runtime's stages wrote W's gradients in place, past the accumulator: a
    stage wrapped in torch's DDP, whose reducer hooks the accumulators from C++, never
    reduced them (ranks kept their own unaveraged gradients, without a word)."""
    results = all_ok(run_local(2, _ddp_worker))
    for split_grads, plain_grads in results:
        for got, want in zip(split_grads, plain_grads, strict=True):
            assert _rel(got, want) <= TOL


def _checkpointed_worker(rank, world, rows, schedule, reuse):
    plan = build_plan(Placement(world, reuse, "wave" if reuse > 1 else "loop", "uni"), 3, schedule)
    layer = lambda i: _Checkpointed(make_layer("mlp", i))  # noqa: E731
    stages = build_stages(plan.placement, rank, layer, NUM_LAYERS)
    runtime = PipelineRuntime(plan, stages, loss_fn, dtype=torch.float64, split_backward=True)
    xs, ys = batch("mlp", 3, mb_size=rows)
    runtime.step(xs, ys)
    runtime.close()
    return {s: [p.grad.clone() for p in m.parameters()] for s, m in stages.items()}


@pytest.mark.parametrize(("rows", "schedule", "reuse"), [(8, "zb", 1), (8, "prt", 2), (3, "zb", 1)])
def test_split_backward_through_non_reentrant_checkpoints_is_exact(rows, schedule, reuse):
    """The recompute inside I built plain linears for the forward's split ones: with rows =
    HIDDEN (square activations) the saved tensors matched by shape and the weight gradients
    came out wrong without a word (46% off); other shapes failed in torch's checkpoint."""
    model = torch.nn.Sequential(*(make_layer("mlp", i) for i in range(NUM_LAYERS)))
    xs, ys = batch("mlp", 3, mb_size=rows)
    sum(loss_fn(model(x), y) for x, y in zip(xs, ys, strict=True)).div(3).backward()
    ranges = layer_ranges(NUM_LAYERS, 2 * reuse)
    for grads in all_ok(run_local(2, _checkpointed_worker, rows, schedule, reuse)):
        for stage, stage_grads in grads.items():
            first, count = ranges[stage]
            want = [p.grad for layer in model[first : first + count] for p in layer.parameters()]
            for got, ref in zip(stage_grads, want, strict=True):
                assert _rel(got, ref) <= TOL, stage


# -- measured activation memory against the simulator's prediction ---------------------------
MEMORY_LAYERS = 8  # Linear+GELU: W's operands are exactly what the forward saved (keep 1)


def _gelu_layer(index: int) -> torch.nn.Module:
    torch.manual_seed(2000 + index)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU()).double()


def _memory_cost(placement: Placement) -> CostModel:
    """Per-layer ``act`` and ``wact`` measured on each model stage's module (the layer
    shares of its measure), the loss as the head (it saves the output and the target)."""
    xs, ys = batch("mlp", 1)
    counts = CostModel(layers=(LayerCost(1, 1),) * MEMORY_LAYERS).layer_counts(placement.depth)
    layers, first = [], 0
    for count in counts:
        module = torch.nn.Sequential(*(_gelu_layer(first + i) for i in range(count)))
        held = measure_split_memory(module, xs[0])
        layers += [LayerCost(1, 2, act=held["act"] / count, wact=held["wact"] / count)] * count
        first += count
    out = torch.zeros_like(ys[0], requires_grad=True)
    _, loss_bytes = saved_activation_bytes(lambda: loss_fn(out, ys[0]))
    return CostModel(layers=tuple(layers), head=LayerCost(0, 0, act=loss_bytes, wact=0))


MEMORY_PLANS = ("1f1b", "zb", "late-w")  # late-w: every W at the end of its rank's order


def _memory_plan(placement: Placement, m: int, kind: str) -> Plan:
    if kind == "late-w":
        return split_backward_plan(build_plan(placement, m), None)
    if kind == "zb":
        cost = _memory_cost(placement)
        act = cost.stage_activation_bytes(placement)
        return zero_bubble(placement, m, act=act, keep=cost.stage_wgrad_keep(placement))
    return build_plan(placement, m, "1f1b" if placement.reuse == 1 else "prt")


def _measured_peaks_worker(rank, world, reuse, m):
    placement = Placement(world, reuse)
    xs, ys = batch("mlp", m)
    peaks = {}
    for kind in MEMORY_PLANS:
        plan = _memory_plan(placement, m, kind)
        stages = build_stages(placement, rank, _gelu_layer, MEMORY_LAYERS)
        runtime = PipelineRuntime(
            plan, stages, loss_fn, dtype=torch.float64, timeout_s=30, measure_memory=True
        )
        runtime.step(xs, ys)
        peaks[kind] = runtime.memory_peak()
        runtime.close()
    return peaks


@pytest.mark.parametrize("reuse", [1, 2])
def test_measured_activation_peaks_are_the_simulated_ones(reuse):
    """In bytes, per rank: what the runtime's meter counts (forward's saved tensors until
    I; each split layer's input and output gradient from I until W) is what the simulator
    predicts from the profiled per-layer act and wact; the zero-bubble plan capped at
    1F1B's peak holds no more than 1F1B when measured."""
    world, m = 2, 5
    placement = Placement(world, reuse)
    measured = all_ok(run_local(world, _measured_peaks_worker, reuse, m))
    cost = _memory_cost(placement)
    for kind in MEMORY_PLANS:
        sim = simulate(_memory_plan(placement, m, kind), cost)
        predicted = [r.peak_activation_bytes for r in sim.per_rank]
        got = [peaks[kind] for peaks in measured]
        assert got == pytest.approx(predicted, rel=1e-12), kind
    busiest = {kind: max(peaks[kind] for peaks in measured) for kind in MEMORY_PLANS}
    one_f_one_b = one_f_one_b_peak(world, m, cost.stage_activation_bytes(Placement(world)))
    assert busiest["1f1b"] == pytest.approx(one_f_one_b, rel=1e-12) or reuse > 1
    assert busiest["zb"] <= one_f_one_b * (1 + 1e-12)
    assert busiest["late-w"] > one_f_one_b  # deferring every W costs what the meter sees


def test_cost_files_give_w_its_measured_bytes_per_stage(tmp_path):
    """``wact`` per entry (a bare linear layer: W holds its input and output gradient, twice
    what its forward saved) sets each stage's share, above 1 too; the loss keeps nothing
    for W; entries without it keep ``wgrad_keep_fraction`` of their act."""
    layer = {"fwd": 1, "bwd": 2, "act": 4, "wact": 8}
    data = {"layers": [layer] * 4, "head": {"fwd": 0, "bwd": 0, "act": 4, "wact": 0}}
    path = tmp_path / "cost.json"
    path.write_text(json.dumps(data))
    cost = CostModel.load(str(path))
    assert cost.stage_wgrad_keep(Placement(2)) == (2.0, 16 / 12)
    assert CostModel.from_dict(cost.to_dict()) == cost
    plain = CostModel(layers=(LayerCost(1, 2, act=4),) * 4, wgrad_keep_fraction=0.25)
    assert plain.stage_wgrad_keep(Placement(2)) == (0.25, 0.25)
    with pytest.raises(ConfigError, match="wact"):
        LayerCost(1, 2, act=4, wact=-1)


def test_a_split_capable_model_is_freed_without_the_cyclic_collector():
    """Split-capable layers kept their forward override on themselves (a method bound to
    the layer): a model out of scope lived on until the cyclic collector ran, and a forked
    rank collecting a copied model mid-step stalled its peer (tests/runtime/test_local_ranks.py)."""
    import gc
    import weakref

    model = _mlp()
    assert enable_split_backward(model) == 6 and enable_split_backward(model) == 6
    kinds = {type(layer) for layer in model if isinstance(layer, torch.nn.Linear)}
    assert len(kinds) == 1 and type(model[0]).__name__ == "SplitCapableLinear"
    assert type(_mlp()[0]) is torch.nn.Linear  # other models keep their class
    alive = weakref.ref(model[0])
    gc.disable()
    try:
        del model
        assert alive() is None
    finally:
        gc.enable()
