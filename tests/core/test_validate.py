"""Failure paths: invalid plans are refused with rank, step, action and the grid."""

import pytest

from megatron_prt.core import Action, Op, Placement, Plan, build_plan
from megatron_prt.core.lower import lower
from megatron_prt.core.replay import PlanError
from megatron_prt.core.validate import validate


def _with_rank(plan, rank, actions, **kw):
    ranks = list(plan.ranks)
    ranks[rank] = tuple(actions)
    return Plan(
        plan.placement,
        plan.num_microbatches,
        tuple(ranks),
        plan.schedule,
        plan.mb_pipeline,
        kw.get("lowered", plan.lowered),
    )


@pytest.fixture
def plan():
    return build_plan(Placement(2, 1), 2, "1f1b")


def test_missing_action(plan):
    bad = _with_rank(plan, 1, plan.ranks[1][:-1])
    with pytest.raises(PlanError, match=r"rank 1: 1B1 \(stage 1, mb 1\) is missing"):
        validate(bad)


def test_duplicate_action(plan):
    bad = _with_rank(plan, 0, (*plan.ranks[0], Action(0, Op.F, 0)))
    with pytest.raises(PlanError, match="runs 2 times, expected once"):
        validate(bad)


def test_wrong_rank(plan):
    bad = _with_rank(plan, 0, (Action(1, Op.F, 0), *plan.ranks[0][1:]))
    with pytest.raises(PlanError, match="stage 1 lives on rank 1") as err:
        validate(bad)
    assert "[1F0]" in str(err.value)  # the grid marks the failing step


def test_dependency_order_violation_shows_grid(plan):
    bad = _with_rank(plan, 1, tuple(reversed(plan.ranks[1])))
    with pytest.raises(PlanError, match="deadlocks") as err:
        validate(bad)
    text = str(err.value)
    assert "rank 1, step 0: 1B1" in text and "this rank runs later" in text
    assert "rank |" in text and "[1B1]" in text


def test_cross_rank_cycle_is_a_deadlock():
    plan = build_plan(Placement(2, 2), 2)
    # rank 0 waits for mb 1's backward before running mb 1's forward: a cyclic wait
    acts = [a for a in plan.ranks[0] if a != Action(0, Op.F, 1)] + [Action(0, Op.F, 1)]
    with pytest.raises(PlanError, match="deadlocks"):
        validate(_with_rank(plan, 0, acts))


def test_wrong_pipeline_for_micro_batch():
    plan = build_plan(Placement(2, 1, "loop", "bi"), 2)
    bad = Plan(plan.placement, 2, plan.ranks, mb_pipeline=(1, 0))
    with pytest.raises(PlanError, match="runs on pipeline"):
        validate(bad)


def test_lowered_plan_that_deadlocks_under_blocking_p2p():
    plan = lower(build_plan(Placement(2, 1), 2, "1f1b"))
    # Move rank 1's RECV of mb 1's activation after its SEND of mb 0's gradient: both
    # ranks then SEND at once (rank 0 -> F1, rank 1 -> B0) and block forever.
    r1 = list(plan.ranks[1])
    recv = Action(1, Op.RECV_F, 1)
    send = Action(1, Op.SEND_B, 0)
    r1.remove(recv)
    r1.insert(r1.index(send) + 1, recv)
    bad = _with_rank(plan, 1, r1, lowered=True)
    validate(bad.compute_only())  # the compute order alone is fine
    with pytest.raises(PlanError, match="deadlocks under blocking send/recv"):
        validate(bad)


def test_comm_in_unlowered_plan_is_refused(plan):
    bad = _with_rank(plan, 0, (Action(0, Op.SEND_F, 0), *plan.ranks[0]))
    with pytest.raises(PlanError, match="not marked lowered"):
        validate(bad)


def test_send_on_the_wrong_rank_is_refused():
    """A SEND names the stage whose tensor it sends: it runs on that stage's rank (the
    blocking replay alone would pair it with its RECV from anywhere)."""
    plan = lower(build_plan(Placement(3, 1), 2, "1f1b"))
    send = Action(0, Op.SEND_F, 1)
    r0 = [a for a in plan.ranks[0] if a != send]
    r2 = [*plan.ranks[2][:1], send, *plan.ranks[2][1:]]
    ranks = (tuple(r0), plan.ranks[1], tuple(r2))
    bad = Plan(plan.placement, 2, ranks, plan.schedule, plan.mb_pipeline, lowered=True)
    with pytest.raises(PlanError, match="stage 0 lives on rank 0"):
        validate(bad)
