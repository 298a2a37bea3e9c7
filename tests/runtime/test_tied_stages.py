"""A weight shared by two stages on one rank (wave puts the first and the last stage on rank
0): its gradient holds both stages' parts, and under ``bi`` the replica sum adds it once
(summed once per replica pair, it came out 2x the reference, 3x over two accumulated steps)."""

from __future__ import annotations

import pytest
import torch
from parity_models import HIDDEN, batch, loss_fn, rel_err

from megatron_prt.core import Placement, build_plan
from megatron_prt.runtime import PipelineRuntime, build_stages, sync_replicas
from megatron_prt.runtime.local import all_ok, run_local

LAYERS, M, TOL = 6, 4, 1e-10


class _Head(torch.nn.Module):
    """The last layer: the first layer's weight, transposed, then its own bias."""

    def __init__(self, weight: torch.nn.Parameter) -> None:
        super().__init__()
        self.weight = weight
        self.bias = torch.nn.Parameter(torch.zeros(HIDDEN, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight.t(), self.bias)


def _layers():
    """``make_layer`` for a model whose first and last layers share one weight."""
    made: dict[int, torch.nn.Module] = {}

    def make(i: int) -> torch.nn.Module:
        if i == LAYERS - 1:
            return _Head(make(0)[0].weight)
        if i not in made:
            torch.manual_seed(100 + i)
            made[i] = torch.nn.Sequential(torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.Tanh())
            made[i].double()
        return made[i]

    return make


def _reference(steps: int) -> dict[str, torch.Tensor]:
    make = _layers()
    model = torch.nn.Sequential(*(make(i) for i in range(LAYERS)))
    xs, ys = batch("mlp", M)
    for _ in range(steps):
        (sum(loss_fn(model(x), y) for x, y in zip(xs, ys, strict=True)) / M).backward()
    return {"shared": model[0][0].weight.grad, "bias": model[-1].bias.grad}


def _worker(rank, world, where, direction, split, steps):
    placement = Placement(world, 2, where, direction)
    stages = build_stages(placement, rank, _layers(), LAYERS)
    sync_replicas(placement, stages)
    plan = build_plan(placement, M, "zb" if split else "prt")
    runtime = PipelineRuntime(plan, stages, loss_fn, dtype=torch.float64)
    for _ in range(steps):
        runtime.step(*batch("mlp", M))
        runtime.reduce_replica_grads()  # after every step: the sums still add each grad once
    runtime.close()
    last = [s for s in stages if placement.model_stage(s) == placement.depth - 1]
    return {s: {"shared": stages[s][-1].weight.grad, "bias": stages[s][-1].bias.grad} for s in last}


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize(
    ("where", "direction", "steps"),
    [
        ("wave", "uni", 1),
        ("wave", "bi", 1),
        ("wave", "bi", 2),
        ("loop", "bi", 2),  # pipeline 0's first stage and pipeline 1's last share rank 0
    ],
)
def test_a_weight_two_stages_of_a_rank_share_gets_the_reference_gradient(
    where, direction, steps, split
):
    """Loop under bi ties across the pipelines on one rank: the first step after a sum
    zeroed the weight on both ranks (half the reference after two steps)."""
    want = _reference(steps)
    results = all_ok(run_local(2, _worker, where, direction, split, steps, deadline_s=120))
    held = [grads for result in results for grads in result.values()]
    assert len(held) == (2 if direction == "bi" else 1)  # the last stage and its replica
    for grads in held:
        for name, grad in grads.items():
            assert rel_err(grad, want[name]) <= TOL, name
