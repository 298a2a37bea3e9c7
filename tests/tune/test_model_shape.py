"""The model shape a cost file was measured on travels with it: ``profile`` records it
(``model``), ``tune`` copies it into the plan file and prints it, ``simulate --plan`` says
when the costs it is given are of another shape (sim/model_shape.py)."""

from __future__ import annotations

import json

import pytest
from tune_costs import cost_dict

from megatron_prt.core.placement import ConfigError
from megatron_prt.sim.cost import CostModel
from megatron_prt.sim.model_shape import describe_shape, shape_differences
from megatron_prt.tune.plan_file import load_plan

SHAPE = {"model": "gpt", "hidden_size": 64, "seq_length": 32, "micro_batch_size": 2}
CLI = ("--pp", 2, "-m", 4, "--max-reuse", 2)


def _costs(tmp_path, name: str, shape) -> str:
    path = tmp_path / name
    path.write_text(json.dumps({**cost_dict(6), "model": shape}))
    return str(path)


def test_cost_files_keep_the_shape_without_pricing_it(tmp_path):
    cost = CostModel.load(_costs(tmp_path, "c.json", SHAPE))
    assert cost.model == SHAPE
    assert CostModel.from_dict(cost.to_dict()).model == SHAPE
    assert cost == CostModel.load(_costs(tmp_path, "d.json", None))  # not a cost: equal


@pytest.mark.parametrize(
    "shape, match",
    [
        ([64], r"key model must be a JSON dict"),
        ({"hidden": 64}, r"unknown keys \['hidden'\] in model"),
        ({"hidden_size": 0}, r"model.hidden_size must be a positive integer"),
        ({"hidden_size": True}, r"model.hidden_size must be a positive integer"),
        ({"dtype": 16}, r"model.dtype must be a string"),
        ({"swiglu": 1}, r"model.swiglu must be true or false"),
        ({"hidden_dropout": 1.0}, r"model.hidden_dropout must be a probability in \[0, 1\)"),
        ({"attention_dropout": "0.1"}, r"model.attention_dropout must be a probability"),
    ],
)
def test_malformed_shapes_are_refused_by_key(tmp_path, shape, match):
    with pytest.raises(ConfigError, match=match):
        CostModel.load(_costs(tmp_path, "c.json", shape))


def test_differences_are_the_keys_both_sides_give():
    running = {"hidden_size": 128, "seq_length": 32, "micro_batch_size": None, "dtype": "x"}
    assert shape_differences(SHAPE, running) == ["hidden_size 64 -> 128"]
    assert shape_differences(None, running) == [] and shape_differences(SHAPE, None) == []
    assert describe_shape(SHAPE) == "gpt, hidden_size 64, seq_length 32, micro_batch_size 2"


def test_tune_records_and_prints_the_shape_and_simulate_compares_it(tmp_path, run_cli):
    """A plan file did not say which model it was tuned for, and simulate --plan priced it
    with the costs of another model without a word."""
    costs, out = _costs(tmp_path, "c.json", SHAPE), tmp_path / "plan.json"
    code, text, err = run_cli("tune", "--costs", costs, *CLI, "-o", out)
    assert code == 0, err
    assert "model: gpt, hidden_size 64, seq_length 32, micro_batch_size 2" in text
    assert load_plan(str(out)).model == SHAPE
    code, _, err = run_cli("simulate", "--plan", out, "--costs", costs)
    assert code == 0 and "another model shape" not in err, err
    other = _costs(tmp_path, "other.json", {**SHAPE, "seq_length": 512})
    code, _, err = run_cli("simulate", "--plan", out, "--costs", other)
    assert code == 0, err
    assert "tuned on costs of another model shape (seq_length 32 -> 512, plan -> costs)" in err
    assert f"simulated with --costs {other} as given" in err
    code, text, err = run_cli("tune", "--costs", costs, *CLI, "--json")
    assert code == 0 and json.loads(text)["config"]["model"] == SHAPE, err
