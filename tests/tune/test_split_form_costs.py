"""The split form's own costs ([Note: the split form's own costs] in sim/layer_cost.py):
plans with I and W are planned and priced with ``split_fwd`` / ``split_bwd`` where a cost
file gives them; plans without are priced as before. Before, a split form measured slower
than the whole one was priced at the whole one's times: split-backward candidates were
predicted 10-15% fast on CPU and led the tuner's ranking."""

from __future__ import annotations

from dataclasses import replace

import pytest
from tune_costs import cost_dict

from megatron_prt.core.placement import ConfigError, Placement
from megatron_prt.core.schedules import build_plan
from megatron_prt.sim.cost import CostModel, LayerCost
from megatron_prt.sim.simulate import simulate
from megatron_prt.tune.partition import partition
from megatron_prt.tune.search_plans import tune

P, M, LAYERS = 2, 4, 6


def costs(fwd_factor: float, bwd_factor: float) -> CostModel:
    """The tuner tests' costs with every layer's split form ``fwd_factor`` / ``bwd_factor``
    times its whole form, W half of the split backward."""
    data = cost_dict(LAYERS)
    for layer in data["layers"]:
        layer["split_fwd"] = fwd_factor * layer["fwd"]
        layer["split_bwd"] = bwd_factor * layer["bwd"]
        layer["wgrad"] = layer["split_bwd"] / 2
    return CostModel.from_dict(data)


def test_the_split_form_swaps_in_its_times_and_round_trips():
    layer = LayerCost(1.0, 2.0, wgrad=2.5, split_fwd=1.5, split_bwd=3.0)
    form = layer.split_form()
    assert (form.fwd, form.bwd, form.wgrad, form.split_fwd, form.split_bwd) == (
        1.5,
        3.0,
        2.5,
        None,
        None,
    )
    assert LayerCost.from_dict(layer.to_dict(), "layers[0]") == layer
    model = costs(1.2, 1.5)
    assert CostModel.from_dict(model.to_dict()) == model
    plain = CostModel.from_dict(cost_dict(LAYERS))
    assert plain.split_form() is plain  # nothing measured: the whole form's times


def test_wgrad_is_bounded_by_the_split_backward_it_is_part_of():
    with pytest.raises(ConfigError, match=r"wgrad \(4\.0\) is part of split_bwd \(3\.0\)"):
        LayerCost(1.0, 2.0, wgrad=4.0, split_bwd=3.0)
    with pytest.raises(ConfigError, match=r"wgrad \(3\.0\) is part of bwd \(2\.0\)"):
        LayerCost(1.0, 2.0, wgrad=3.0)


@pytest.mark.parametrize("schedule", ["zb", "prt"])
def test_a_plan_is_priced_in_its_own_form(schedule):
    cost = costs(1.25, 1.5)
    plan = build_plan(Placement(P, 2), M, schedule)
    got = simulate(plan, cost).makespan
    whole = simulate(plan, CostModel.from_dict(cost_dict(LAYERS))).makespan
    if schedule == "zb":
        assert got == simulate(plan, cost.split_form()).makespan and got > whole
    else:
        assert got == whole  # no I/W: the split form's numbers are not read


def test_the_partitioner_splits_a_split_plan_by_the_split_form():
    """Split forms slower on the early layers move layers towards the last stage."""
    data = cost_dict(LAYERS)
    for i, layer in enumerate(data["layers"]):
        layer["split_bwd"] = layer["bwd"] * 2 * (LAYERS - i)
    cost = CostModel.from_dict(data)
    placement = Placement(P, 1)
    found = partition(cost, placement, M, budget_bytes=float("inf"), schedule="zb")
    priced = replace(cost, stage_layers=found.stage_layers)
    assert found.makespan == simulate(build_plan(placement, M, "zb"), priced).makespan
    whole = partition(
        CostModel.from_dict(cost_dict(LAYERS)),
        placement,
        M,
        budget_bytes=float("inf"),
        schedule="zb",
    )
    assert found.stage_layers[0] < whole.stage_layers[0]


def test_a_slow_split_form_leaves_split_backward_out_of_the_lead():
    """The same model, its split form 20% slower forward and 60% slower backward: split
    backward won on the whole form's times, and must not win on its own."""
    fast = tune(costs(1.0, 1.0), P, M)
    slow = tune(costs(1.2, 1.6), P, M)
    assert fast.winner.plan.split_backward  # equal forms: splitting fills the bubble
    assert not slow.winner.plan.split_backward
    for candidate in slow.ranked:
        priced = replace(costs(1.2, 1.6), stage_layers=candidate.stage_layers)
        assert candidate.makespan == simulate(candidate.plan, priced).makespan


def test_megatron_balanced_partition_of_a_split_run_uses_the_split_form(tmp_path):
    """``--pipeline-reuse-partition balanced`` with ``--pipeline-reuse-split-backward``
    balanced the whole form's costs (the partitioner's default schedule)."""
    import json

    from megatron_flags import BASE, parse

    from megatron_prt.megatron.args import validate_args

    data = cost_dict(8)
    for i, layer in enumerate(data["layers"]):
        layer["split_bwd"] = layer["bwd"] * 2 * (8 - i)
    path = tmp_path / "costs.json"
    path.write_text(json.dumps(data))
    flags = (*BASE, "--pipeline-reuse", 1, "--pipeline-reuse-partition", "balanced")
    flags += ("--pipeline-reuse-costs", path)
    split = validate_args(parse(*flags, "--pipeline-reuse-split-backward"))
    whole = validate_args(parse(*flags))
    cost = CostModel.load(str(path))
    for config, schedule in ((split, "zb"), (whole, "prt")):
        want = partition(cost, config.placement, 4, schedule=schedule)
        assert config.stage_layers == want.stage_layers, schedule
    assert split.stage_layers != whole.stage_layers


@pytest.mark.parametrize("granularity", ["full", "selective"])
def test_recomputed_layers_take_the_form_they_run_in(granularity):
    """Full recomputation reruns its layers plain: their split keys must not price them
    (they did). Selective keeps the linear layers split: their recomputed backward moves
    with the split form (it did not)."""
    data = cost_dict(LAYERS)
    for layer in data["layers"]:
        layer["selective_act"], layer["selective_bwd"] = layer["act"] / 2, layer["bwd"] * 1.2
    plain = CostModel.from_dict(data)
    for layer in data["layers"]:
        layer["split_fwd"], layer["split_bwd"] = layer["fwd"], layer["bwd"] * 2
    split = CostModel.from_dict(data)
    method = ("uniform", 1) if granularity == "full" else (None, None)
    plan = build_plan(Placement(P, 1), 8, "zb")
    with_split = simulate(plan, split.with_recompute(granularity, *method)).makespan
    without = simulate(plan, plain.with_recompute(granularity, *method)).makespan
    if granularity == "full":
        assert with_split == without
    else:
        assert with_split > without


def test_a_split_w_over_the_whole_backward_folds_under_recomputation():
    """A W measured in the split form may exceed the whole backward (it is bounded by
    split_bwd): folding such a layer for selective recomputation raised "wgrad is part of
    bwd" from a valid cost file."""
    data = cost_dict(LAYERS)
    for layer in data["layers"]:
        layer["split_bwd"], layer["wgrad"] = layer["bwd"] * 2, layer["bwd"] * 1.5
        layer["selective_act"], layer["selective_bwd"] = layer["act"] / 2, layer["bwd"] * 1.1
    cost = CostModel.from_dict(data).with_recompute("selective")
    found = partition(cost, Placement(P, 1), M, budget_bytes=float("inf"))
    assert sum(found.stage_layers) == LAYERS
    assert tune(cost, P, M).ranked


def test_the_block_methods_kept_layers_take_the_split_form():
    """Full recomputation by the block method keeps the layers past the first N of each
    stage, and those split: they were priced in the whole form (the split form's slower
    forward and I + W left out). The recomputed ones rerun plain and stay whole."""
    data = cost_dict(LAYERS)
    for layer in data["layers"]:
        layer["split_fwd"], layer["split_bwd"] = layer["fwd"] * 1.5, layer["bwd"] * 2
        layer["wgrad"] = layer["bwd"]
    whole = CostModel.from_dict({**data, "stage_layers": [3, 3]})
    block = whole.with_recompute("full", "block", 1).split_form()
    times = block.stage_times(Placement(P, 1))  # per stage: layer 0 recomputed, 1-2 kept
    for stage, first in enumerate((0, 3)):
        recomputed, kept = whole.layers[first], whole.layers[first + 1 : first + 3]
        ends = block.embedding if stage == 0 else block.head
        fwd = recomputed.fwd + sum(layer.split_fwd for layer in kept) + ends.fwd
        bwd = recomputed.fwd + recomputed.bwd + sum(layer.split_bwd for layer in kept) + ends.bwd
        assert times.fwd[stage] == pytest.approx(fwd) and times.bwd[stage] == pytest.approx(bwd)
        w = sum(layer.wgrad for layer in kept) + ends.wgrad_time(0.5)
        assert times.wgt[stage] == pytest.approx(w)
    from megatron_prt.tune.problem import Problem

    plan = build_plan(Placement(P, 1), M, "zb")  # the partitioner's surrogate agrees
    assert Problem(block, plan).stage_costs([3, 3]).fwd == pytest.approx(list(times.fwd))
    assert "kept_split" not in block.to_dict()  # a pricing state, not a cost-file key
    assert not block.with_recompute(None).kept_split  # nothing kept whole-or-split then
    uniform = whole.with_recompute("full", "uniform", 1).split_form()  # every layer reruns
    assert (
        uniform.stage_times(Placement(P, 1)).fwd
        == whole.with_recompute("full", "uniform", 1).stage_times(Placement(P, 1)).fwd
    )
