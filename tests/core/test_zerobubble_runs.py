"""The split-backward portfolio skips only runs it has already made.

``zero_bubble`` skips a policy whose run would repeat an earlier one: a policy equal but
for its caps (or for ``fwd_order`` or ``reserve``, where the earlier run shows they made no
difference) whose caps answer every cap test of that run as it was answered ([Note: runs
that differ only in caps]); and it judges each run as it is made, stopping one that can
neither win nor tie ([Note: judging a run as it is made]). Both must leave the chosen plan
exactly that of running and replaying every policy of the portfolio."""

import itertools
import math
from collections import Counter

import pytest

from megatron_prt.core import Placement
from megatron_prt.core.placement import ConfigError
from megatron_prt.core.plan import Plan, split_microbatches
from megatron_prt.core.replay import replay
from megatron_prt.core.timing import StageTimes
from megatron_prt.core.zerobubble import (
    WGRAD_KEEP_FRACTION,
    ZBScheduler,
    _planning_times,
    _portfolio,
    _repeats,
    resolve_mem_cap,
    split_lower_bound,
    zero_bubble,
)
from megatron_prt.sim.cost import CostModel, LayerCost


def loss_cost(placement: Placement) -> CostModel:
    """Two layers a stage with W apart, a loss head and message times."""
    layer = LayerCost(fwd=1.0, bwd=2.1, act=96.0, wgrad=1.1, wact=96.0)
    head = LayerCost(fwd=0.5, bwd=0.9, act=96.0)
    return CostModel(
        layers=(layer,) * (2 * placement.depth), head=head, p2p_latency=0.05, p2p_cpu=0.02
    )


def _cases():
    for p, r, where, direction in itertools.product(
        (2, 3, 4), (1, 2, 3), ("loop", "wave"), ("uni", "bi")
    ):
        if r > 1 or where == "loop":
            for m, costs, mem_cap in itertools.product(
                (p, 2 * p), ("unit", "loss"), ("1f1b", "zb-h2")
            ):
                yield Placement(p, r, where, direction), m, costs, mem_cap


CASES = list(_cases())


def _arguments(placement, m, costs):
    if costs == "unit":
        return (
            StageTimes.uniform(placement.depth),
            (1 / placement.depth,) * placement.depth,
            WGRAD_KEEP_FRACTION,
        )
    cost = loss_cost(placement)
    return (
        cost.stage_times(placement),
        cost.stage_activation_bytes(placement),
        cost.stage_wgrad_keep(placement),
    )


def every_policy(placement, m, times, act, keep, mem_cap):
    """The portfolio with no run skipped and every order replayed: the plan that replays
    fastest under the cap (ties: less held, then portfolio order), first at the bound."""
    keep = (keep,) * placement.depth if isinstance(keep, float) else tuple(keep)
    cap = resolve_mem_cap(mem_cap, placement, m, act)
    mb_pipeline = split_microbatches(m, placement.num_pipelines)
    bound = split_lower_bound(placement, mb_pipeline, times)
    best, best_key = None, (math.inf, math.inf)
    for planning in _planning_times(placement, times):
        for policy in _portfolio(placement, planning):
            result = ZBScheduler(placement, mb_pipeline, planning, act, keep, cap, policy).run()
            if max(result.peak_bytes) > cap * (1 + 1e-9):
                continue
            name = "zb-h2" if mem_cap == "zb-h2" else "zb"
            plan = Plan(placement, m, result.orders, name, mb_pipeline)
            key = (replay(plan, times).makespan, max(result.peak_bytes))
            if key < best_key:
                best, best_key = plan, key
            if best_key[0] <= bound * (1 + 1e-12):
                return best
    return best


@pytest.mark.parametrize("placement, m, costs, mem_cap", CASES)
def test_the_plan_is_that_of_the_whole_portfolio(placement, m, costs, mem_cap):
    times, act, keep = _arguments(placement, m, costs)
    expected = every_policy(placement, m, times, act, keep, mem_cap)
    if expected is None:  # no policy fits the cap: refused either way
        with pytest.raises(ConfigError, match="fits the activation cap"):
            zero_bubble(placement, m, times, act=act, keep=keep, mem_cap=mem_cap)
        return
    got = zero_bubble(placement, m, times, act=act, keep=keep, mem_cap=mem_cap)
    assert got.ranks == expected.ranks, (placement, m, costs, mem_cap)


def test_a_run_its_trace_repeats_is_the_same_run():
    """Every pair of portfolio policies: where the earlier run says the later policy
    repeats it, the later run has the same orders and peaks; and runs of each kind repeat
    (caps only, fwd_order, reserve), so the test is not empty."""
    repeats = Counter()
    for placement in sorted({case[0] for case in CASES}, key=repr):
        m = 2 * placement.ranks
        for costs in ("unit", "loss"):
            times, act, keep = _arguments(placement, m, costs)
            keep = (keep,) * placement.depth if isinstance(keep, float) else tuple(keep)
            cap = resolve_mem_cap("1f1b", placement, m, act)
            mb_pipeline = split_microbatches(m, placement.num_pipelines)
            runs = []
            for policy in _portfolio(placement, times):
                run = ZBScheduler(placement, mb_pipeline, times, act, keep, cap, policy).run()
                for earlier, before in runs:
                    if _repeats(earlier, before, policy):
                        kind = (
                            earlier.fwd_order != policy.fwd_order,
                            earlier.reserve != policy.reserve,
                        )
                        repeats[kind] += 1
                        assert (run.orders, run.peak_bytes) == (before.orders, before.peak_bytes)
                runs.append((policy, run))
    assert set(repeats) == {(False, False), (True, False), (False, True)}, repeats
