"""The fast planner (integer graphs, policies that give up early) against the planner it
replaced (tests/reference_planner.py): the same plan wherever the old one was optimal, never
a longer one anywhere, and the same order from every single policy."""

import itertools
import random

import pytest
import reference_planner as ref

from megatron_prt.core import Placement, StageTimes
from megatron_prt.core.greedy import Policy, list_schedule
from megatron_prt.core.lower import lower
from megatron_prt.core.plan import split_microbatches
from megatron_prt.core.replay import replay
from megatron_prt.core.schedules import (
    _keys,
    _portfolio,
    _prt_portfolio,
    build_plan,
    gpipe,
    makespan_lower_bound,
    prt,
)
from megatron_prt.core.validate import validate


def _times(placement: Placement, kind: str) -> StageTimes | None:
    d = placement.depth
    if kind == "uniform":
        return None
    if kind == "unequal":  # no two neighbours alike, backward not 2x forward
        fwd = tuple(1.0 + 0.5 * (k % 3) for k in range(d))
        return StageTimes(fwd, tuple(2.0 + (k % 2) for k in range(d)))
    if kind == "hop":
        return StageTimes.uniform(d, p2p=0.25)
    if kind == "cpu":
        return StageTimes((1.0,) * d, (2.0,) * d, p2p=0.1, p2p_cpu=0.05)
    # "idle": ranks whose stages take no time (fewer layers than stages)
    busy = [float(placement.rank_of(s) % 2 == 0) for s in range(d)]
    return StageTimes(tuple(busy), tuple(2 * t for t in busy))


def check_against_reference(placement: Placement, m: int, kind: str) -> None:
    times = _times(placement, kind)
    _prt_portfolio.cache_clear()  # compare fresh plans, not the cache
    fast, old = prt(placement, m, times), ref.reference_prt(placement, m, times)
    validate(fast, full=True)
    replay_times = times or StageTimes.uniform(placement.depth)
    fast_makespan = replay(fast, replay_times).makespan
    old_makespan = replay(old, replay_times).makespan
    assert fast_makespan <= old_makespan * (1 + 1e-12), (fast_makespan, old_makespan)
    bound = makespan_lower_bound(placement, old.mb_pipeline, replay_times)
    if old_makespan <= bound * (1 + 1e-12):  # the old plan was optimal: the same plan
        assert fast.ranks == old.ranks


def check_policies(placement: Placement, m: int, kind: str) -> None:
    """Every policy of the portfolio, and GPipe's, schedules the same order as before."""
    times = _times(placement, kind) or StageTimes.uniform(placement.depth)
    mb_pipeline = split_microbatches(m, placement.num_pipelines)
    for caps, key_name, alternate in _portfolio(placement, times, 2 * placement.depth * m):
        policy = Policy(alternate=alternate, caps=caps, **_keys(placement, m, key_name))
        old_fwd, old_bwd = ref._keys(placement, m, key_name)
        old_policy = ref.Policy(alternate=alternate, caps=caps, fwd_key=old_fwd, bwd_key=old_bwd)
        fast = list_schedule(placement, mb_pipeline, times, policy)
        old = ref.list_schedule(placement, mb_pipeline, times, old_policy)
        got = (fast.orders, fast.makespan, fast.peak_held)
        assert got == (old.orders, old.makespan, old.peak_held), (caps, key_name, alternate)
    flush = ref.Policy(flush=True, fwd_key=lambda a: (a.mb, a.stage), bwd_key=lambda a: (a.mb,))
    old = ref.list_schedule(placement, mb_pipeline, times, flush)
    assert gpipe(placement, m, times).ranks == old.orders


FAST_GRID = [
    (p, r, placement, direction)
    for p, r in ((1, 3), (2, 2), (3, 2), (4, 2))
    for placement, direction in itertools.product(["loop", "wave"], ["uni", "bi"])
]


@pytest.mark.parametrize("p, r, placement, direction", FAST_GRID)
@pytest.mark.parametrize("kind", ["uniform", "unequal", "hop"])
def test_fast_planner_matches_the_reference(p, r, placement, direction, kind):
    place = Placement(p, r, placement, direction)
    for m in sorted({2, max(2, p), 2 * p + 1, 3 * p + 1}):
        check_against_reference(place, m, kind)


@pytest.mark.parametrize("placement, direction", [("loop", "bi"), ("wave", "uni")])
@pytest.mark.parametrize("kind", ["uniform", "unequal", "cpu", "idle"])
def test_every_policy_schedules_the_same_order(placement, direction, kind):
    place = Placement(3, 2, placement, direction)
    for m in (2, 5, 7):
        check_policies(place, m, kind)


@pytest.mark.slow
@pytest.mark.parametrize(
    "placement, direction", list(itertools.product(["loop", "wave"], ["uni", "bi"]))
)
@pytest.mark.parametrize("kind", ["uniform", "unequal", "hop", "cpu", "idle"])
def test_full_grid_matches_the_reference(placement, direction, kind):
    """P 1..5, R 1..4, m 1..3P+1."""
    for p, r in itertools.product(range(1, 6), range(1, 5)):
        place = Placement(p, r, placement, direction)
        for m in range(2 if direction == "bi" else 1, 3 * p + 2):
            check_against_reference(place, m, kind)


@pytest.mark.slow
@pytest.mark.parametrize(
    "placement, direction", list(itertools.product(["loop", "wave"], ["uni", "bi"]))
)
@pytest.mark.parametrize("kind", ["uniform", "unequal", "hop"])
def test_full_grid_every_policy(placement, direction, kind):
    for p, r in itertools.product(range(1, 5), range(1, 4)):
        place = Placement(p, r, placement, direction)
        for m in range(2 if direction == "bi" else 1, 2 * p + 2):
            check_policies(place, m, kind)


@pytest.mark.parametrize("placement, direction", [("loop", "uni"), ("wave", "bi")])
def test_blocking_replay_stops_where_the_reference_does(placement, direction):
    """Lowered plans with two neighbouring actions swapped on one rank: the compiled
    blocking replay leaves every rank where the one-action-at-a-time replay does."""
    from megatron_prt.core.lower import lower
    from megatron_prt.core.plan import Plan
    from megatron_prt.core.rendezvous import stuck_ranks

    rng = random.Random(7)
    lowered = lower(prt(Placement(3, 2, placement, direction), 6))
    assert stuck_ranks(lowered) == {} == ref.reference_stuck(lowered)
    stuck_seen = 0
    for _ in range(150):
        ranks = [list(acts) for acts in lowered.ranks]
        rank = rng.randrange(len(ranks))
        step = rng.randrange(len(ranks[rank]) - 1)
        ranks[rank][step], ranks[rank][step + 1] = ranks[rank][step + 1], ranks[rank][step]
        bad = Plan(lowered.placement, 6, tuple(map(tuple, ranks)), lowered=True)
        expected = ref.reference_stuck(bad)
        assert stuck_ranks(bad) == expected
        stuck_seen += bool(expected)
    assert stuck_seen > 10  # the swaps do break plans


@pytest.mark.parametrize(
    "placement, direction", [("loop", "uni"), ("wave", "uni"), ("loop", "bi"), ("wave", "bi")]
)
@pytest.mark.parametrize("kind", ["uniform", "unequal", "cpu", "idle"])
def test_lowering_matches_the_reference(placement, direction, kind):
    """The same SEND/RECV streams as the tuple-sorting lowering, under stage times with
    ties (uniform, idle ranks) and without."""
    from megatron_prt.core.lower import lower

    for p, r, m in ((1, 2, 3), (2, 2, 4), (3, 2, 7), (4, 1, 5)):
        place = Placement(p, r, placement, direction)
        plan = prt(place, m)
        times = _times(place, kind)
        lowered = lower(plan, times)
        assert lowered == ref.reference_lower(plan, times)
        validate(lowered, full=True)


@pytest.mark.parametrize("lowered", [False, True])
def test_census_says_yes_only_to_complete_plans(lowered):
    """The quick completeness check that lets validation skip its action-by-action pass:
    yes for generated plans, no after any one action is dropped, doubled, moved to another
    rank or given another micro-batch."""
    from megatron_prt.core.actions import Action
    from megatron_prt.core.census import looks_complete
    from megatron_prt.core.lower import lower
    from megatron_prt.core.plan import Plan

    rng = random.Random(3)
    for placement, direction in itertools.product(["loop", "wave"], ["uni", "bi"]):
        plan = prt(Placement(3, 2, placement, direction), 5)
        plan = lower(plan) if lowered else plan
        assert looks_complete(plan)
        assert not looks_complete(Plan(plan.placement, 5, plan.ranks[:-1], lowered=lowered))
        for _ in range(40):
            ranks = [list(acts) for acts in plan.ranks]
            rank = rng.randrange(len(ranks))
            step = rng.randrange(len(ranks[rank]))
            stage, op, mb = action = ranks[rank][step]
            if not op.is_compute:
                continue
            change = rng.choice(["drop", "double", "move", "mb"])
            if change == "drop":
                del ranks[rank][step]
            elif change == "double":
                ranks[rank].insert(rng.randrange(len(ranks[rank])), action)
            elif change == "move":
                ranks[(rank + 1) % len(ranks)].append(ranks[rank].pop(step))
            else:
                ranks[rank][step] = Action(stage, op, (mb + rng.randrange(1, 5)) % 6)
            bad = Plan(plan.placement, 5, tuple(map(tuple, ranks)), lowered=lowered)
            assert not looks_complete(bad), (change, action)


@pytest.mark.parametrize("placement, direction", [("loop", "uni"), ("wave", "bi")])
def test_replay_of_forward_only_and_single_micro_batch_plans(placement, direction):
    """Plans where a producer's kind sits right before its consumer's and m is small (the
    table that finds producers must not confuse them with 'no producer'): one micro-batch
    forward-only takes the sum of its forward times (uni), and the plans validate."""
    for p, r in ((1, 1), (2, 3), (3, 2)):
        place = Placement(p, r, placement, direction)
        m = place.num_pipelines  # one micro-batch per pipeline
        plan = prt(place, m)
        validate(plan, full=True)
        forward = plan.forward_only()
        validate(forward, full=True)
        if direction == "uni":
            assert replay(forward).makespan == pytest.approx(place.depth * 1.0)


@pytest.mark.parametrize("reuse,placement,direction", [(2, "loop", "uni"), (2, "wave", "bi")])
def test_hops_longer_than_every_stage_still_plan(reuse, placement, direction):
    """A hop 100x a stage's forward (gloo on a fast layer): the scheduler's "no limit" must lie
    past every makespan, hops included (it lay below and every policy gave up)."""
    place = Placement(2, reuse, placement, direction)
    times = StageTimes((0.0004,) * place.depth, (0.0008,) * place.depth, 0.05, 0.00007)
    plan = build_plan(place, 2, "prt", times=times)
    validate(lower(plan), full=True)
