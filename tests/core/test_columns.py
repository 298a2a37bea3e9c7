"""RankActions, a rank held as three columns ([Note: columnar ranks]), is the rank's tuple of
actions to every reader: indexing, slicing, iteration, equality and hash with the tuple,
concatenation, pickling, plan files. The passes that read columns (the flat check, lowering,
Plan's op queries) give the verdicts and streams the tuples give, and the check of a
lowering covers only a plan of exact types."""

import pickle
from dataclasses import replace

import pytest

from megatron_prt.core import Action, Op, Placement, Plan, build_plan
from megatron_prt.core.columns import RankActions, columns, join
from megatron_prt.core.flatcheck import lowering_passes, passes
from megatron_prt.core.lower import lower
from megatron_prt.core.validate import validate, validate_lowering


def _as_tuples(plan: Plan) -> Plan:
    return replace(plan, ranks=tuple(tuple(acts) for acts in plan.ranks))


def _as_columns(plan: Plan) -> Plan:
    return replace(plan, ranks=tuple(RankActions(*columns(acts)) for acts in plan.ranks))


def _verdict(check, *plans) -> str:
    try:
        check(*plans)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "ok"


@pytest.fixture(scope="module")
def plan() -> Plan:
    return build_plan(Placement(4, 2, "wave", "bi"), 8)


def test_the_list_scheduler_and_lowering_hand_over_columns(plan):
    assert all(type(acts) is RankActions for acts in plan.ranks)
    assert all(type(acts) is RankActions for acts in lower(plan).ranks)


def test_a_rank_reads_as_its_tuple(plan):
    rank = plan.ranks[1]
    actions = tuple(Action(s, o, m) for s, o, m in zip(*columns(rank), strict=True))
    assert len(rank) == len(actions) and list(rank) == list(actions)
    assert rank == actions and actions == rank and not rank != actions
    assert hash(rank) == hash(actions)
    assert rank[0] == actions[0] and rank[-1] == actions[-1] and rank[2:5] == actions[2:5]
    assert rank[0] is rank[0]  # made once, then kept
    assert list(reversed(rank)) == list(reversed(actions))
    assert rank.index(actions[3]) == 3 and rank.count(actions[3]) == 1 and actions[3] in rank
    one = (actions[0],)
    assert rank + one == (*actions, actions[0])
    assert one + rank == (actions[0], *actions)
    assert repr(rank) == repr(actions)
    assert rank != actions[:-1] and rank != list(actions)  # a list is no rank, as for tuples
    again = pickle.loads(pickle.dumps(rank))
    assert type(again) is RankActions and again == actions


def test_plans_round_trip_and_compare_with_tuple_plans(plan):
    tuples = _as_tuples(plan)
    assert plan == tuples and hash(plan) == hash(tuples)
    assert Plan.from_json(plan.to_json()) == plan
    assert Plan.from_csv(plan.to_csv()) == plan
    assert pickle.loads(pickle.dumps(plan)) == plan
    assert plan.fingerprint() == tuples.fingerprint()


def test_columns_of_unequal_length_are_refused():
    with pytest.raises(ValueError, match=r"unequal length.*stages 2, ops 1, mbs 2"):
        RankActions([0, 1], [Op.F], [0, 0])


@pytest.mark.parametrize("schedule", ["prt", "zb", "1f1b"])
def test_op_queries_and_lowering_read_columns_as_tuples(schedule):
    plan = build_plan(Placement(4, 1, "loop", "uni"), 6, schedule)
    tuples, cols = _as_tuples(plan), _as_columns(plan)
    assert (cols.split_backward, cols.has_backward) == (tuples.split_backward, True)
    assert cols.forward_only().has_backward is False
    assert lower(cols).ranks == lower(tuples).ranks
    assert join(map(columns, cols.ranks)) == join(map(columns, tuples.ranks))
    for fresh in (cols, tuples):
        assert passes(replace(fresh))
        validate_lowering(replace(fresh), replace(lower(plan)))


@pytest.mark.parametrize(
    "change",
    ["op as str", "mb as float", "stage as float", "mb as bool", "stage as bool"],
)
def test_a_plan_of_other_types_in_columns_is_checked_on_its_own(plan, change):
    """Equal values of other types in a plan's columns compare equal to the lowering's: the
    covering check must not vouch for the plan from them: the separate checks decide (they
    refuse a float; the flat check refuses a str op, the close checks then pass it as the Op
    it equals; a bool passes as the int it equals)."""
    lowered = replace(lower(plan))
    stages, ops, mbs = (list(column) for column in columns(plan.ranks[1]))
    if change == "op as str":
        ops[3] = ops[3].value
    else:
        column = mbs if change.startswith("mb") else stages
        column[column.index(1)] = 1.0 if change.endswith("float") else True
    odd = replace(plan, ranks=(plan.ranks[0], RankActions(stages, ops, mbs), *plan.ranks[2:]))
    assert odd.ranks == plan.ranks  # equal values
    assert not lowering_passes(replace(odd), lowered) or passes(replace(odd))

    def separately(one, other):
        validate(replace(one), full=True)
        validate(replace(other), full=True)

    expected = _verdict(separately, odd, lowered)
    assert _verdict(validate_lowering, replace(odd), lowered) == expected
    assert (expected == "ok") == (not change.endswith("float"))  # the others equal theirs


def test_picker_gives_a_tuple_for_any_number_of_indices():
    """``itemgetter`` of one index gives the bare item; the columns' gathers need a tuple."""
    from megatron_prt.core.columns import picker

    seq = [10, 11, 12, 13]
    assert picker([2, 0, 3])(seq) == (12, 10, 13)
    assert picker([1])(seq) == (11,)
    assert picker([])(seq) == ()
