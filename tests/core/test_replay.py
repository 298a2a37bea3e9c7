"""The replay engine (core/replay.py) against hand-computed timelines, and the memory rule
(sim/simulate.py held_activations) against hand-counted peaks."""

import pytest

from megatron_prt.core import Action, Op, Placement, Plan, StageTimes, build_plan
from megatron_prt.core.replay import PlanError, Replayer, replay
from megatron_prt.sim.cost import CostModel
from megatron_prt.sim.simulate import held_activations, simulate


def F(stage, mb):  # noqa: N802
    return Action(stage, Op.F, mb)


def B(stage, mb):  # noqa: N802
    return Action(stage, Op.B, mb)


@pytest.fixture
def plan():
    """1F1B on two ranks, two micro-batches: rank 0 runs F0 F1 B0 B1, rank 1 F0 B0 F1 B1."""
    plan = build_plan(Placement(2), 2, "1f1b")
    assert plan.ranks == (
        (F(0, 0), F(0, 1), B(0, 0), B(0, 1)),
        (F(1, 0), B(1, 0), F(1, 1), B(1, 1)),
    )
    return plan


# (start, end) per action, worked out by hand: forward 1, backward 2 per stage
FREE_HOPS = {
    F(0, 0): (0, 1),
    F(0, 1): (1, 2),
    F(1, 0): (1, 2),  # waits for F(0, 0)
    B(1, 0): (2, 4),
    F(1, 1): (4, 5),  # its input was ready at 2; rank 1 was busy until 4
    B(1, 1): (5, 7),
    B(0, 0): (4, 6),  # waits for B(1, 0)'s gradient
    B(0, 1): (7, 9),  # waits for B(1, 1)'s gradient
}
# the same with 0.5 per cross-rank hop
HOPS = {
    F(0, 0): (0, 1),
    F(0, 1): (1, 2),
    F(1, 0): (1.5, 2.5),
    B(1, 0): (2.5, 4.5),
    F(1, 1): (4.5, 5.5),
    B(1, 1): (5.5, 7.5),
    B(0, 0): (5, 7),
    B(0, 1): (8, 10),
}


def check(timeline, expected):
    """``timeline`` has exactly ``expected``'s actions at its (start, end) times."""
    assert set(timeline.start) == set(expected)
    got = [(timeline.start[a], timeline.end[a]) for a in expected]
    assert got == [pytest.approx(pair) for pair in expected.values()]


def test_replay_matches_hand_computed_times(plan):
    timeline = replay(plan, StageTimes.uniform(2))
    check(timeline, FREE_HOPS)
    assert timeline.makespan == pytest.approx(9)


def test_one_compiled_replayer_serves_many_stage_times(plan):
    replayer = Replayer(plan)
    with_hops = replayer.run(StageTimes.uniform(2, p2p=0.5))
    check(with_hops, HOPS)
    assert with_hops.makespan == pytest.approx(10)
    check(replayer.run(StageTimes.uniform(2)), FREE_HOPS)  # nothing carried over
    ticks = replayer.run_ticks(StageTimes.uniform(2, p2p=0.5))
    assert ticks.makespan == with_hops.makespan
    assert ticks.hop * ticks.tick == pytest.approx(0.5)


def test_unequal_stages_and_message_cpu_time():
    plan = build_plan(Placement(2), 1, "1f1b")  # F0 | F1 B1 | B0
    times = StageTimes((1.0, 3.0), (2.0, 4.0), p2p=0.5, p2p_cpu=0.25)
    # every action sends or receives one message: +0.25 each
    expected = {
        F(0, 0): (0, 1.25),
        F(1, 0): (1.75, 5.0),
        B(1, 0): (5.0, 9.25),
        B(0, 0): (9.75, 12.0),
    }
    check(replay(plan, times), expected)


def test_a_cyclic_wait_is_a_deadlock_naming_rank_step_and_action(plan):
    bad = Plan(plan.placement, 2, (plan.ranks[0], tuple(reversed(plan.ranks[1]))))
    with pytest.raises(PlanError, match="plan deadlocks") as err:
        Replayer(bad)
    text = str(err.value)
    assert "rank 1, step 0: 1B1 (stage 1, mb 1) waits on" in text
    assert "this rank runs later (step 1)" in text
    assert "rank 0, step 2: 0B0" in text  # rank 0 ran its two forwards, then waits


def test_a_producer_no_rank_runs_is_named():
    plan = build_plan(Placement(2), 1, "1f1b")
    bad = Plan(plan.placement, 1, (plan.ranks[0][1:], plan.ranks[1]))  # no F(0, 0)
    with pytest.raises(PlanError, match="0F0, which no rank runs"):
        replay(bad)


def test_memory_rule_holds_from_forward_start_to_backward_end(plan):
    timeline = replay(plan, StageTimes.uniform(2))
    rank0 = plan.compute_actions(0)
    changes = held_activations(rank0, timeline)
    assert changes == [(F(0, 0), 1), (F(0, 1), 1), (B(0, 0), -1), (B(0, 1), -1)]
    assert held_activations(rank0) == changes  # plan order: the same on one rank
    cost = CostModel(activation_bytes=10.0)  # 5 bytes per stage
    stats = simulate(plan, cost).per_rank
    assert [s.peak_inflight for s in stats] == [2, 1]
    assert [s.peak_activation_bytes for s in stats] == [10.0, 5.0]


def test_memory_rule_frees_before_it_allocates_at_one_instant():
    # a zero-time backward ending when the next forward starts: the free comes first
    placement = Placement(1)
    plan = Plan(placement, 2, ((F(0, 0), B(0, 0), F(0, 1), B(0, 1)),))
    timeline = replay(plan, StageTimes((1.0,), (0.0,)))
    assert timeline.end[B(0, 0)] == timeline.start[F(0, 1)] == 1
    assert simulate(plan, CostModel(fwd_time=1.0, bwd_time=0.0)).per_rank[0].peak_inflight == 1
