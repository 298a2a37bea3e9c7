"""The flat check (megatron_prt.core.flatcheck.passes) agrees with the action-by-action checks
(validate.check_closely): a plan it passes, they pass; the valid plans of every schedule it
passes; broken plans, small and large (a fault in the middle of a long steady state), it
refuses, and validate names their fault with the same messages as before."""

import itertools
import random
from dataclasses import replace

import pytest
from plan_mutations import mutations, with_ranks

from megatron_prt.core import Action, Op, Placement, Plan, StageTimes, build_plan
from megatron_prt.core.flatcheck import passes
from megatron_prt.core.lower import lower, message_ends
from megatron_prt.core.replay import PlanError
from megatron_prt.core.validate import check_closely, validate


def _closely_valid(plan: Plan) -> bool:
    try:
        check_closely(replace(plan))
    except (PlanError, ValueError):
        return False
    return True


SMALL = [
    (Placement(p, r, placement, direction), m, schedule)
    for (p, r, m), placement, direction, schedule in itertools.product(
        [(1, 1, 3), (2, 1, 2), (3, 2, 5), (4, 2, 8)],
        ["loop", "wave"],
        ["uni", "bi"],
        ["prt", "1f1b", "gpipe", "interleaved", "zb"],
    )
    if not (direction == "bi" and m < 2)
]


def _plans(placement: Placement, m: int, schedule: str):
    try:
        plan = build_plan(placement, m, schedule)
    except Exception:  # a schedule that does not support this placement
        return []
    out = [plan, lower(plan)]
    if plan.has_backward:
        out += [plan.forward_only(), lower(plan.forward_only())]
    return [replace(p) for p in out]


@pytest.mark.parametrize("placement, m, schedule", SMALL, ids=str)
def test_valid_plans_pass_the_flat_check(placement, m, schedule):
    for plan in _plans(placement, m, schedule):
        assert passes(plan), plan


@pytest.mark.parametrize("placement, m, schedule", SMALL, ids=str)
def test_flat_yes_implies_close_yes_on_broken_plans(placement, m, schedule):
    rng = random.Random(f"{placement}{m}{schedule}")
    for plan in _plans(placement, m, schedule):
        for bad in mutations(plan, rng, 40):
            if passes(bad):
                assert _closely_valid(bad), bad


def test_flat_yes_implies_close_yes_two_edits_away():
    """Two edits can balance each other where one cannot (a RECV dropped, a SEND added)."""
    flat_yes = 0
    for placement, m, schedule in SMALL[::3]:
        rng = random.Random(f"two{placement}{m}{schedule}")
        for plan in _plans(placement, m, schedule):
            if not plan.lowered:
                continue
            for once in mutations(plan, rng, 15):
                for bad in mutations(once, rng, 4):
                    if passes(bad):
                        flat_yes += 1
                        assert _closely_valid(bad), bad
    assert flat_yes > 0  # some edits keep a valid plan (a swap of independent actions)


def test_a_send_before_its_producer_is_refused_by_both_checks():
    """A SEND before its producer (the runtime would send a tensor not made yet): the close
    checks, which decide when the flat check says no, accepted it before."""
    plan = lower(build_plan(Placement(2, 1), 2, "1f1b"))
    r0 = list(plan.ranks[0])
    send = Action(0, Op.SEND_F, 0)
    r0.remove(send)
    r0.insert(0, send)  # sent before 0F0 ran
    odd = with_ranks(plan, {0: r0})
    assert not passes(odd)
    with pytest.raises(PlanError, match=r"rank 0, step 0: 0SEND_F0 .* sends the output of 0F0"):
        validate(odd)


# -- broken plans at the benchmark's size: a fault in the middle of the steady state --------

BIG = Placement(16, 4, "loop", "uni")


@pytest.fixture(scope="module")
def big_plan():
    return build_plan(BIG, 128)


def _middle(plan: Plan, rank: int, op: Op) -> int:
    acts = plan.ranks[rank]
    return next(i for i in range(len(acts) // 2, len(acts)) if acts[i].op is op)


def test_big_valid_plan_passes(big_plan):
    assert passes(replace(big_plan))
    assert passes(replace(lower(big_plan)))


def test_big_missing_action(big_plan):
    step = _middle(big_plan, 7, Op.B)
    action = big_plan.ranks[7][step]
    acts = list(big_plan.ranks[7])
    del acts[step]
    bad = with_ranks(big_plan, {7: acts})
    assert not passes(bad)
    with pytest.raises(PlanError, match=rf"rank 7: {action} \(stage {action.stage}, mb "):
        validate(bad)


def test_big_duplicate_action(big_plan):
    step = _middle(big_plan, 3, Op.F)
    acts = list(big_plan.ranks[3])
    acts.insert(step + 5, acts[step])
    bad = with_ranks(big_plan, {3: acts})
    assert not passes(bad)
    with pytest.raises(PlanError, match="runs 2 times, expected once"):
        validate(bad)


def test_big_wrong_rank(big_plan):
    step = _middle(big_plan, 5, Op.F)
    acts5, acts6 = list(big_plan.ranks[5]), list(big_plan.ranks[6])
    moved = acts5.pop(step)
    acts6.insert(step, moved)
    bad = with_ranks(big_plan, {5: acts5, 6: acts6})
    assert not passes(bad)
    with pytest.raises(PlanError, match=f"stage {moved.stage} lives on rank 5"):
        validate(bad)


def test_big_dependency_violation_deadlocks(big_plan):
    """B of a micro-batch moved before its own F, mid steady state: a wait on a later step."""
    step = _middle(big_plan, 9, Op.B)
    acts = list(big_plan.ranks[9])
    backward = acts.pop(step)
    forward = acts.index(Action(backward.stage, Op.F, backward.mb))
    acts.insert(forward, backward)
    bad = with_ranks(big_plan, {9: acts})
    assert not passes(bad)
    with pytest.raises(PlanError, match="plan deadlocks") as err:
        validate(bad)
    assert f"{backward} (stage {backward.stage}, mb {backward.mb}) waits on" in str(err.value)
    assert "this rank runs later" in str(err.value)


def test_big_cross_rank_cycle(big_plan):
    """Two neighbouring F's swapped across a remote dependency, mid steady state: rank 4
    waits for rank 5's B of a micro-batch whose F it now runs later."""
    acts = list(big_plan.ranks[4])
    step = _middle(big_plan, 4, Op.B)
    backward = acts[step]
    forward = Action(backward.stage, Op.F, backward.mb + 4)
    acts.remove(forward)
    acts.insert(step + 1, forward)
    bad = with_ranks(big_plan, {4: acts})
    assert not passes(bad)
    with pytest.raises(PlanError, match="deadlocks"):
        validate(bad)


def test_big_lowered_swap_deadlocks_under_blocking_p2p(big_plan):
    lowered = lower(big_plan)
    acts = list(lowered.ranks[8])
    step = _middle(lowered, 8, Op.RECV_F)
    send = next(i for i in range(step + 1, len(acts)) if acts[i].op is Op.SEND_B)
    acts.insert(send, acts.pop(step))  # the RECV after a SEND the peer receives only later
    bad = with_ranks(lowered, {8: acts})
    assert not passes(bad)
    with pytest.raises(PlanError, match="deadlocks"):
        validate(bad)


def test_full_validate_of_a_big_plan_is_the_flat_check(big_plan, monkeypatch):
    """validate(full=True) of a valid plan never falls back to the close checks."""
    import megatron_prt.core.validate as module

    monkeypatch.setattr(module, "check_closely", lambda plan: pytest.fail("fell back"))
    validate(big_plan, full=True)
    validate(lower(big_plan), full=True)


@pytest.mark.parametrize(
    "stage, mb, why",
    [
        (-1, 0, "no such stage"),
        (4, 0, "no such stage"),
        (0, -1, "no such micro-batch"),
        (0, 3, "no such micro-batch"),
    ],
)
def test_out_of_range_names_are_refused(stage, mb, why):
    """A stage or micro-batch out of range would alias another action's key: refused."""
    plan = build_plan(Placement(2, 2), 3)
    acts = list(plan.ranks[0])
    acts[acts.index(Action(0, Op.F, 1))] = Action(stage, Op.F, mb)
    bad = with_ranks(plan, {0: acts})
    assert not passes(bad)
    with pytest.raises(PlanError, match=why):
        validate(bad)


@pytest.mark.slow
@pytest.mark.parametrize("placement, direction", [("loop", "uni"), ("wave", "bi")])
def test_benchmark_size_break_mid_steady_state(placement, direction):
    """P=64, R=8, m=512 (half a million actions): the valid plan and its lowering pass the
    flat check; one B moved before its own F at the middle of rank 31's steady state, and
    one RECV moved after a later SEND on rank 32, are refused and named."""
    plan = build_plan(Placement(64, 8, placement, direction), 512)
    lowered = lower(plan)
    assert passes(replace(plan)) and passes(replace(lowered))
    acts = list(plan.ranks[31])
    step = _middle(plan, 31, Op.B)
    backward = acts.pop(step)
    acts.insert(acts.index(Action(backward.stage, Op.F, backward.mb)), backward)
    bad = with_ranks(plan, {31: acts})
    assert not passes(bad)
    with pytest.raises(PlanError, match=f"{backward} \\(stage {backward.stage}, mb "):
        validate(bad)
    acts = list(lowered.ranks[32])
    step = _middle(lowered, 32, Op.RECV_F)
    send = next(i for i in range(step + 1, len(acts)) if acts[i].op is Op.SEND_B)
    acts.insert(send, acts.pop(step))
    bad = with_ranks(lowered, {32: acts})
    assert not passes(bad)
    with pytest.raises(PlanError, match="deadlocks"):
        validate(bad)


def test_any_split_of_micro_batches_between_pipelines():
    """Micro-batches renamed so the pipelines take them unevenly spaced (0, 1, 1, 0, 0, 1):
    still valid; naming a wrong pipeline for one is refused."""
    plan = build_plan(Placement(2, 2, "wave", "bi"), 6)
    rename = {0: 0, 2: 3, 4: 4, 1: 1, 3: 2, 5: 5}  # pipeline 0 keeps 0, 3, 4
    ranks = tuple(tuple(Action(s, op, rename[mb]) for s, op, mb in acts) for acts in plan.ranks)
    for lowered in (False, True):
        renamed = replace(plan, ranks=ranks, mb_pipeline=(0, 1, 1, 0, 0, 1))
        renamed = lower(renamed) if lowered else renamed
        assert passes(replace(renamed)) and _closely_valid(renamed)
        wrong = replace(renamed, mb_pipeline=(0, 1, 1, 0, 1, 0))
        assert not passes(wrong)
        with pytest.raises(PlanError, match="runs on pipeline"):
            validate(wrong)


@pytest.mark.parametrize("schedule", ["prt", "zb-h2", "gpipe"])
@pytest.mark.parametrize(
    "placement, direction", [("loop", "uni"), ("wave", "uni"), ("loop", "bi"), ("wave", "bi")]
)
@pytest.mark.parametrize("idle", ["odd ranks", "even ranks", "every third stage"])
def test_lowering_with_idle_stages_sends_after_the_producer(schedule, placement, direction, idle):
    """A stage that takes no time ends at the instant it starts: its SEND still follows
    the action that makes its tensor in its rank's stream (the runtime cannot send a
    tensor not made yet), and the flat check says yes."""
    place = Placement(3, 2, placement, direction)
    if idle == "every third stage":
        busy = [float(s % 3 != 0) for s in range(place.depth)]
    else:
        busy = [float(place.rank_of(s) % 2 == (idle == "odd ranks")) for s in range(place.depth)]
    times = StageTimes(tuple(busy), tuple(2 * t for t in busy))
    lowered = lower(build_plan(place, 7, schedule, times), times)
    validate(replace(lowered), full=True)
    assert passes(replace(lowered))
    split = lowered.split_backward
    for stream in lowered.ranks:
        made = set()
        for action in stream:
            if action.op.is_compute:
                made.add(action)
            elif action.op in (Op.SEND_F, Op.SEND_B):
                producer, _ = message_ends(action, place, split)
                assert producer in made, (action, producer)


def test_close_checks_refuse_a_send_before_its_producer():
    """A plan read from a file with a SEND ahead of the compute making its tensor: the
    close checks (which decide when the flat check says no) used to accept it."""
    placement = Placement(2, 2)
    plan = lower(build_plan(placement, 4), StageTimes.uniform(placement.depth))
    rank = 0
    acts = list(plan.ranks[rank])
    send = next(i for i, a in enumerate(acts) if a.op is Op.SEND_F)
    producer = max(i for i in range(send) if acts[i].op is Op.F)
    acts.insert(producer, acts.pop(send))  # the SEND moves just ahead of its producer
    broken = with_ranks(plan, {rank: acts})
    assert not passes(replace(broken))
    with pytest.raises(PlanError, match=r"sends the output of .*, which runs later, at step"):
        check_closely(replace(broken))


def test_two_edits_that_balance_the_message_count_are_refused():
    """A RECV dropped and a SEND for a same-rank hand-off (a wave turn) added: the message
    count still matched, and the lone SEND's missing partner read as "wait for the plan's
    last action", so the flat check passed a plan the close checks refuse."""
    placement = Placement(3, 2, "wave", "uni")
    plan = lower(build_plan(placement, 4, "prt"))
    turn = Action(2, Op.SEND_F, 0)  # 2F0 -> 3F0: both stages on rank 2
    assert placement.rank_of(2) == placement.rank_of(3) == 2
    r0 = [a for a in plan.ranks[0] if a != Action(0, Op.RECV_B, 3)]
    assert len(r0) == len(plan.ranks[0]) - 1
    bad = with_ranks(plan, {0: r0, 2: [turn, *plan.ranks[2]]})
    assert not passes(replace(bad))
    with pytest.raises(PlanError):
        validate(replace(bad), full=True)


def test_an_op_given_as_its_string_is_refused_by_the_flat_check():
    plan = build_plan(Placement(2, 1), 2, "1f1b")
    r0 = list(plan.ranks[0])
    r0[0] = Action(r0[0].stage, "F", r0[0].mb)  # equal to Op.F, hashes alike
    assert not passes(with_ranks(plan, {0: r0}))
