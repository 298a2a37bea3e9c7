"""The plain-PyTorch form of ``--pipeline-reuse auto``: trace a step of the running plan,
turn every rank's spans into costs (:mod:`megatron_prt.tune.measured`), let rank 0 pick the
plan for the same layout (:func:`tune_layout`), broadcast it, and run it on the same stage
modules; the next step's gradients equal those of a runtime that ran that plan from the
start (2 CPU gloo ranks)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from parity_models import NUM_LAYERS, batch, loss_fn, make_layer  # noqa: E402

from megatron_prt.core import Placement, build_plan  # noqa: E402
from megatron_prt.core.plan import Plan  # noqa: E402
from megatron_prt.runtime import PipelineRuntime, build_stages, sync_replicas  # noqa: E402
from megatron_prt.runtime.local import all_ok, run_local  # noqa: E402
from megatron_prt.tune.measured import measured_cost  # noqa: E402
from megatron_prt.tune.search_plans import tune_layout  # noqa: E402

M = 4
PLACEMENT = Placement(2, 2)
COUNTS = (5, 1, 1, 5)  # uneven stages: the plan for the measured times differs


def _stages(rank):
    stages = build_stages(PLACEMENT, rank, lambda i: make_layer("mlp", i), NUM_LAYERS, COUNTS)
    sync_replicas(PLACEMENT, stages)
    return stages


def _grads(stages) -> list:
    return [p.grad.clone() for _, s in sorted(stages.items()) for p in s.parameters()]


def _switch(rank, world):
    import torch.distributed as dist

    from megatron_prt.runtime.trace import gather_spans

    xs, ys = batch("mlp", M)
    stages = _stages(rank)
    running = PipelineRuntime(build_plan(PLACEMENT, M), stages, loss_fn, dtype=torch.float64)
    running.trace_enabled = True
    running.step(xs, ys)  # the profiled step
    gathered = [[spans] for spans in gather_spans(running)]
    running.close()
    payload = [None]
    if rank == 0:
        cost = measured_cost(PLACEMENT, COUNTS, gathered, split_backward=False)
        payload = [tune_layout(cost, PLACEMENT, M).winner.plan.to_dict()]
    dist.broadcast_object_list(payload, src=0)
    plan = Plan.from_dict(payload[0])
    for module in stages.values():
        module.zero_grad(set_to_none=True)
    switched = PipelineRuntime(plan, stages, loss_fn, dtype=torch.float64)
    switched.step(xs, ys)
    switched.close()
    fresh = _stages(rank)
    from_start = PipelineRuntime(plan, fresh, loss_fn, dtype=torch.float64)
    from_start.step(xs, ys)
    from_start.close()
    return payload[0], _grads(stages), _grads(fresh)


def test_switched_plan_runs_as_if_from_the_start():
    results = all_ok(run_local(2, _switch, deadline_s=300))
    assert results[0][0] == results[1][0]  # one plan on every rank
    assert Plan.from_dict(results[0][0]).placement == PLACEMENT
    for _, switched, from_start in results:
        assert len(switched) == len(from_start) > 0
        for a, b in zip(switched, from_start, strict=True):
            assert torch.equal(a, b)  # same weights, same plan: the same sums in the same order
