"""Data parallelism around the plain runtime: 4 ranks = 2 pipeline ranks x 2 data-parallel
replicas (gloo). The caller all-reduces the gradients over its data-parallel group after
``step()``, which equals one process on the whole global batch, as fully_shard (FSDP2)
stages do by themselves; torch's DDP outside ``no_sync()``, FSDP1 over several micro-batches,
FSDP under split backward, FSDP2 under bi and replica helpers given every rank are refused
([Note: data parallelism around the plain runtime] in megatron_prt/runtime/callbacks.py)."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from parity_models import HIDDEN, loss_fn, make_layer
from test_runtime_parity import TOL, _rel

from megatron_prt.core import Placement, build_plan
from megatron_prt.runtime import (
    PipelineRuntime,
    build_stages,
    data_parallel_groups,
    layer_ranges,
    sync_replicas,
)
from megatron_prt.runtime.errors import PipelineError
from megatron_prt.runtime.local import all_ok, run_local
from megatron_prt.runtime.replicas import reduce_replica_grads

LAYERS, P, DP, M = 8, 2, 2, 4


def _batches(steps: int, m: int = M) -> tuple[list, list]:
    """``[step][dp][mb]`` inputs and targets."""
    gen = torch.Generator().manual_seed(7)

    def draw():
        return torch.randn(2, HIDDEN, generator=gen, dtype=torch.float64)

    xs = [[[draw() for _ in range(m)] for _ in range(DP)] for _ in range(steps)]
    ys = [[[draw() for _ in range(m)] for _ in range(DP)] for _ in range(steps)]
    return xs, ys


def _reference(steps: int, m: int = M) -> list[list[torch.Tensor]]:
    """Per layer, its gradients from one process: the mean loss over the global batch of
    every step, accumulated over the steps."""
    layers = [make_layer("mlp", i) for i in range(LAYERS)]
    model = torch.nn.Sequential(*layers)
    xs, ys = _batches(steps, m)
    for step in range(steps):
        pairs = [pair for d in range(DP) for pair in zip(xs[step][d], ys[step][d], strict=True)]
        losses = [loss_fn(model(x), y) for x, y in pairs]
        (sum(losses) / len(losses)).backward()
    return [[p.grad for p in layer.parameters()] for layer in layers]


def _expect_the_global_batch(results: list, want: list) -> None:
    """Every rank ran, and each stage's gradients are the one-process reference's."""
    for rank, (status, payload) in enumerate(results):
        assert status == "ok", f"rank {rank}: {payload}"
        for stage, (first, grads) in payload.items():
            ref = [g for layer in want[first : first + len(grads) // 2] for g in layer]
            for got, expected in zip(grads, ref, strict=True):
                assert _rel(got, expected) <= TOL, (rank, stage)


def _groups() -> tuple:
    """Pipelines [0, 1] and [2, 3]; data-parallel groups [0, 2] and [1, 3]."""
    return data_parallel_groups(P)


def _worker(rank, world, where, direction, split, steps, ddp, m=M):
    pipeline, data = _groups()
    placement = Placement(P, 2, where, direction)
    plan = build_plan(placement, m, "zb" if split else "prt")
    modules = build_stages(placement, dist.get_rank(pipeline), lambda i: make_layer("mlp", i), 8)
    sync_replicas(placement, modules, group=pipeline)
    stages = modules
    if ddp:
        from torch.nn.parallel import DistributedDataParallel

        stages = {s: DistributedDataParallel(m, process_group=data) for s, m in modules.items()}
    runtime = PipelineRuntime(plan, stages, loss_fn, group=pipeline, dtype=torch.float64)
    xs, ys = _batches(steps, m)
    for step in range(steps):
        with contextlib.ExitStack() as quiet:  # DDP left to reduce nothing: the caller does
            for module in stages.values() if ddp == "no_sync" else ():
                quiet.enter_context(module.no_sync())
            runtime.step(xs[step][dist.get_rank(data)], ys[step][dist.get_rank(data)])
        runtime.reduce_replica_grads()  # bi: no-op for uni
    for module in modules.values() if ddp != "synced" else ():  # README: the mean
        for param in module.parameters():
            dist.all_reduce(param.grad, group=data)
            param.grad /= DP
    runtime.close()
    ranges = layer_ranges(LAYERS, placement.depth)
    return {
        stage: (ranges[placement.model_stage(stage)][0], [p.grad for p in m.parameters()])
        for stage, m in modules.items()
    }


@pytest.mark.parametrize(
    ("where", "direction", "split", "steps", "ddp", "m"),
    [
        ("loop", "uni", False, 1, None, M),
        ("wave", "bi", True, 2, None, M),
        ("loop", "bi", True, 1, "no_sync", M),
        ("loop", "bi", True, 1, "synced", 2),  # one micro-batch per pipeline: DDP reduces it
    ],
)
def test_data_parallel_by_all_reduce_equals_the_global_batch(
    where, direction, split, steps, ddp, m
):
    """The recipe the README gives: one pipeline group per replica, the gradients averaged
    over the data-parallel group after step() (and the bi replica sum); with gradient
    accumulation over two steps, with DDP stages stepped inside no_sync(), and with DDP
    reducing by itself where each stage runs one micro-batch (bi at m = 2, which was
    refused for the step's two micro-batches)."""
    want = _reference(steps, m)
    results = run_local(4, _worker, where, direction, split, steps, ddp, m, deadline_s=180)
    _expect_the_global_batch(results, want)


def _ddp_stepped(rank, world):
    from torch.nn.parallel import DistributedDataParallel

    placement = Placement(world, 1)
    modules = build_stages(placement, rank, lambda i: make_layer("mlp", i), 4)
    stages = {s: DistributedDataParallel(m) for s, m in modules.items()}
    runtime = PipelineRuntime(build_plan(placement, M), stages, loss_fn, dtype=torch.float64)
    xs, ys = _batches(1)
    try:
        runtime.step(xs[0][0], ys[0][0], forward_only=True)  # evaluation: nothing to reduce
        runtime.step(xs[0][0], ys[0][0])
    finally:
        runtime.close()


def test_a_ddp_stage_over_several_microbatches_is_refused():
    """DDP reduces the first backward after a forward: a stage running F0 F1 B0 B1 had one
    micro-batch's gradients averaged, the replicas drifting apart without a word (96% off)."""
    results = run_local(2, _ddp_stepped, deadline_s=120)
    for rank, (status, payload) in enumerate(results):
        assert status == "error" and "DistributedDataParallel" in str(payload), payload
        assert f"rank {rank}: stage" in str(payload) and "no_sync" in str(payload)


def _ddp_on_the_second_pipeline(rank, world):
    """bi, m = 3 in a plan that gives pipeline 1 two micro-batches (the default split gives
    it one); every rank's pipeline-1 stage in DDP."""
    from torch.nn.parallel import DistributedDataParallel

    from megatron_prt.core.greedy import Policy, list_schedule
    from megatron_prt.core.plan import Plan
    from megatron_prt.core.timing import StageTimes

    placement, mb_pipeline = Placement(world, 1, "loop", "bi"), (1, 0, 1)
    times = StageTimes.uniform(placement.depth)
    orders = list_schedule(placement, mb_pipeline, times, Policy()).orders
    plan = Plan(placement, 3, orders, mb_pipeline=mb_pipeline)
    modules = build_stages(placement, rank, lambda i: make_layer("mlp", i), 4)
    stages = {
        s: DistributedDataParallel(m) if placement.pipeline_of(s) == 1 else m
        for s, m in modules.items()
    }
    runtime = PipelineRuntime(plan, stages, loss_fn, dtype=torch.float64)
    xs, ys = _batches(1, 3)
    try:
        runtime.step(xs[0][0], ys[0][0])
    finally:
        runtime.close()


def test_the_ddp_guard_counts_the_plans_own_split():
    """The guard counted each pipeline's micro-batches from the default split, not the
    plan's: a plan file's pipeline 1 ran two of them in DDP outside no_sync without a word."""
    results = run_local(2, _ddp_on_the_second_pipeline, deadline_s=120)
    for rank, (status, payload) in enumerate(results):
        assert status == "error" and "DistributedDataParallel" in str(payload), payload
        assert f"rank {rank}: stage" in str(payload) and "runs 2 forwards" in str(payload)


def _ddp_in_pipelines(rank, world, fault):
    from torch.nn.parallel import DistributedDataParallel

    pipeline, data = _groups()
    placement = Placement(P, 1)
    modules = build_stages(placement, dist.get_rank(pipeline), lambda i: make_layer("mlp", i), 4)
    wrap = fault == "ddp"
    stages = {
        s: DistributedDataParallel(m, process_group=data) if wrap else m for s, m in modules.items()
    }
    runtime = PipelineRuntime(
        build_plan(placement, M), stages, loss_fn, group=pipeline, dtype=torch.float64
    )
    xs, ys = _batches(1)
    inputs = None if fault == "no inputs" else xs[0][dist.get_rank(data)]
    try:
        runtime.step(inputs, ys[0][dist.get_rank(data)])
    finally:
        runtime.close()


@pytest.mark.parametrize("fault", ["ddp", "no inputs"])
def test_errors_in_a_data_parallel_job_name_the_global_rank(fault):
    """Every pipeline has a rank 0 and a rank 1: in two pipelines of two ranks an error said
    "rank 1" whether it came from global rank 1 or 3, and a waiting rank named the rank that
    failed first by its global number as "rank 2"."""
    results = run_local(4, _ddp_in_pipelines, fault, deadline_s=120)
    for rank, (status, payload) in enumerate(results):
        text = str(payload)
        assert status == "error", text
        assert f"rank {rank % P} (global rank {rank})" in text.splitlines()[0], text
        if fault == "ddp":
            assert f"stage {rank % P} runs in torch's DistributedDataParallel" in text, text
        elif rank % P:  # waited for its peer, which refused the missing inputs
            assert "global rank " in text.split("failed first")[0].split("step 0")[1], text
            assert "inputs=None" in text, text
        else:
            assert "inputs=None" in text, text


def _fsdp_split(rank, world):
    from torch.distributed.fsdp import fully_shard

    placement = Placement(world, 1)
    modules = build_stages(placement, rank, lambda i: make_layer("mlp", i), 4)
    stages = {s: fully_shard(m) for s, m in modules.items()}
    PipelineRuntime(build_plan(placement, M, "zb"), stages, loss_fn, dtype=torch.float64)


def test_fsdp_stages_under_split_backward_are_refused():
    """FSDP reduces and frees a module's gradients when its backward ends, at I: the weight
    gradients W added after were lost (all zero at m = 1) without a word."""
    results = run_local(2, _fsdp_split, deadline_s=120)
    for status, payload in results:
        assert status == "error" and "sharded by FSDP" in str(payload), payload


def _fsdp_stepped(rank, world, api, direction="uni"):
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy, fully_shard

    placement = Placement(world, 1, "loop", direction)
    modules = build_stages(placement, rank, lambda i: make_layer("mlp", i), 4)
    if api.startswith("FSDP1"):  # FSDP1 NO_SHARD, FSDP1 FULL_SHARD
        how = {"sharding_strategy": ShardingStrategy[api.split()[1]], "device_id": "cpu"}
        stages = {s: FullyShardedDataParallel(m, **how) for s, m in modules.items()}
    else:
        stages = {s: fully_shard(m) for s, m in modules.items()}
    m = 2 if direction == "bi" else M
    runtime = PipelineRuntime(build_plan(placement, m), stages, loss_fn, dtype=torch.float64)
    xs, ys = _batches(1, m)
    try:
        runtime.step(xs[0][0], ys[0][0])
    finally:
        runtime.close()


@pytest.mark.parametrize(("api", "direction", "said"), [
    ("FSDP1 NO_SHARD", "uni", "FullyShardedDataParallel"),  # gradients 96% off
    ("FSDP1 FULL_SHARD", "uni", "FullyShardedDataParallel"),  # torch's setStorage error
    ("FSDP2", "bi", "fully_shard (FSDP2)"),  # the replica sum failed on the DTensor grads
])  # fmt: skip
def test_fsdp_stages_the_runtime_cannot_reduce_are_refused(api, direction, said):
    """FSDP1 over several micro-batches: unsharded it reduced like DDP (gradients 96% off,
    without a word), sharded it failed in the second backward with torch's setStorage error;
    fully_shard under bi failed in the replica sum with torch's numpy error. Each is now
    refused naming the rank, the stage and the fix."""
    results = run_local(2, _fsdp_stepped, api, direction, deadline_s=120)
    for rank, (status, payload) in enumerate(results):
        assert status == "error" and said in str(payload), payload
        assert f"rank {rank}: stage" in str(payload) and "README" in str(payload)


def _fully_sharded(rank, world, where):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    pipeline, data = _groups()
    placement = Placement(P, 2, where, "uni")
    modules = build_stages(placement, dist.get_rank(pipeline), lambda i: make_layer("mlp", i), 8)
    mesh = DeviceMesh.from_group(data, "cpu")
    stages = {s: fully_shard(m, mesh=mesh) for s, m in modules.items()}
    plan = build_plan(placement, M)
    runtime = PipelineRuntime(plan, stages, loss_fn, group=pipeline, dtype=torch.float64)
    xs, ys = _batches(1)
    runtime.step(xs[0][dist.get_rank(data)], ys[0][dist.get_rank(data)])
    runtime.close()
    ranges = layer_ranges(LAYERS, placement.depth)
    return {  # fully_shard averages over its mesh by itself: whole gradients, gathered
        stage: (
            ranges[placement.model_stage(stage)][0],
            [p.grad.full_tensor() for p in m.parameters()],
        )
        for stage, m in stages.items()
    }


def test_fully_sharded_stages_reduce_the_global_batch():
    """fully_shard (FSDP2) gathers a stage's parameters again for each backward and reduces
    once the step's last one ends: over several micro-batches it runs as it is, and equals
    one process on the global batch."""
    want = _reference(1)
    results = run_local(4, _fully_sharded, "wave", deadline_s=180)
    _expect_the_global_batch(results, want)


def _replicas_over_every_rank(rank, world, helper, direction="bi"):
    placement = Placement(P, 1, "loop", direction)
    stages = build_stages(placement, rank % P, lambda i: make_layer("mlp", i), 8)
    try:
        helper(placement, stages)
    except PipelineError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("helper", [sync_replicas, reduce_replica_grads])
def test_replica_helpers_refuse_a_group_of_several_pipelines(helper):
    """Called without group= in a job of two pipelines, the ranks of the second held no
    stage of the placement's ranks and summed nothing, without a word."""
    results = run_local(4, _replicas_over_every_rank, helper, deadline_s=120)
    for rank, (status, said) in enumerate(results):
        assert status == "ok" and said is not None, (rank, said)
        assert "group of 4 ranks" in said and "pass group=" in said
    uni = run_local(4, _replicas_over_every_rank, helper, "uni", deadline_s=120)
    assert uni == [("ok", None)] * 4  # nothing to exchange: the README's call stays harmless


def _groups_of(rank, world, pipeline_ranks):
    try:
        data_parallel_groups(pipeline_ranks)
        said = None
    except ValueError as exc:
        said = str(exc)
    dist.barrier()  # no rank exits while another still connects its process group
    return said


def test_a_world_that_makes_no_whole_pipelines_is_refused():
    results = all_ok(run_local(4, _groups_of, 3, deadline_s=60))
    assert all("4 ranks do not make pipelines of 3 ranks" in said for said in results), results
