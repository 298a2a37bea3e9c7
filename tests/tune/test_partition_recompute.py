"""The partitioner under megatron's activation recomputation: it splits by what recomputed
layers keep and cost (sim/cost.py), finds splits a budget allows only with recomputation,
keeps megatron's uniform blocks whole, and prices every answer as the simulator does."""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import replace

import pytest

from megatron_prt.core import ConfigError, Placement, build_plan
from megatron_prt.megatron.config import with_model_recompute
from megatron_prt.sim.cost import CostModel, LayerCost
from megatron_prt.sim.simulate import simulate
from megatron_prt.tune import partition as pm
from megatron_prt.tune.problem import Problem, partitions

ONE_F_ONE_B = Placement(2, 1, "loop", "uni")


def gpt_like(num_layers: int, seed: int = 0) -> CostModel:
    """Jittered layers that hold much more than their input (a stage message, 4 bytes),
    measured selective numbers, heavy end stages."""
    rng = random.Random(seed)
    layers = []
    for _ in range(num_layers):
        fwd, act = 1 + rng.random(), 40 + 10 * rng.random()
        layers.append(
            LayerCost(fwd, 2 * fwd, act, 5.0, selective_act=0.7 * act, selective_bwd=2.3 * fwd)
        )
    return CostModel(
        layers=tuple(layers),
        embedding=LayerCost(0.3, 0.6, 5.0, 20.0),
        head=LayerCost(1.5, 3.0, 30.0, 20.0),
        message_bytes=4.0,
    )


def check_simulated(result, cost, placement, m):
    """The reported numbers are the simulator's for that split under ``cost``."""
    sim = simulate(build_plan(placement, m), replace(cost, stage_layers=result.stage_layers))
    assert result.makespan == sim.makespan
    assert result.balanced.per_rank == sim.per_rank


def test_a_budget_1f1b_cannot_meet_without_recompute_is_met_with_it():
    cost, m = gpt_like(8), 4
    least = pm.partition(cost, ONE_F_ONE_B, m, slack=1e6)  # least memory at any speed
    budget = 0.8 * least.balanced.peak_bytes
    with pytest.raises(ConfigError, match="no layer partition fits the budget"):
        pm.partition(cost, ONE_F_ONE_B, m, budget_bytes=budget)
    full = cost.with_recompute("full", "uniform", 1)
    result = pm.partition(full, ONE_F_ONE_B, m, budget_bytes=budget)
    assert result.balanced.peak_bytes <= budget
    assert result.makespan > pm.partition(cost, ONE_F_ONE_B, m).fastest_makespan  # costs more
    check_simulated(result, full, ONE_F_ONE_B, m)


@pytest.mark.parametrize(
    "setting",
    [("full", "uniform", 1), ("full", "uniform", 2), ("full", "block", 1), ("selective",)],
)
@pytest.mark.parametrize(
    "placement", [Placement(2, 2, "wave", "uni"), Placement(2, 1, "loop", "bi")]
)
def test_exact_answers_are_the_best_simulated_split(setting, placement):
    cost, m = gpt_like(8, seed=5).with_recompute(*setting), 4
    result = pm.partition(cost, placement, m, slack=0.0)
    assert result.exact
    check_simulated(result, cost, placement, m)
    unit = setting[2] if setting[1:2] == ("uniform",) else 1
    assert all(n % unit == 0 for n in result.stage_layers)  # megatron's whole blocks
    plan = build_plan(placement, m)
    lows = pm.min_stage_layers(cost, placement.depth)
    times = [
        simulate(plan, replace(cost, stage_layers=counts)).makespan
        for counts in partitions(len(cost.layers), lows)
        if all(n % unit == 0 for n in counts)
    ]
    assert result.makespan == pytest.approx(min(times), rel=1e-9)  # the fastest whole-block


def test_block_method_memory_model_matches_the_simulator():
    """block: the first layers of each stage are recomputed, so a stage's bytes depend on
    the split; the partitioner's accounting equals the simulator's for any split."""
    pl = Placement(2, 2, "wave", "bi")
    cost = gpt_like(12, seed=3).with_recompute("full", "block", 2)
    plan = build_plan(pl, 4)
    problem = Problem(cost, plan)
    candidates = list(partitions(len(cost.layers), (0,) * pl.depth))
    for counts in random.Random(1).sample(candidates, 6):
        sim = simulate(plan, replace(cost, stage_layers=counts))
        peaks = problem.rank_memory(problem.stage_costs(counts))
        assert peaks == pytest.approx(
            [r.peak_activation_bytes + r.param_bytes for r in sim.per_rank], rel=1e-12
        )


def test_heuristic_search_with_recompute_returns_simulated_splits():
    pl = Placement(4, 3, "wave", "uni")
    cost = gpt_like(48, seed=2).with_recompute("full", "uniform", 2)
    result = pm.partition(cost, pl, 8)
    assert not result.exact
    assert all(n % 2 == 0 for n in result.stage_layers)
    check_simulated(result, cost, pl, 8)


def test_uniform_blocks_must_divide_the_layers():
    with pytest.raises(
        ConfigError,
        match=r"recompute_num_layers 3 \(--recompute-num-layers, or the cost file's "
        r"\"recompute_num_layers\"\) does not divide the 8",
    ):
        pm.partition(gpt_like(8).with_recompute("full", "uniform", 3), ONE_F_ONE_B, 4)


def test_the_models_recompute_setting_reaches_the_partitioner():
    """`--pipeline-reuse-partition balanced` prices the model megatron runs: its
    recompute_* settings (Megatron-LM's args or a TransformerConfig) replace the file's."""
    cost = gpt_like(8)
    args = argparse.Namespace(
        recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
    )
    assert with_model_recompute(cost, args) == cost.with_recompute("full", "uniform", 1)
    off = argparse.Namespace()
    assert with_model_recompute(cost.with_recompute("selective"), off) == cost
    bad = argparse.Namespace(recompute_granularity="full")
    with pytest.raises(ConfigError, match=r"--pipeline-reuse-partition balanced: .*method"):
        with_model_recompute(cost, bad)


def test_cli_partition_takes_the_recompute_flags(tmp_path, capsys):
    from megatron_prt.cli.main import main

    path = tmp_path / "costs.json"
    path.write_text(json.dumps(gpt_like(8).to_dict()))
    argv = ["partition", "--costs", str(path), "--pp", "2", "-m", "4", "--json"]
    assert main(argv) == 0
    plain = json.loads(capsys.readouterr().out)
    flags = ["--recompute-granularity", "full", "--recompute-method", "block"]
    assert main(argv + flags + ["--recompute-num-layers", "2"]) == 0
    recomputed = json.loads(capsys.readouterr().out)
    assert recomputed["config"]["recompute_method"] == "block"
    assert recomputed["balanced"]["peak_bytes"] < plain["balanced"]["peak_bytes"]
    # a file profiled with recomputation is priced with it, unless the flag says none
    path.write_text(json.dumps(gpt_like(8).with_recompute("selective").to_dict()))
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["config"]["recompute_granularity"] == "selective"
    assert main([*argv, "--recompute-granularity", "none"]) == 0
    assert json.loads(capsys.readouterr().out)["balanced"] == plain["balanced"]


# -- through Megatron-LM's flags -------------------------------------------------------------
FULL = ("--recompute-granularity", "full", "--recompute-method", "uniform")


def test_balanced_partition_prices_the_models_recompute_flags(tmp_path):
    """`--pipeline-reuse-partition balanced` with a budget only recomputation meets."""
    from megatron_flags import BASE, parse, refusal

    from megatron_prt.megatron.args import validate_args

    path = tmp_path / "costs.json"
    path.write_text(json.dumps(gpt_like(8).to_dict()))
    balanced = (
        *BASE, "--pipeline-reuse", 1, "--pipeline-reuse-partition", "balanced",
        "--pipeline-reuse-costs", str(path), "--pipeline-reuse-memory-budget", "200",
    )  # fmt: skip
    assert "no layer partition fits the budget of 200 B" in refusal(*balanced)
    config = validate_args(parse(*balanced, *FULL, "--recompute-num-layers", 1))
    cost = gpt_like(8).with_recompute("full", "uniform", 1)
    want = pm.partition(cost, config.placement, 4, budget_bytes=200)
    assert config.stage_layers == want.stage_layers


def test_partial_uniform_blocks_are_refused_before_megatron_fails():
    """megatron's uniform method indexes past a stage's last layer otherwise."""
    from megatron_flags import BASE, refusal

    message = refusal(*BASE, "--pipeline-reuse", 2, *FULL, "--recompute-num-layers", 2)
    assert "--recompute-num-layers 2 recomputes whole blocks" in message
    assert "stages [0, 1, 2, 3] hold [1, 1, 1, 1] layers" in message


def test_tune_offers_only_splits_megatron_can_recompute():
    from megatron_prt.tune.search_plans import tune

    cost = gpt_like(12).with_recompute("full", "uniform", 2)
    result = tune(cost, 2, 4, reuse_limit=3, split_backward=False, jobs=1)
    assert result.ranked and all(cost.runs_whole_blocks(c.stage_layers) for c in result.ranked)
    assert any(c.family.placement.reuse == 3 for c in result.ranked)  # D=6: blocks of 2


def test_tune_searches_reuse_only_as_far_as_whole_blocks_go():
    """Full/uniform recomputation: stages hold whole blocks of recompute_num_layers layers.
    R was bounded by the layers (L // P), so 4 layers in blocks of 2 over P = 2 offered
    R = 2 with two stages holding no block ([2, 0, 2, 0]); now R <= blocks // P."""
    from megatron_prt.tune.search_plans import tune

    result = tune(gpt_like(4).with_recompute("full", "uniform", 2), 2, 4, split_backward=False)
    assert {c.family.placement.reuse for c in result.ranked} == {1}
    assert all(all(c.stage_layers) for c in result.ranked), [c.stage_layers for c in result.ranked]
