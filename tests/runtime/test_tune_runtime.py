"""A tuned plan file runs as it is on 2 CPU ranks and gives the non-pipelined model's losses,
gradients and parameters (float64, 1e-10 relative)."""

from __future__ import annotations

import pytest
import torch
from parity_models import NUM_LAYERS, batch, loss_fn, make_layer, reference, train_errors
from tune_costs import cost_dict

from megatron_prt.core.layers import even_layers
from megatron_prt.runtime import PipelineRuntime, build_stages, sync_replicas
from megatron_prt.runtime.local import all_ok, run_local
from megatron_prt.runtime.stages import layer_ranges
from megatron_prt.sim.cost import CostModel
from megatron_prt.tune.plan_file import PlanFile, load_plan
from megatron_prt.tune.search_plans import tune

TOL = 1e-10
STEPS = 2
P, M = 2, 5


def _worker(rank, world, path, refs):
    """Errors of the plan file's run on this rank against the reference."""
    plan_file = load_plan(path)
    plan = plan_file.plan
    make = lambda i: make_layer("mlp", i)  # noqa: E731
    stages = build_stages(plan.placement, rank, make, NUM_LAYERS, plan_file.stage_layers)
    sync_replicas(plan.placement, stages)
    runtime = PipelineRuntime(plan, stages, loss_fn, dtype=torch.float64, timeout_s=60)
    xs, ys = batch("mlp", M)
    ranges = layer_ranges(NUM_LAYERS, plan.placement.depth, plan_file.stage_layers)
    err, seen = train_errors(runtime, stages, plan.placement, refs, xs, ys, STEPS, ranges)
    runtime.close()
    return err, seen


@pytest.fixture(scope="module")
def tuned():
    return tune(CostModel.from_dict(cost_dict(NUM_LAYERS)), P, M, reuse_limit=3)


def _uneven(tuned):
    """The best candidate with whole backwards whose split and plan both come from the costs."""
    return next(
        c
        for c in tuned.ranked
        if (c.partition, c.planned_for) == ("balanced", "costs") and not c.plan.split_backward
    )


@pytest.mark.parametrize(
    "which", ["winner", "best balanced plan for the costs without split backward"]
)
def test_tuned_plan_file_runs_with_parity(tmp_path, tuned, which):
    chosen = tuned.winner if which == "winner" else _uneven(tuned)
    if which != "winner":  # the file's split is what places the layers
        assert chosen.stage_layers != even_layers(NUM_LAYERS, chosen.plan.placement.depth)
    path = str(tmp_path / "plan.json")
    PlanFile(chosen.plan, chosen.stage_layers).write(path)
    refs = reference("mlp", M, STEPS)
    results = all_ok(run_local(P, _worker, path, refs, deadline_s=300))
    seen = set()
    for err, rank_seen in results:
        seen |= rank_seen
        for what, value in err.items():
            assert value <= TOL, f"{chosen.label}: {what} differs by {value:.3g}"
    assert seen == set(range(M))
