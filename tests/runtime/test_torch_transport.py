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
    if rank not in PIPELINE:
        return []
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
