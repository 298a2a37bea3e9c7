"""validate_lowering(plan, lowered) gives the verdicts of validate(plan, full=True) and
validate(lowered, full=True) together: the check of a lowering covers its plan only when the
lowering holds the plan's own compute actions ([Note: a lowering's check covers its plan]).
Broken plans, each broken on one side, must be refused with the error the separate check
gives; plans equal to the lowering's compute actions but not the same objects (a str op, a
bool micro-batch, a plan read from a file) are checked on their own. message_ends, now read
from one table per placement, gives what searching the dependency rule gave."""

import itertools
import random
from dataclasses import replace

import pytest
from plan_mutations import mutations

from megatron_prt.core import Action, Op, Placement, Plan, build_plan
from megatron_prt.core.deps import carries_tensor, comm_ops, consumers, producers
from megatron_prt.core.flatcheck import lowering_passes
from megatron_prt.core.lower import lower, message_ends
from megatron_prt.core.plan import vouched
from megatron_prt.core.validate import validate, validate_lowering

CASES = [
    (Placement(p, r, placement, direction), m, schedule)
    for (p, r, m), placement, direction, schedule in itertools.product(
        [(2, 1, 2), (3, 2, 5), (4, 2, 8)],
        ["loop", "wave"],
        ["uni", "bi"],
        ["prt", "1f1b", "gpipe", "zb"],
    )
]


def _pair(placement: Placement, m: int, schedule: str) -> tuple[Plan, Plan] | None:
    try:
        plan = build_plan(placement, m, schedule)
    except Exception:  # a schedule that does not support this placement
        return None
    return replace(plan), replace(lower(plan))  # fresh copies: no marks, the same actions


def _verdict(check, *plans) -> str:
    """'ok', or the error's type and message (whatever the checks raise: a plan of odd
    values may break the error's own formatting)."""
    try:
        check(*plans)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "ok"


def _separately(plan: Plan, lowered: Plan) -> None:
    validate(replace(plan), full=True)
    validate(replace(lowered), full=True)


def _lowered_with_compute(lowered: Plan, plan: Plan) -> Plan:
    """``lowered`` with its compute actions replaced, in order, by ``plan``'s (rank by rank,
    the counts equal)."""
    ranks = []
    for acts, own in zip(lowered.ranks, plan.ranks, strict=True):
        computes = iter(own)
        ranks.append(tuple(next(computes) if a.op.is_compute else a for a in acts))
    return replace(lowered, ranks=tuple(ranks))


@pytest.mark.parametrize("placement, m, schedule", CASES, ids=str)
def test_a_plan_and_its_lowering_pass_together(placement, m, schedule):
    pair = _pair(placement, m, schedule)
    if pair is None:
        pytest.skip("schedule does not support this placement")
    plan, lowered = pair
    assert lowering_passes(plan, lowered)
    validate_lowering(plan, lowered)
    assert vouched(plan) and vouched(lowered)


@pytest.mark.parametrize("placement, m, schedule", CASES[::2], ids=str)
def test_one_side_broken_gets_the_separate_checks_verdict(placement, m, schedule):
    """Break the plan, the lowering, or both the same way (the lowering then holds the broken
    plan's own actions, so the covering path decides): the verdict and the message are the
    separate checks'."""
    pair = _pair(placement, m, schedule)
    if pair is None:
        pytest.skip("schedule does not support this placement")
    plan, lowered = pair
    rng = random.Random(f"{placement}{m}{schedule}")
    refused = 0
    for _ in range(30):
        bad_plan, bad_lowered = next(mutations(plan, rng, 1)), next(mutations(lowered, rng, 1))
        pairs = [(bad_plan, lowered), (plan, bad_lowered)]
        if list(map(len, bad_plan.ranks)) == list(map(len, plan.ranks)):
            pairs.append((bad_plan, _lowered_with_compute(lowered, bad_plan)))
        for one, other in pairs:
            expected = _verdict(_separately, one, other)
            assert _verdict(validate_lowering, replace(one), replace(other)) == expected
            refused += expected != "ok"
    assert refused > 0


def test_the_same_values_as_other_objects_are_checked_on_their_own():
    """A plan equal to the lowering's compute actions but not made of them: an op given as
    its string, a micro-batch as a bool (equal values of other types: the flat check of the
    plan refuses them, the separate checks decide) and a plan read back from JSON (valid)."""
    plan, lowered = _pair(Placement(4, 2, "wave", "uni"), 8, "prt")
    for rank, step in ((0, 3), (1, 0)):
        stage, op, mb = plan.ranks[rank][step]
        for odd in (Action(stage, op.value, mb), Action(stage, op, mb == 1 if mb < 2 else mb)):
            acts = list(plan.ranks[rank])
            acts[step] = odd
            other = replace(plan, ranks=(*plan.ranks[:rank], tuple(acts), *plan.ranks[rank + 1 :]))
            assert other.ranks == plan.ranks
            assert _verdict(validate_lowering, other, lowered) == _verdict(
                _separately, other, lowered
            )
    reread = Plan.from_json(plan.to_json())
    assert reread.ranks == plan.ranks and reread.ranks[0][0] is not plan.ranks[0][0]
    assert lowering_passes(reread, lowered)  # decided by checking the plan on its own
    validate_lowering(reread, lowered)


def test_other_fields_are_checked_on_their_own():
    """A plan of another split of micro-batches, and a lowered plan given as the plan."""
    plan, lowered = _pair(Placement(4, 1, "loop", "bi"), 6, "prt")
    swapped = replace(plan, mb_pipeline=tuple(1 - p for p in plan.mb_pipeline))
    assert _verdict(validate_lowering, swapped, lowered) == _verdict(_separately, swapped, lowered)
    assert _verdict(validate_lowering, swapped, lowered) != "ok"
    assert _verdict(validate_lowering, lowered, lowered) == "ok"  # both valid plans


@pytest.mark.parametrize("where", ["end to next", "start to previous", "extra empty rank"])
def test_the_same_sequence_split_at_other_ranks_is_refused(where):
    """The lowering's compute actions, the same objects in the same order, but a rank of the
    plan ending one action later or earlier (an action on a rank its stage is not on), or one
    more (empty) rank: the separate check refuses, and so must the covering one."""
    plan, lowered = _pair(Placement(4, 2, "loop", "uni"), 8, "prt")
    ranks = [list(acts) for acts in plan.ranks]
    if where == "end to next":
        ranks[2].insert(0, ranks[1].pop())
    elif where == "start to previous":
        ranks[1].append(ranks[2].pop(0))
    else:
        ranks.append([])
    moved = replace(plan, ranks=tuple(map(tuple, ranks)))
    assert [a for acts in moved.ranks for a in acts] == [a for acts in plan.ranks for a in acts]
    assert not lowering_passes(moved, lowered)
    expected = _verdict(_separately, moved, lowered)
    assert expected != "ok"
    assert _verdict(validate_lowering, moved, lowered) == expected


def _message_ends_by_search(comm: Action, placement: Placement, split: bool):
    """message_ends as it was written before its table: every edge of the comm's stage that
    carries a tensor with that SEND/RECV op, asked of the rule directly."""
    stage, op, mb = comm
    sending = op in (Op.SEND_F, Op.SEND_B)
    found = []
    for own in (Action(stage, o, mb) for o in ((Op.F, Op.I, Op.W) if split else (Op.F, Op.B))):
        if sending:
            edges = [(own, c) for c in consumers(own, placement, split)]
        else:
            edges = [(p, own) for p in producers(own, placement, split)]
        slot = 0 if sending else 1
        found += [(p, c) for p, c in edges if carries_tensor(p, c) and comm_ops(p)[slot] is op]
    return found[0] if len(found) == 1 else None


PLACEMENTS = [
    Placement(p, r, placement, direction)
    for (p, r), placement, direction in itertools.product(
        [(1, 1), (2, 2), (3, 2), (4, 3)], ["loop", "wave"], ["uni", "bi"]
    )
]


@pytest.mark.parametrize("placement", PLACEMENTS, ids=str)
@pytest.mark.parametrize("split", [False, True])
def test_message_ends_from_its_table_is_the_rule_searched(placement, split):
    for stage in range(placement.num_stages):
        for op in Op:
            comm = Action(stage, op, 5)
            expected = _message_ends_by_search(comm, placement, split)
            try:
                got = message_ends(comm, placement, split)
            except ValueError:
                got = None
            assert got == expected, (comm, placement, split)
