"""Schedule validity over grids of configurations: generate, validate, lower, round-trip."""

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from megatron_prt.core import ConfigError, Placement, Plan, build_plan
from megatron_prt.core.lower import lower
from megatron_prt.core.validate import validate


def _check(placement: Placement, m: int, schedule: str = "prt") -> None:
    plan = build_plan(placement, m, schedule)
    validate(plan, full=True)
    lowered = lower(plan)
    validate(lowered, full=True)  # blocking send/recv replay: no deadlock
    assert lowered.compute_only() == plan
    for p in (plan, lowered):
        assert Plan.from_json(p.to_json()) == p
        assert Plan.from_csv(p.to_csv()) == p


configs = st.tuples(
    st.integers(1, 8),
    st.integers(1, 6),
    st.integers(1, 32),
    st.sampled_from(["loop", "wave"]),
    st.sampled_from(["uni", "bi"]),
)


@given(configs)
def test_prt_plans_validate_lower_and_round_trip(config):
    p, r, m, placement, direction = config
    if direction == "bi" and m < 2:
        with pytest.raises(ConfigError, match="bi needs >= 2 micro-batches"):
            build_plan(Placement(p, r, placement, direction), m)
        return
    _check(Placement(p, r, placement, direction), m)


@given(configs)
def test_gpipe_plans_validate(config):
    p, r, m, placement, direction = config
    _check(Placement(p, r, placement, direction), max(m, 2))


@pytest.mark.parametrize("p, m", list(itertools.product(range(1, 7), range(1, 14))))
def test_1f1b_plans_validate(p, m):
    _check(Placement(p), m, "1f1b")


@pytest.mark.parametrize("p, r", list(itertools.product(range(2, 6), range(1, 5))))
def test_interleaved_plans_validate(p, r):
    for m in (p, 2 * p, 3 * p):
        _check(Placement(p, r), m, "interleaved")


@pytest.mark.slow
@pytest.mark.parametrize(
    "placement, direction", list(itertools.product(["loop", "wave"], ["uni", "bi"]))
)
def test_exhaustive_small_grid(placement, direction):
    for p, r, m in itertools.product(range(1, 6), range(1, 5), range(1, 17)):
        if direction == "bi" and m < 2:
            continue
        _check(Placement(p, r, placement, direction), m)


def test_bi_splits_micro_batches_unevenly_when_m_is_odd():
    plan = build_plan(Placement(2, 1, "loop", "bi"), 5)
    assert plan.mb_pipeline == (0, 1, 0, 1, 0)


@pytest.mark.parametrize(
    "placement, m, schedule, match",
    [
        (Placement(2, 2), 3, "interleaved", "multiple of --pp 2"),
        (Placement(2, 2), 4, "1f1b", "R=1 uni baseline"),
        (Placement(2, 2, "wave"), 4, "interleaved", "loop --direction uni only"),
        (Placement(2), 0, "prt", "micro-batches must be"),
        (Placement(2), 4, "nosuch", "schedule must be one of"),
    ],
)
def test_refused_configurations(placement, m, schedule, match):
    with pytest.raises(ConfigError, match=match):
        build_plan(placement, m, schedule)


@pytest.mark.parametrize(
    "pp,reuse,placement,direction",
    [(8, 4, "loop", "bi"), (4, 2, "wave", "bi"), (4, 2, "loop", "uni")],
)
def test_prt_with_message_costs_is_never_worse_than_the_free_message_plan(
    pp, reuse, placement, direction
):
    """A hop makes the greedy choose differently (for P=8, R=4 loop/bi it alone gives a 21%
    longer step); the plan for free messages and equal stages competes, so costs can only
    help the planner."""
    from megatron_prt.core.replay import replay
    from megatron_prt.core.schedules import prt
    from megatron_prt.core.timing import StageTimes

    place = Placement(pp, reuse, placement, direction)
    d = place.depth
    for hop in (0.001, 0.05, 0.5):
        times = StageTimes((1.0,) * d, (2.0,) * d, hop)
        with_costs = replay(prt(place, 8, times), times).makespan
        free = replay(prt(place, 8), times).makespan
        assert with_costs <= free, (hop, with_costs, free)


@pytest.mark.parametrize("placement", ["loop", "wave"])
@pytest.mark.parametrize("direction", ["uni", "bi"])
def test_prt_plans_ranks_whose_stages_take_no_time(placement, direction):
    """Fewer layers than stages leave a rank with no work (stage times 0): the planner
    still plans, the plan validates, and it is no slower than the equal-stage plan."""
    from megatron_prt.core.replay import replay
    from megatron_prt.core.schedules import prt
    from megatron_prt.core.timing import StageTimes

    place = Placement(4, 2, placement, direction)
    busy = [float(place.rank_of(s) % 2 == 0) for s in range(place.depth)]  # ranks 1, 3 idle
    times = StageTimes(tuple(busy), tuple(2 * t for t in busy))
    plan = prt(place, 4, times)
    validate(lower(plan), full=True)
    assert replay(plan, times).makespan <= replay(prt(place, 4), times).makespan


def test_a_plan_file_of_bi_at_one_micro_batch_is_refused():
    """bi at m = 1 with the file's own mb_pipeline loaded and simulated (the runtime refused
    it only at step()); it is now refused as build_plan refuses it."""
    data = build_plan(Placement(2, 1, "loop", "bi"), 2).to_dict()
    data["num_microbatches"] = data["config"]["microbatches"] = 1
    data["mb_pipeline"] = [0]
    # pipeline 0's actions of micro-batch 0, twice: as many as the count check asks for
    data["ranks"] = {
        r: [a for a in acts if a.endswith("F0") or a.endswith("B0")] * 2
        for r, acts in data["ranks"].items()
    }
    with pytest.raises(ConfigError, match="direction bi needs >= 2 micro-batches"):
        Plan.from_dict(data)


def test_a_forward_only_plan_round_trips():
    """The micro-batch count's check before loading asked for a backward per forward, so a
    valid forward-only plan no longer loaded from its own JSON."""
    plan = build_plan(Placement(4, 2, "wave", "bi"), 4).forward_only()
    assert Plan.from_json(plan.to_json()) == plan
