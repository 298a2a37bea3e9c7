"""Memory-balanced partitions of a megatron-core BERT, predicted and measured on real ranks.

A small version of the partition-memory benchmark (``megatron_prt.bench.partition_memory``,
run by ``benchmarks/partition_memory.py``: its functions, a tiny model, P=2):

* the partitioner's answer never peaks higher than the even split when the even split is
  within its time slack (its documented guarantee), on costs profiled from megatron-core;
* on two forked gloo ranks, the activation peak each rank measures during a real training
  step (megatron's DDP + Adam around PRT's forward-backward) is within 10% of the
  simulator's prediction from the profile, for uniform and balanced partitions, and the
  measured weights + gradients + Adam state match the profile's 16 bytes per parameter.

No timing assertions: profiled times only steer which partition is chosen.
"""

from __future__ import annotations

import pytest

from megatron_prt.bench import partition_memory
from megatron_prt.bench.partition_memory import cases, tables
from megatron_prt.core import Placement
from megatron_prt.tune.partition import DEFAULT_SLACK, partition

RANKS, MICROBATCHES = 2, 4
AGREEMENT = 0.10  # measured activation peak within this fraction of the prediction
STATE_AGREEMENT = 0.01  # measured state bytes within this fraction (Adam's step counters)


# Vocabulary x hidden is 2.7 layers of weights: the embedding and the head matter.
MODEL = cases.Bert(layers=8, hidden=32, heads=4, seq=32, mbs=2, vocab=1024)
PLACEMENTS = [Placement(RANKS, 2, "wave", "uni"), Placement(RANKS, 2, "loop", "bi")]


@pytest.fixture(scope="module")
def costs() -> dict:
    pytest.importorskip("megatron.core")
    partition_memory.warm_imports()
    return cases.profile(MODEL, reps=1)


@pytest.mark.parametrize("placement", PLACEMENTS, ids=str)
def test_balanced_peaks_no_higher_than_uniform(costs, placement):
    """With a slack that admits the even split, the least-peak answer is at most its peak.
    (At the default slack the partitioner may pick a faster split that peaks higher.)"""
    model = cases.cost_model(costs)
    first = partition(model, placement, MICROBATCHES)
    slack = max(DEFAULT_SLACK, first.uniform.makespan / first.fastest_makespan - 1 + 1e-9)
    result = partition(model, placement, MICROBATCHES, slack=slack)
    balanced = cases.Config("balanced", placement, result.stage_layers)
    uniform = cases.uniform_config(placement, MODEL.layers)
    peak = cases.predict(costs, balanced, MICROBATCHES).max_total
    assert peak <= cases.predict(costs, uniform, MICROBATCHES).max_total * (1 + 1e-12)
    assert result.exact  # a small case: every partition was simulated


def test_measured_peaks_match_predictions(costs):
    configs = [cases.uniform_config(Placement(RANKS, 1, "loop", "uni"), MODEL.layers)]
    for placement in PLACEMENTS:
        configs.append(cases.uniform_config(placement, MODEL.layers))
        configs.append(cases.balanced_config(costs, placement, MICROBATCHES))
    measured = cases.measure(MODEL, configs, MICROBATCHES)
    for config, ranks in zip(configs, measured, strict=True):
        pred = cases.predict(costs, config, MICROBATCHES)
        for rank, m in enumerate(ranks):
            where = (config.label, config.stage_layers, rank)
            assert m.act_held_after == 0, where  # every backward released its activations
            assert m.act_peak == pytest.approx(pred.act[rank], rel=AGREEMENT), where
            assert m.state == pytest.approx(pred.state[rank], rel=STATE_AGREEMENT), where


def test_inflight_counts_by_hand():
    """Stage s of D keeps min(m, D - s) micro-batches, each through 1/D of the model."""
    assert tables.inflight(4, 4) == (4 + 3 + 2 + 1) / 4
    assert tables.inflight(8, 4) == (4 * 5 + 3 + 2 + 1) / 8
    assert tables.inflight(8, 16) == sum(range(1, 9)) / 8


def test_picks_are_held_against_their_own_direction(costs):
    """Each wave + balanced pick meets the throughput target against the best uniform PRT
    of its direction, or is the fastest candidate of that direction (target unreachable)."""
    case = cases.make_case(costs, RANKS, MICROBATCHES)
    assert {d: cp[0].placement.direction for d, cp in case.best.items()} == {
        "uni": "uni",
        "bi": "bi",
    }
    assert case.best_uniform in case.best.values()
    for direction, pick in case.picks.items():
        config, pred = pick.balanced
        assert config.placement.direction == direction
        mine = [cp for cp in case.wave_candidates if cp[0].placement.direction == direction]
        if case.best_makespan(direction) / pred.makespan < cases.THROUGHPUT_TARGET:
            assert pred.makespan == min(cp[1].makespan for cp in mine)
