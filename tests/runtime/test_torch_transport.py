"""The torch.distributed transport on a pipeline group that is not the whole world: messages
go to the peer's rank in the group (not its global rank), and plans with many messages a
step (wave, bi, R=3) keep the non-pipelined losses, gradients and parameters."""

from __future__ import annotations

import torch
import torch.distributed as dist
from parity_models import NUM_LAYERS, batch, loss_fn, make_layer, reference, train_errors

from megatron_prt.core import Placement, build_plan
from megatron_prt.runtime import PipelineRuntime, build_stages, sync_replicas
from megatron_prt.runtime.local import all_ok, run_local
from megatron_prt.runtime.stages import layer_ranges

TOL = 1e-10
STEPS = 2
PIPELINE = [1, 2]  # global ranks of the pipeline group: group rank 0 is global rank 1
CONFIGS = [  # (layer kind, R, placement, direction, m)
    ("mlp", 2, "wave", "bi", 5),
    ("mlp", 3, "loop", "uni", 5),
    ("transformer", 2, "wave", "uni", 3),
]


def _worker(rank: int, world: int) -> list:
    group = dist.new_group(PIPELINE)  # collective: every rank of the world calls it
    out = _train_configs(group) if rank in PIPELINE else []
    dist.barrier()  # the rank outside the group stays until the pipeline is done with gloo
    return out


def _train_configs(group) -> list:
    group_rank = dist.get_rank(group)
    out = []
    for kind, reuse, placement, direction, m in CONFIGS:
        plan = build_plan(Placement(len(PIPELINE), reuse, placement, direction), m)
        stages = build_stages(
            plan.placement, group_rank, lambda i, kind=kind: make_layer(kind, i), NUM_LAYERS
        )
        sync_replicas(plan.placement, stages, group=group)
        runtime = PipelineRuntime(
            plan, stages, loss_fn, group=group, dtype=torch.float64, timeout_s=30, transport="torch"
        )
        xs, ys = batch(kind, m)
        ranges = layer_ranges(NUM_LAYERS, plan.placement.depth)
        refs = reference(kind, m, STEPS)
        err, seen = train_errors(runtime, stages, plan.placement, refs, xs, ys, STEPS, ranges)
        out.append(((kind, reuse, placement, direction, m), err, seen))
    return out


def test_pipeline_subgroup_keeps_parity():
    results = [r for r in all_ok(run_local(3, _worker, deadline_s=120)) if r]
    assert len(results) == len(PIPELINE)
    for index, config in enumerate(CONFIGS):
        seen = set()
        for rank_results in results:
            got, err, rank_seen = rank_results[index]
            assert got == config
            seen |= rank_seen
            for what, value in err.items():
                assert value <= TOL, f"{config}: {what} differs by {value:.3g}"
        assert seen == set(range(config[-1])), f"{config}: losses missing"


class _Recorder:
    """Wraps a transport: logs ``send``/``recv`` calls by kind of message, in call order."""

    def __init__(self, inner, log: list) -> None:
        self.inner, self.log = inner, log

    def send(self, key, tensor):
        self.log.append(f"send {key[0]} {key[3]}")
        return self.inner.send(key, tensor)

    def recv(self, key):
        self.log.append(f"recv {key[0]} {key[3]}")
        return self.inner.recv(key)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _first_stage_log(rank: int, world: int) -> list[str]:
    """Rank 0's calls in a 1F1B step (m=4) after the first, which exchanged the shapes."""
    plan = build_plan(Placement(world), 4, "1f1b")
    stages = build_stages(plan.placement, rank, lambda i: make_layer("mlp", i), NUM_LAYERS)
    runtime = PipelineRuntime(plan, stages, loss_fn, dtype=torch.float64, transport="torch")
    xs, ys = batch("mlp", 4)
    runtime.step(xs, ys)
    log: list[str] = []
    runtime.transport = _Recorder(runtime.transport, log)
    forward = runtime.callbacks.forward
    runtime.callbacks.forward = lambda stage, mb, x: log.append(f"F {mb}") or forward(stage, mb, x)
    runtime.step(xs, ys)
    return log


def test_receives_posted_ahead_go_behind_the_sends():
    """The first stage computes F0 and sends it before posting the receives it needs only
    later; every receive it posts is still posted before the gradient it receives is needed
    (all four, lookahead 16, before the first backward's wait)."""
    log = all_ok(run_local(2, _first_stage_log, deadline_s=120))[0]
    assert log[:2] == ["F 0", "send act 0"], log
    assert log[2:6] == [f"recv grad {mb}" for mb in range(4)], log
