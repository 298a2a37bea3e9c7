"""Split backward (F/I/W): generated plans are valid everywhere, stay under their activation
cap, lower, round-trip and simulate; the cost model and the memory rule follow the split."""

import itertools
import json

import pytest

from megatron_prt.core import Placement, Plan, StageTimes, build_plan
from megatron_prt.core.actions import Action, Op, parse
from megatron_prt.core.lower import lower, message_ends
from megatron_prt.core.placement import ConfigError
from megatron_prt.core.replay import PlanError
from megatron_prt.core.validate import validate
from megatron_prt.core.zerobubble import (
    WGRAD_KEEP_FRACTION,
    one_f_one_b_peak,
    split_lower_bound,
    zero_bubble,
)
from megatron_prt.sim.cost import CostModel, LayerCost
from megatron_prt.sim.simulate import held_activations, simulate


def _grid():
    for p, r, placement, direction in itertools.product(
        range(1, 6), range(1, 4), ("loop", "wave"), ("uni", "bi")
    ):
        for m in sorted({1, p - 1, p, 2 * p + 1}):
            if m >= (2 if direction == "bi" else 1):
                yield p, r, placement, direction, m


def _peaks(plan, cost):
    return [s.peak_activation_bytes for s in simulate(plan, cost).per_rank]


@pytest.mark.parametrize("p, r, placement, direction, m", list(_grid()))
def test_generated_plans_are_valid_and_under_the_1f1b_cap(p, r, placement, direction, m):
    config = Placement(p, r, placement, direction)
    plan = build_plan(config, m, "zb")
    validate(plan)
    assert plan.split_backward and {a.op for acts in plan.ranks for a in acts} == {
        Op.F,
        Op.I,
        Op.W,
    }
    lowered = lower(plan)
    validate(lowered)
    assert lowered.compute_only() == plan
    cost = CostModel(wgrad_fraction=0.5)  # whole model: 1 activation unit per micro-batch
    one_f = simulate(build_plan(Placement(p), m, "1f1b"), cost)
    cap = max(s.peak_activation_bytes for s in one_f.per_rank)
    assert cap == pytest.approx(one_f_one_b_peak(p, m, [1.0]))
    assert max(_peaks(plan, cost)) <= cap * (1 + 1e-9)
    assert simulate(lowered, cost).makespan == pytest.approx(simulate(plan, cost).makespan)


@pytest.mark.parametrize(
    "p, r, placement, direction", [(4, 2, "wave", "uni"), (3, 2, "loop", "bi")]
)
def test_other_caps_are_respected(p, r, placement, direction):
    config = Placement(p, r, placement, direction)
    m = 2 * p
    cost = CostModel(wgrad_fraction=0.5, wgrad_keep_fraction=0.5, activation_bytes=8.0)
    act = cost.stage_activation_bytes(config)
    h2 = zero_bubble(config, m, mem_cap="zb-h2", act=act, keep=0.5)
    assert h2.schedule == "zb-h2"
    assert max(_peaks(h2, cost)) <= min(m, 2 * p - 1) * 8.0 / p * (1 + 1e-9)
    cap = 0.6 * one_f_one_b_peak(p, m, act)
    tight = zero_bubble(config, m, mem_cap=cap, act=act, keep=0.5)
    validate(tight)
    assert max(_peaks(tight, cost)) <= cap * (1 + 1e-9)
    # a looser cap never makes the plan slower
    loose = zero_bubble(config, m, act=act, keep=0.5)
    assert simulate(h2, cost).makespan <= simulate(loose, cost).makespan + 1e-9
    assert simulate(loose, cost).makespan <= simulate(tight, cost).makespan + 1e-9


def test_a_cap_below_one_micro_batch_is_refused():
    with pytest.raises(ConfigError, match="activation cap"):
        zero_bubble(Placement(4), 8, mem_cap=0.01)
    with pytest.raises(ConfigError, match="mem_cap"):
        zero_bubble(Placement(4), 8, mem_cap="lots")


@pytest.mark.parametrize("lowered", [False, True])
def test_split_plans_round_trip_through_json_and_csv(lowered):
    plan = build_plan(Placement(3, 2, "wave", "bi"), 5, "zb")
    plan = lower(plan) if lowered else plan
    assert Plan.from_json(plan.to_json()) == plan
    assert Plan.from_csv(plan.to_csv()) == plan
    assert json.loads(plan.to_json())["config"]["schedule"] == "zb"


def test_send_b_carries_the_input_gradient_and_w_sends_nothing():
    plan = lower(build_plan(Placement(3, 2, "loop"), 4, "zb"))
    comms = [a for acts in plan.ranks for a in acts if a.op.is_comm]
    for comm in comms:
        producer, consumer = message_ends(comm, plan.placement, split=True)
        assert producer.op in (Op.F, Op.I) and consumer.op in (Op.F, Op.I)
        if comm.op in (Op.SEND_B, Op.RECV_B):
            assert producer.op is Op.I and consumer.op is Op.I
    # one message per cross-rank stage edge and micro-batch, each way: W adds none
    crossings = sum(
        1
        for s in range(plan.num_stages)
        if (n := plan.placement.next_stage(s)) is not None
        and plan.placement.rank_of(n) != plan.placement.rank_of(s)
    )
    assert len(comms) == 2 * 2 * crossings * 4  # SEND and RECV, F and I


def test_validation_rejects_broken_split_plans():
    plan = build_plan(Placement(2), 2, "zb")
    rank1 = list(plan.ranks[1])
    w = next(a for a in rank1 if a.op is Op.W)
    i = Action(w.stage, Op.I, w.mb)
    rank1.remove(w)
    rank1.insert(rank1.index(i), w)  # W before its own I: never ready
    with pytest.raises(PlanError, match="deadlocks"):
        validate(Plan(plan.placement, 2, (plan.ranks[0], tuple(rank1)), "zb"))
    missing = tuple(a for a in plan.ranks[1] if a != w)
    with pytest.raises(PlanError, match="missing"):
        validate(Plan(plan.placement, 2, (plan.ranks[0], missing), "zb"))
    mixed = tuple(Action(a.stage, Op.B, a.mb) if a == w else a for a in plan.ranks[1])
    with pytest.raises(PlanError, match="mixes B"):
        validate(Plan(plan.placement, 2, (plan.ranks[0], mixed), "zb"))
    # no I at all: each W was blamed for mixing B with split backward, which it does not
    no_i = tuple(tuple(a for a in acts if a.op is not Op.I) for acts in plan.ranks)
    with pytest.raises(PlanError, match=r"I0 \(stage 0, mb 0\) is missing"):
        validate(Plan(plan.placement, 2, no_i, "zb"))


def test_simulate_takes_a_hand_written_split_plan():
    """Not from our generators: wave/bi, every forward, then I and W per micro-batch."""
    config = Placement(2, 2, "wave", "bi")
    m = 4
    orders = [[] for _ in range(config.ranks)]
    mb_pipeline = tuple(mb % 2 for mb in range(m))
    for mb in range(m):
        for stage in config.pipelines[mb_pipeline[mb]]:
            orders[config.rank_of(stage)].append(Action(stage, Op.F, mb))
    for mb in range(m):
        for stage in reversed(config.pipelines[mb_pipeline[mb]]):
            orders[config.rank_of(stage)] += [Action(stage, Op.I, mb), Action(stage, Op.W, mb)]
    plan = Plan(config, m, tuple(map(tuple, orders)), "custom")
    validate(plan)
    cost = CostModel(fwd_time=1, bwd_time=2, wgrad_fraction=0.25, wgrad_keep_fraction=0.5)
    res = simulate(plan, cost)
    busy = m * (1 + 2)  # every rank: half the stages of each micro-batch, both pipelines
    assert [s.busy for s in res.per_rank] == pytest.approx([busy / 2 * 2 / 2] * 2)
    # all forwards first: every rank holds all of its m * R stage activations at once
    assert [s.peak_activation_bytes for s in res.per_rank] == pytest.approx([m * 2 / 4] * 2)
    assert simulate(lower(plan), cost).makespan == pytest.approx(res.makespan)


def test_the_memory_rule_frees_i_then_w():
    """One rank: F0 F1 I0 W0 I1 W1 peaks at 2; F0 I0 F1 W0 I1 W1 at 1 + keep."""
    config = Placement(1)
    keep = 0.25
    cost = CostModel(wgrad_fraction=0.5, wgrad_keep_fraction=keep, activation_bytes=4.0)
    for text, peak in (("0F0 0F1 0I0 0W0 0I1 0W1", 8.0), ("0F0 0I0 0F1 0W0 0I1 0W1", 5.0)):
        acts = tuple(parse(t) for t in text.split())
        plan = Plan(config, 2, (acts,), "custom")
        res = simulate(plan, cost)
        assert res.per_rank[0].peak_activation_bytes == pytest.approx(peak)
        assert res.per_rank[0].peak_inflight == 2
        changes = held_activations(acts, keep=keep)
        assert [c for _, c in changes] == [1, 1, -0.75, -0.25, -0.75, -0.25][: len(changes)] or [
            c for _, c in changes
        ] == [1, -0.75, 1, -0.25, -0.75, -0.25]
    assert held_activations(acts) == held_activations(acts, keep=WGRAD_KEEP_FRACTION)


def test_stage_times_split_the_backward():
    times = StageTimes((1.0, 1.0), (2.0, 3.0))
    for k in range(2):
        i, w = (times.duration(Action(k, op, 0)) for op in (Op.I, Op.W))
        assert i + w == times.bwd[k] and i == w
    split = times.with_wgrad_fraction(0.25)
    assert split.duration(Action(1, Op.W, 0)) == 0.75
    assert split.duration(Action(1, Op.I, 0)) == 2.25
    ticks, tick = split.in_ticks()
    assert ticks.duration(Action(1, Op.W, 0)) * tick == pytest.approx(0.75)
    with pytest.raises(ValueError, match="wgt"):
        StageTimes((1.0,), (2.0,), wgt=(3.0,))


def test_cost_model_w_times_and_json():
    plain = CostModel(fwd_time=4, bwd_time=8)
    assert plain.stage_times(Placement(2)).wgt is None  # no split given: W is half of B
    assert "wgrad_fraction" not in plain.to_dict()
    assert "wgrad_keep_fraction" not in plain.to_dict()
    frac = CostModel(fwd_time=4, bwd_time=8, wgrad_fraction=0.25, wgrad_keep_fraction=0.5)
    assert frac.stage_times(Placement(2)).wgt == (1.0, 1.0)
    assert CostModel.from_dict(json.loads(json.dumps(frac.to_dict()))) == frac
    layers = (LayerCost(1, 2, wgrad=0.5), LayerCost(1, 2), LayerCost(1, 4, wgrad=3))
    per_layer = CostModel(layers=layers, stage_layers=(2, 1))
    assert per_layer.stage_times(Placement(2)).wgt == (0.5 + 1.0, 3.0)
    again = CostModel.from_dict(json.loads(json.dumps(per_layer.to_dict())))
    assert again == per_layer
    with pytest.raises(ConfigError, match="wgrad"):
        LayerCost(1, 2, wgrad=3)
    with pytest.raises(ConfigError, match="wgrad_fraction"):
        CostModel(wgrad_fraction=1.5)


def test_cli_split_backward(run_cli):
    code, out, _ = run_cli(
        "simulate", "--pp", 4, "-m", 8, "--reuse", 2, "--placement", "wave",
        "--split-backward", "--json",
    )  # fmt: skip
    assert code == 0
    data = json.loads(out)
    assert {"makespan", "bubble_fraction", "per_rank"} <= set(data)
    assert data["config"]["schedule"] == "zb"
    assert all("peak_activation_bytes" in r for r in data["per_rank"])
    code, out, _ = run_cli(
        "plan", "--pp", 3, "-m", 4, "--split-backward", "--wgrad-fraction", "0.3", "--format",
        "json", "--mem-cap", "zb-h2",
    )  # fmt: skip
    assert code == 0
    plan = Plan.from_json(out)
    assert plan.split_backward
    code, out, _ = run_cli("compare", "--pp", 4, "-m", 8, "--split-backward", "--json")
    rows = {row["variant"]: row for row in json.loads(out)}
    assert rows["ZB R=1 (ZB-H1)"]["bubble_fraction"] < rows["1F1B"]["bubble_fraction"]
    code, _, err = run_cli("plan", "--pp", 4, "-m", 8, "--split-backward", "--schedule", "1f1b")
    assert code == 2 and "--split-backward" in err
    code, _, err = run_cli("plan", "--pp", 4, "-m", 8, "--split-backward", "--mem-cap", "no")
    assert code == 2 and "--mem-cap" in err


@pytest.mark.parametrize("fraction, p2p", [(0.3, 0.0), (0.7, 0.0), (0.5, 0.02)])
@pytest.mark.parametrize(
    "p, r, placement, direction", [(4, 2, "loop", "uni"), (4, 2, "wave", "bi")]
)
def test_unequal_w_and_message_times(fraction, p2p, p, r, placement, direction):
    """Planned for other W shares and hop times (a hop of a sixth of a stage): valid, under
    the cap, not below the bound, and faster than 1F1B with the same costs."""
    config = Placement(p, r, placement, direction)
    cost = CostModel(fwd_time=1, bwd_time=2, wgrad_fraction=fraction, p2p_latency=p2p)
    times = cost.stage_times(config)
    for m in (p, 3 * p):
        plan = zero_bubble(config, m, times)
        validate(plan)
        res = simulate(plan, cost)
        assert max(_peaks(plan, cost)) <= one_f_one_b_peak(p, m, [1.0]) * (1 + 1e-9)
        assert res.makespan >= split_lower_bound(config, plan.mb_pipeline, times) - 1e-9
        one_f = simulate(build_plan(Placement(p), m, "1f1b"), cost)
        assert res.makespan < one_f.makespan
