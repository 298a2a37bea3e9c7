"""A hop per cut: messages of different sizes between stages (ResNet's early layers send 8x
what its late ones do) cost each cut its own hop, in the replay, the list scheduler, the
zero-bubble scheduler, the posting walk and the tuner's critical path alike."""

import itertools
import random
from dataclasses import replace

import pytest

from megatron_prt.core import Placement
from megatron_prt.core.actions import Action, Op
from megatron_prt.core.replay import Replayer, compiled, replay
from megatron_prt.core.schedules import build_plan, prt
from megatron_prt.core.timing import StageTimes
from megatron_prt.core.zerobubble import zero_bubble
from megatron_prt.sim.cost import CostModel, LayerCost
from megatron_prt.sim.posting import compute_makespan
from megatron_prt.sim.simulate import simulate
from megatron_prt.tune.evaluate import critical_path

F = lambda s, mb: Action(s, Op.F, mb)  # noqa: E731
B = lambda s, mb: Action(s, Op.B, mb)  # noqa: E731


def test_each_cut_adds_its_own_hop():
    """1F1B over 3 ranks, one micro-batch, unit forwards and 2-unit backwards; cut 0 costs
    0.5, cut 1 costs 2 (a scalar hop would give both the same)."""
    plan = build_plan(Placement(3), 1, "1f1b")
    timeline = replay(plan, StageTimes((1,) * 3, (2,) * 3, (0.5, 2.0)))
    expected = {
        F(0, 0): (0, 1),
        F(1, 0): (1.5, 2.5),
        F(2, 0): (4.5, 5.5),
        B(2, 0): (5.5, 7.5),
        B(1, 0): (9.5, 11.5),
        B(0, 0): (12.0, 14.0),
    }
    assert {a: (timeline.start[a], timeline.end[a]) for a in expected} == expected


def test_per_cut_hops_are_checked_and_equal_ones_are_one_number():
    assert StageTimes((1, 1, 1), (2, 2, 2), (0.3, 0.3)).p2p == 0.3
    assert StageTimes((1,), (2,), ()).p2p == 0.0
    with pytest.raises(ValueError, match="must give 2 hop times"):
        StageTimes((1, 1, 1), (2, 2, 2), (0.3,))
    with pytest.raises(ValueError, match=">= 0"):
        StageTimes((1, 1, 1), (2, 2, 2), (0.3, -1.0))
    ticks, tick = StageTimes((1, 1, 1), (2, 2, 2), (0.5, 0.25)).in_ticks()
    assert ticks.p2p == (round(0.5 / tick), round(0.25 / tick))


def _cost(depth: int, rng: random.Random) -> CostModel:
    """Unequal layers (two per stage) sending unequal messages over a slow link."""
    layers = tuple(
        LayerCost(rng.uniform(0.5, 1.5), rng.uniform(1.0, 3.0), out_bytes=rng.choice((1, 4, 16)))
        for _ in range(2 * depth)
    )
    return CostModel(layers=layers, p2p_latency=0.05, p2p_bandwidth=8.0)


PLACEMENTS = [
    Placement(2, 2, "loop"),
    Placement(2, 2, "wave"),
    Placement(3, 2, "wave", "bi"),
    Placement(2, 3, "loop", "bi"),
    Placement(4, 1),
]


@pytest.mark.parametrize("placement", PLACEMENTS, ids=str)
def test_every_walk_prices_a_plan_alike(placement):
    """The replay (its per-cut path), the posting walk (its own loop over the dependency
    rule), the list scheduler's own timeline and the zero-bubble scheduler's judge agree on
    plans made for per-cut hops."""
    rng = random.Random(placement.depth * 7 + placement.num_pipelines)
    cost = _cost(placement.depth, rng)
    times = cost.stage_times(placement)
    assert times.per_cut
    for m in (2, 5):
        plan = prt(placement, m, times)
        fresh = Replayer(plan).run_ticks(times)
        assert compiled(plan).run_ticks(times).end == fresh.end  # the scheduler's own ends
        makespan = replay(plan, times).makespan
        assert compute_makespan(plan, cost) == pytest.approx(makespan, rel=1e-4)
        split = zero_bubble(placement, m, times)
        assert compute_makespan(split, cost) == pytest.approx(
            replay(split, times).makespan, rel=1e-4
        )
        assert simulate(plan, cost).makespan >= makespan - 1e-9


def test_the_mean_hop_misprices_what_the_cuts_cost():
    """The same plan under the cuts' own hops and under their mean: a big cut on the
    critical path costs more than the mean says (the old pricing of unequal cuts)."""
    placement = Placement(2, 1)
    layers = (LayerCost(1.0, 2.0, out_bytes=64.0), LayerCost(1.0, 2.0, out_bytes=64.0))
    cost = CostModel(layers=layers, p2p_bandwidth=8.0, message_bytes=8.0)
    plan = build_plan(placement, 4, "1f1b")
    assert simulate(plan, cost).makespan == pytest.approx(
        replay(plan, cost.stage_times(placement)).makespan
    )
    mean = CostModel(
        layers=tuple(LayerCost(1.0, 2.0) for _ in range(2)), p2p_bandwidth=8.0, message_bytes=8.0
    )
    assert simulate(plan, cost).makespan > simulate(plan, mean).makespan + 2 * 7.0


def test_the_critical_path_walks_back_over_per_cut_hops():
    """From the last action to the first, through hops of different lengths: every forward
    and backward of a lone micro-batch is on it."""
    plan = build_plan(Placement(3), 1, "1f1b")
    replayer = compiled(plan)
    ticks = replayer.run_ticks(StageTimes((1,) * 3, (2,) * 3, (0.5, 2.0)))
    fwd, bwd, hops = critical_path(replayer, ticks)
    assert (fwd, bwd, hops) == ([1, 1, 1], [1, 1, 1], [2, 2])


def test_cut_messages_come_from_the_layer_before_each_cut():
    layers = tuple(LayerCost(1.0, 2.0, out_bytes=b) for b in (10.0, 20.0, 30.0, 40.0))
    embedding = LayerCost(0.1, 0.1, out_bytes=5.0)
    cost = CostModel(layers=layers, embedding=embedding, message_bytes=1.0)
    assert cost.cut_message_bytes((1, 0, 2, 1)) == (10.0, 10.0, 30.0)
    assert cost.cut_message_bytes((0, 4)) == (5.0,)
    unsized = CostModel(layers=(LayerCost(1.0, 2.0),) * 2, message_bytes=3.0)
    assert unsized.cut_message_bytes((1, 1)) == (3.0,)
    assert not unsized.stage_times(Placement(2)).per_cut  # every cut sends message_bytes
    # an empty middle stage holds the message it passes on
    assert cost.stage_input_act(1, (1, 0, 2, 1), 4) == 10.0


@pytest.mark.parametrize(
    "placement, m", list(itertools.product([Placement(2, 2, "wave"), Placement(2, 2, "loop")], [4]))
)
def test_equal_cuts_plan_as_before(placement, m):
    """Per-cut hops that are all alike are one number: the same plan as the scalar."""
    depth = placement.depth
    scalar = StageTimes((1.0,) * depth, (2.0,) * depth, 0.3)
    per_cut = StageTimes((1.0,) * depth, (2.0,) * depth, (0.3,) * (depth - 1))
    assert prt(placement, m, per_cut).ranks == prt(placement, m, scalar).ranks


def test_the_simulated_message_bytes_are_each_cuts_own():
    """4 micro-batches over 3 ranks: each crosses both cuts forward and back."""
    layers = tuple(LayerCost(1.0, 2.0, out_bytes=b) for b in (3.0, 5.0, 7.0))
    result = simulate(build_plan(Placement(3), 4), CostModel(layers=layers, message_bytes=1.0))
    assert (result.p2p_messages, result.p2p_bytes) == (16, 4 * 2 * (3.0 + 5.0))


def test_a_folded_recompute_block_sends_its_last_layers_message():
    layers = tuple(LayerCost(1.0, 2.0, act=8.0, out_bytes=b) for b in (1.0, 2.0, 3.0, 4.0))
    cost = CostModel(layers=layers, message_bytes=1.0).with_recompute("full", "uniform", 2)
    folded, unit = cost.folded_recompute()
    assert unit == 2
    assert [layer.out_bytes for layer in folded.layers] == [2.0, 4.0]


def test_the_partitioner_cuts_where_the_message_is_small():
    """Four equal layers on two ranks: the even split cuts after a layer whose output is
    64x the others'; priced per cut, the fastest split cuts elsewhere, and with equal
    messages it is the even split."""
    from megatron_prt.tune.partition import partition

    def cost(big: float) -> CostModel:
        sizes = (1.0, big, 1.0, 1.0)
        layers = tuple(LayerCost(1.0, 2.0, out_bytes=size) for size in sizes)
        return CostModel(layers=layers, p2p_bandwidth=1.0)

    placement = Placement(2)
    assert partition(cost(1.0), placement, 4, slack=0.0).balanced.stage_layers == (2, 2)
    skewed = partition(cost(64.0), placement, 4, slack=0.0).balanced
    assert skewed.stage_layers != (2, 2)
    even = simulate(build_plan(placement, 4), replace(cost(64.0), stage_layers=(2, 2)))
    assert skewed.makespan < even.makespan


def test_a_recomputed_layer_keeps_its_own_input():
    """Full recomputation keeps a layer's (a block's) input: the out_bytes of the entry
    before it, not message_bytes (the old pricing kept 16 bytes per layer here)."""
    sizes = (64.0, 64.0, 32.0, 32.0)
    layers = tuple(LayerCost(1.0, 2.0, act=100.0, out_bytes=b) for b in sizes)
    embedding = LayerCost(0.0, 0.0, out_bytes=128.0)
    cost = CostModel(layers=layers, embedding=embedding, message_bytes=16.0)
    kept = cost.with_recompute("full", "uniform", 1).layer_act_bwd((2, 2))
    assert [act for act, _ in kept] == [128.0, 64.0, 64.0, 32.0]
    folded, _ = cost.with_recompute("full", "uniform", 2).folded_recompute()
    assert [layer.act for layer in folded.layers] == [128.0, 64.0]
    # every input known: no message_bytes needed to size what a block keeps
    replace(cost, message_bytes=0.0).with_recompute("full", "uniform", 1)


def test_a_model_without_layers_counts_the_bytes_its_hops_price():
    cost = CostModel(embedding=LayerCost(0.1, 0.1, out_bytes=8.0), message_bytes=1.0)
    result = simulate(build_plan(Placement(2), 2), cost)
    assert (result.p2p_messages, result.p2p_bytes) == (4, 32.0)


def test_a_learnt_critical_path_bounds_every_split_under_per_cut_hops():
    """The partitioner's surrogate (a critical path as a function of stage and hop times)
    stays at most the makespan of every other split: it kept the hops of the split it was
    learnt on (286 at (2, 2), whose cut sends 64x), and valued (3, 1), 38, at 283."""
    from megatron_prt.tune.evaluate import Pool
    from megatron_prt.tune.problem import Problem

    sizes = (1.0, 64.0, 1.0, 1.0)
    layers = tuple(LayerCost(1.0, 2.0, out_bytes=size) for size in sizes)
    cost = CostModel(layers=layers, p2p_bandwidth=1.0)
    problem = Problem(cost, build_plan(Placement(2), 4))
    pool = Pool(problem)
    pool.add((2, 2))
    (learnt,) = pool.cuts
    for counts in ((1, 3), (3, 1), (2, 2)):
        makespan = simulate(problem.plan, replace(cost, stage_layers=counts)).makespan
        assert learnt.value(problem.stage_costs(counts)) <= makespan + 1e-6
    assert learnt.value(problem.stage_costs((2, 2))) == pytest.approx(pool.points[(2, 2)].makespan)


@pytest.mark.parametrize("placement", [Placement(2, 2), Placement(2, 2, "wave", "bi")], ids=str)
def test_the_move_screening_prices_the_shifted_cuts_messages(placement):
    """The partitioner screens a one-layer move by the known critical paths' value after it
    (State._cut_max); with equal layers it equals those paths valued on the moved split,
    whose shifted cuts send other messages (before: the moved stages' times only, the
    moves across a cut whose message changes priced at the old hops)."""
    from megatron_prt.tune.evaluate import Pool
    from megatron_prt.tune.problem import Problem
    from megatron_prt.tune.state import State

    rng = random.Random(5)  # equal layers: only the messages tell the splits apart
    layers = tuple(
        LayerCost(1.0, 2.0, out_bytes=rng.choice((1.0, 8.0, 64.0, 128.0))) for _ in range(8)
    )
    cost = CostModel(layers=layers, p2p_bandwidth=16.0)
    problem = Problem(cost, build_plan(placement, 4))
    pool = Pool(problem)
    for counts in ((2, 2, 2, 2), (3, 1, 2, 2), (2, 2, 1, 3)):
        pool.add(counts)
    state = State(problem, pool.cuts, (2, 2, 2, 2))
    for donor, receiver in itertools.permutations(range(4), 2):
        lost, gained = state._moved_layers(donor, receiver)
        screened = state._cut_max(
            donor, receiver, problem.layer_costs[lost], problem.layer_costs[gained]
        )
        moved = state.moved(donor, receiver, pool.cuts)
        assert screened == pytest.approx(max(moved.cut_values)), (donor, receiver)
