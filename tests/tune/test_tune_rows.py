"""The tuned plan is never slower than the paper-scale table's other rows: 1F1B on the even
and the balanced split, megatron interleaved, Chimera-style bi, PRT loop/wave x uni/bi,
split backward, and torch's own orders (ZB1P, ZBV, DualPipeV), all simulated under the same
costs. Rows outside the tuner's own search (torch's orders) reach it as seeds."""

from __future__ import annotations

from dataclasses import replace

import pytest
from tune_costs import cost_dict

from megatron_prt.core.layers import even_layers
from megatron_prt.core.placement import ConfigError, Placement
from megatron_prt.core.schedules import build_plan
from megatron_prt.sim.cost import CostModel, LayerCost
from megatron_prt.sim.simulate import simulate
from megatron_prt.tune.partition import partition
from megatron_prt.tune.search_plans import Seed, add_seeds, tune

P, M, LAYERS = 4, 8, 8  # R up to 2: every row kind exists, the search stays short


@pytest.fixture(scope="module")
def cost() -> CostModel:
    return replace(CostModel.from_dict(cost_dict(LAYERS)), wgrad_fraction=0.5)


def table_rows(cost: CostModel) -> dict[str, Seed]:
    """Every row kind of the paper-scale split-backward table for P, M, LAYERS."""
    rows = {}

    def add(label: str, placement: Placement, schedule: str, counts=None) -> None:
        counts = counts or even_layers(LAYERS, placement.depth)
        priced = replace(cost, stage_layers=counts)
        times = priced.stage_times(placement) if schedule in ("prt", "zb") else None
        plan = build_plan(placement, M, schedule, times)  # as the paper-scale rows build it
        rows[label] = Seed(label, plan, tuple(counts))

    one = Placement(P, 1)
    add("1F1B even", one, "1f1b")
    add("1F1B balanced", one, "1f1b", partition(cost, one, M, schedule="1f1b").stage_layers)
    add("interleaved R=2", Placement(P, 2), "interleaved")
    add("Chimera-style bi", Placement(P, 1, "loop", "bi"), "prt")
    for where in ("loop", "wave"):
        for direction in ("uni", "bi"):
            add(f"PRT R=2 {where}/{direction}", Placement(P, 2, where, direction), "prt")
    add("ZB-H1", one, "zb")
    add("ZB R=2 wave/bi", Placement(P, 2, "wave", "bi"), "zb")
    from megatron_prt.runtime.peers import PEERS, peer_placement, peer_plan

    for peer in PEERS:
        try:
            plan = peer_plan(peer, P, M, 2)
        except ConfigError:  # torch refuses this configuration
            continue
        depth = peer_placement(peer, P, 2).depth
        rows[peer.label] = Seed(peer.label, plan, even_layers(LAYERS, depth))
    return rows


@pytest.fixture(scope="module")
def rows(cost):
    pytest.importorskip("torch")
    return table_rows(cost)


def makespan(seed: Seed, cost: CostModel) -> float:
    return simulate(seed.plan, replace(cost, stage_layers=seed.stage_layers)).makespan


def test_tuned_is_never_slower_than_a_row(cost, rows):
    assert {"torch ZB1P", "torch ZBV"} <= set(rows)  # torch's zero-bubble orders are rows
    result = tune(cost, P, M, seeds=list(rows.values()))
    for label, seed in rows.items():
        assert result.winner.makespan <= makespan(seed, cost) * (1 + 1e-9), label


def test_the_search_alone_beats_every_row_in_its_space(cost, rows):
    """Every row but torch's is in the tuner's search space: its own pick beats them."""
    searched = tune(cost, P, M).winner
    for label, seed in rows.items():
        if not label.startswith("torch"):
            assert searched.makespan <= makespan(seed, cost) * (1 + 1e-9), label


def test_a_faster_seed_wins(cost):
    """A search without R=2 and split backward, shown the full search's pick as a seed:
    the seed wins."""
    best = tune(cost, P, M).winner
    short = tune(cost, P, M, reuse_limit=1, split_backward=False)
    seed = Seed("full search", best.plan, best.stage_layers)
    assert makespan(seed, cost) < short.winner.makespan
    seeded = add_seeds(short, lambda pl, counts: replace(cost, stage_layers=counts), [seed])
    assert seeded.winner.label == "full search" and seeded.winner.planned_for == "seed"
    assert seeded.winner.makespan == pytest.approx(makespan(seed, cost))
    again = tune(cost, P, M, reuse_limit=1, split_backward=False, seeds=[seed])
    assert again.winner.plan == seed.plan


def test_price_scores_each_placement_and_split_under_its_own_costs(cost):
    """A pricing that makes bi's messages slow: every bi candidate is scored under it."""

    def price(placement: Placement, counts) -> CostModel:
        slow = placement.direction == "bi"
        return replace(cost, stage_layers=tuple(counts), p2p_latency=100.0 if slow else 0.05)

    result = tune(cost, P, M, reuse_limit=1, price=price)
    for c in result.ranked:
        expected = simulate(c.plan, price(c.family.placement, c.stage_layers)).makespan
        assert c.makespan == pytest.approx(expected)
    assert result.winner.family.placement.direction == "uni"


def test_a_seed_of_the_wrong_depth_is_refused(cost):
    plan = build_plan(Placement(P, 1), M, "1f1b")
    with pytest.raises(ConfigError, match="seed 'x': 3 stage layer counts for 4 model stages"):
        tune(cost, P, M, reuse_limit=1, seeds=[Seed("x", plan, (3, 3, 2))])


def test_split_backward_plans_capped_by_count_compete():
    """Large early activations (a ResNet's): the split-backward planner's own plan, its cap
    counted in micro-batches, can beat the one capped in bytes. The winner is at least as
    fast as that plan for every split-backward family and split the tuner tried."""
    layers = tuple(LayerCost(1.0, 2.0, act=1e7 if i < 2 else 1e6, param=1e6) for i in range(LAYERS))
    cost = CostModel(layers=layers, p2p_latency=0.05, wgrad_fraction=0.5)
    result = tune(cost, P, M, reuse_limit=2)
    tried = 0
    for c in result.ranked:
        if c.family.schedule in ("zb", "zb-h2"):
            priced = replace(cost, stage_layers=c.stage_layers)
            times = priced.stage_times(c.family.placement)
            plan = build_plan(c.family.placement, M, c.family.schedule, times)
            assert result.winner.makespan <= simulate(plan, priced).makespan * (1 + 1e-9)
            tried += 1
    assert tried
