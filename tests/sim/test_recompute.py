"""Activation recomputation in the cost model and the simulator (megatron's semantics:
sim/cost.py, "Activation recomputation"), on hand-checkable pipelines.

1F1B with P = 2, m = 4, four layers (two per stage), free messages: rank 0 holds two
micro-batches at its peak, rank 1 one; every layer forward 1, backward 2, 100 bytes held
without recomputation, and a layer input (a stage message) is 10 bytes.
"""

from __future__ import annotations

import json

import pytest

from megatron_prt.cli.main import main
from megatron_prt.core import ConfigError, Placement, build_plan
from megatron_prt.sim.cost import CostModel, LayerCost
from megatron_prt.sim.simulate import simulate

ACT, INPUT, M = 100.0, 10.0, 4
LAYER = LayerCost(fwd=1.0, bwd=2.0, act=ACT)
ONE_F_ONE_B = Placement(2, 1, "loop", "uni")


def _cost(**fields) -> CostModel:
    return CostModel(layers=(LAYER,) * 4, message_bytes=INPUT, **fields)


def _peaks_and_makespan(cost: CostModel) -> tuple[list[float], float]:
    result = simulate(build_plan(ONE_F_ONE_B, M), cost)
    return [r.peak_activation_bytes for r in result.per_rank], result.makespan


def test_full_recompute_holds_only_the_layer_inputs_and_reruns_the_forward():
    peaks, makespan = _peaks_and_makespan(_cost())
    assert peaks == [2 * 2 * ACT, 1 * 2 * ACT]
    assert makespan == (M + 1) * (2 * 1 + 2 * 2)  # 1F1B: (m + P - 1) * (F + B) per stage
    full = _cost().with_recompute("full", "uniform", 1)
    peaks, makespan = _peaks_and_makespan(full)
    assert peaks == [2 * 2 * INPUT, 1 * 2 * INPUT]  # held inputs only, nothing else
    assert makespan == (M + 1) * (2 * 1 + 2 * (2 + 1))  # backward = backward + forward


@pytest.mark.parametrize(
    "method, count, per_stage_bytes, per_stage_bwd",
    [
        ("uniform", 2, INPUT, 2 * 3.0),  # one block per stage: its input only
        ("block", 1, INPUT + ACT, 3.0 + 2.0),  # first layer recomputed, second kept
        ("block", 2, 2 * INPUT, 2 * 3.0),
    ],
)
def test_full_recompute_methods_follow_megatron_per_stage(
    method, count, per_stage_bytes, per_stage_bwd
):
    cost = _cost().with_recompute("full", method, count)
    assert cost.stage_activation_bytes(ONE_F_ONE_B) == (per_stage_bytes, per_stage_bytes)
    assert cost.stage_times(ONE_F_ONE_B).bwd == (per_stage_bwd, per_stage_bwd)
    peaks, _ = _peaks_and_makespan(cost)
    assert peaks == [2 * per_stage_bytes, per_stage_bytes]


def test_measured_recompute_numbers_win_and_ends_are_never_recomputed():
    layer = LayerCost(fwd=1.0, bwd=2.0, act=ACT, full_act=12.0, full_bwd=3.5)
    head = LayerCost(fwd=1.0, bwd=1.0, act=50.0)
    cost = CostModel(layers=(layer,) * 4, head=head, message_bytes=INPUT)
    full = cost.with_recompute("full", "uniform", 1)
    assert full.stage_activation_bytes(ONE_F_ONE_B) == (2 * 12.0, 2 * 12.0 + 50.0)
    assert full.stage_times(ONE_F_ONE_B).bwd == (2 * 3.5, 2 * 3.5 + 1.0)


def test_full_recompute_needs_the_size_of_what_it_keeps():
    """No full_act and no message_bytes priced every recomputed layer at 0 bytes, so any
    budget fitted; the kept input's size is asked for, and either key gives it."""
    with pytest.raises(ConfigError, match=r"give message_bytes .* --recompute-granularity full"):
        CostModel(layers=(LAYER,) * 4).with_recompute("full", "uniform", 1)
    sized = LayerCost(fwd=1.0, bwd=2.0, act=ACT, full_act=INPUT)
    cost = CostModel(layers=(sized,) * 4).with_recompute("full", "uniform", 1)
    assert cost.stage_activation_bytes(ONE_F_ONE_B) == (2 * INPUT, 2 * INPUT)


def test_selective_needs_measured_numbers():
    with pytest.raises(ConfigError, match=r"profile .*--recompute-granularity selective"):
        _cost().with_recompute("selective")
    layer = LayerCost(fwd=1.0, bwd=2.0, act=ACT, selective_act=60.0, selective_bwd=2.25)
    cost = CostModel(layers=(layer,) * 4).with_recompute("selective")
    assert cost.stage_activation_bytes(ONE_F_ONE_B) == (120.0, 120.0)
    assert cost.stage_times(ONE_F_ONE_B).bwd == (4.5, 4.5)


@pytest.mark.parametrize(
    "setting, flag",
    [
        (("full", None, 1), "--recompute-method"),
        (("full", "uniform", None), "--recompute-num-layers"),
        (("full", "uniform", 0), "--recompute-num-layers"),
        (("selective", "uniform", None), "takes no --recompute-method"),
        ((None, "block", 2), "need --recompute-granularity full"),
        (("partial", None, None), "full or selective"),
    ],
)
def test_megatrons_rules_are_enforced_naming_the_flag(setting, flag):
    with pytest.raises(ConfigError, match=flag):
        _cost().with_recompute(*setting)


def test_recompute_needs_per_layer_costs():
    with pytest.raises(ConfigError, match="per-layer costs"):
        CostModel(fwd_time=3.0, bwd_time=6.0).with_recompute("full", "uniform", 1)


def test_json_round_trip_and_files_without_recompute_keys(tmp_path):
    cost = CostModel(
        layers=(LayerCost(fwd=1.0, bwd=2.0, act=ACT, full_act=12.0, full_bwd=3.5),) * 4,
        message_bytes=INPUT,
    ).with_recompute("full", "block", 1)
    path = tmp_path / "costs.json"
    path.write_text(json.dumps(cost.to_dict()))
    assert CostModel.load(str(path)) == cost
    plain = _cost().to_dict()  # off: none of the new keys are written
    assert not {k for k in plain if k.startswith("recompute")}
    assert not {k for layer in plain["layers"] for k in layer if "_" in k}
    bad = {**plain, "recompute_granularity": 1}
    path.write_text(json.dumps(bad))
    with pytest.raises(ConfigError, match="recompute_granularity must be a string"):
        CostModel.load(str(path))


def test_cli_simulate_takes_megatrons_recompute_flags(tmp_path, capsys):
    path = tmp_path / "costs.json"
    path.write_text(json.dumps(_cost().to_dict()))
    argv = ["simulate", "--costs", str(path), "--pp", "2", "-m", str(M), "--json"]
    runs = {}
    for extra in ([], ["--recompute-granularity", "full", "--recompute-method", "uniform",
                       "--recompute-num-layers", "1"]):  # fmt: skip
        assert main(argv + extra) == 0
        runs[bool(extra)] = json.loads(capsys.readouterr().out)
    peaks = {key: [r["peak_activation_bytes"] for r in runs[key]["per_rank"]] for key in runs}
    assert peaks == {False: [400.0, 200.0], True: [40.0, 20.0]}
    assert runs[True]["makespan"] > runs[False]["makespan"]
    assert main([*argv, "--recompute-granularity", "full"]) == 2
    assert "--recompute-method" in capsys.readouterr().err
    whole = ["--recompute-granularity", "full", "--recompute-method", "uniform"]
    assert main([*argv, *whole, "--recompute-num-layers", "4"]) == 2  # stages of 2 layers
    assert "refuses this split" in capsys.readouterr().err


def test_split_backward_fully_recomputed_layers_have_no_w():
    """[Note: full recomputation has no W]: a fully recomputed layer's weight gradients are
    computed in I, so it holds nothing after I and its W takes no time."""
    from dataclasses import replace

    plan = build_plan(ONE_F_ONE_B, M, "zb")
    full = _cost(wgrad_fraction=0.5).with_recompute("full", "uniform", 1)
    assert full.stage_wgrad_times(2) == (0.0, 0.0)
    assert full.stage_wgrad_keep(Placement(2)) == (0.0, 0.0)
    assert full.stage_times(ONE_F_ONE_B).bwd == (6.0, 6.0)  # all of it in I
    peaks = [r.peak_activation_bytes for r in simulate(plan, full).per_rank]
    freed_at_i = replace(full, wgrad_keep_fraction=0.0)
    assert peaks == [r.peak_activation_bytes for r in simulate(plan, freed_at_i).per_rank]
    # block method: the stage's second layer is kept and keeps its W share and time
    block = _cost(wgrad_fraction=0.5).with_recompute("full", "block", 1)
    keep = block.wgrad_keep_fraction
    assert block.stage_wgrad_keep(Placement(2)) == (keep * ACT / (ACT + INPUT),) * 2
    assert block.stage_wgrad_times(2) == (1.0, 1.0)  # half of the kept layer's backward
