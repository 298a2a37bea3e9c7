"""The layer split (core/layers.py): even split, explicit counts, and its users agree."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from megatron_prt.core.layers import check_stage_layers, even_layers, stage_layer_counts
from megatron_prt.core.placement import ConfigError, Placement
from megatron_prt.megatron.config import ReuseConfig
from megatron_prt.sim.cost import CostModel, LayerCost


def test_even_split_examples():
    assert even_layers(10, 4) == (3, 3, 2, 2)  # earlier stages take the remainder
    assert even_layers(8, 4) == (2, 2, 2, 2)
    assert even_layers(3, 5) == (1, 1, 1, 0, 0)
    assert even_layers(0, 2) == (0, 0)


@given(st.integers(0, 200), st.integers(1, 40))
def test_even_split_properties(num_layers, depth):
    counts = even_layers(num_layers, depth)
    assert len(counts) == depth and sum(counts) == num_layers
    assert max(counts) - min(counts) <= 1
    assert list(counts) == sorted(counts, reverse=True)


def test_explicit_counts_pass_through():
    assert check_stage_layers([5, 0, 4, 3], 12, 4) == (5, 0, 4, 3)
    assert check_stage_layers((1, 2), 3) == (1, 2)  # any length without a depth


@pytest.mark.parametrize(
    "counts, match",
    [
        ((2, 2, 2), r"stage_layers 2,2,2 must give D = R\*P = 4 counts .*got 3 counts"),
        ((2, 2, 2, 1), r"sum to the 8 layers \(got 4 counts summing to 7\)"),
        ((-1, 3, 3, 3), "counts >= 0"),
        ((2.0, 2, 2, 2), "counts >= 0"),
        ((True, 3, 3, 1), "counts >= 0"),
    ],
)
def test_bad_counts_name_the_values_and_the_fix(counts, match):
    with pytest.raises(ConfigError, match=match) as err:
        check_stage_layers(counts, 8, 4)
    assert "fix the counts or the layers" in str(err.value)


def test_even_split_must_fill_every_stage_where_asked():
    assert stage_layer_counts(10, 4) == (3, 3, 2, 2)
    assert stage_layer_counts(10, 4, (1, 2, 3, 4)) == (1, 2, 3, 4)
    with pytest.raises(ConfigError, match=r"3 layers cannot fill D = R\*P = 4 stages; lower"):
        stage_layer_counts(3, 4, fix="lower it")


@pytest.mark.parametrize("num_layers, depth", [(8, 4), (10, 4), (7, 2), (13, 6)])
def test_runtime_cost_model_and_megatron_agree(num_layers, depth):
    from megatron_prt.runtime.stages import layer_ranges  # torch: only here

    expected = even_layers(num_layers, depth)
    assert tuple(count for _, count in layer_ranges(num_layers, depth)) == expected
    cost = CostModel(layers=(LayerCost(1, 2),) * num_layers)
    assert cost.layer_counts(depth) == expected
    config = ReuseConfig(
        Placement(depth // 2, 2) if depth % 2 == 0 else Placement(depth), num_layers
    )
    assert config.layers_per_stage() == expected


def test_cost_model_checks_its_counts_against_the_depth():
    cost = CostModel(layers=(LayerCost(1, 2),) * 4, stage_layers=(2, 2))
    assert cost.layer_counts(2) == (2, 2)
    with pytest.raises(ConfigError, match=r"D = R\*P = 4 counts"):
        cost.layer_counts(4)
    with pytest.raises(ConfigError, match=r"stage_layers 3,2 .*summing to 5"):
        CostModel(layers=(LayerCost(1, 2),) * 4, stage_layers=(3, 2))
