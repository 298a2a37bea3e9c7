import json

import pytest

from megatron_prt.core import Placement, build_plan
from megatron_prt.core.lower import lower
from megatron_prt.sim.cost import CostModel, LayerCost
from megatron_prt.sim.render import ascii_grid, chrome_trace, spans_of, write_png
from megatron_prt.sim.simulate import simulate


def test_p2p_messages_count_cross_rank_edges_only():
    # 1F1B: every micro-batch crosses P-1 boundaries forward and back.
    res = simulate(build_plan(Placement(4), 3, "1f1b"), CostModel(message_bytes=10.0))
    assert res.p2p_messages == 2 * 3 * 3 and res.p2p_bytes == 180.0
    # wave R=2 on 2 ranks: the turn (stage 1 -> 2) is same-rank, so 2 of 3 hops cross.
    plan = build_plan(Placement(2, 2, "wave"), 1)
    assert simulate(plan).p2p_messages == 2 * 2
    lowered = lower(plan)
    sends = [a for acts in lowered.ranks for a in acts if a.op.value.startswith("SEND")]
    assert len(sends) == 4


def test_p2p_time_delays_consumers():
    plan = build_plan(Placement(2), 1, "1f1b")
    base = simulate(plan, CostModel(fwd_time=2, bwd_time=4)).makespan
    slow = simulate(plan, CostModel(fwd_time=2, bwd_time=4, p2p_latency=0.5)).makespan
    assert slow == pytest.approx(base + 2 * 0.5)


def test_layer_costs_and_partition():
    layers = tuple(LayerCost(fwd=1.0 * (i + 1), bwd=2.0, act=10.0, param=5.0) for i in range(4))
    cost = CostModel(layers=layers, stage_layers=(3, 1))
    pl = Placement(2)
    assert cost.stage_times(pl).fwd == (6.0, 4.0)
    assert cost.stage_activation_bytes(pl) == (30.0, 10.0)
    res = simulate(build_plan(pl, 2, "1f1b"), cost)
    assert [r.param_bytes for r in res.per_rank] == [15.0, 5.0]
    assert [r.peak_activation_bytes for r in res.per_rank] == [60.0, 10.0]
    again = CostModel.from_dict(json.loads(json.dumps(cost.to_dict())))
    assert again == cost


def test_bi_ranks_hold_two_replicas():
    cost = CostModel(param_bytes=8.0)
    res = simulate(build_plan(Placement(2, 1, "loop", "bi"), 2), cost)
    assert [r.param_bytes for r in res.per_rank] == [8.0, 8.0]  # both halves of the model


@pytest.mark.parametrize("bad, match", [({"fwd_time": -1}, "fwd_time"), ({"zap": 1}, "unknown")])
def test_bad_costs_are_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        CostModel.from_dict(bad)


def test_renderers(tmp_path):
    plan = build_plan(Placement(2, 2), 4)
    res = simulate(plan)
    spans = spans_of(plan, res.timeline)
    text = ascii_grid(spans)
    assert text.count("\n") == 2 and text.startswith("r0")
    trace = chrome_trace(spans, plan.placement.stage_to_chunk)
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(xs) == 2 * 4 * 4 and {e["tid"] for e in xs} == {0, 1}
    assert max(e["ts"] + e["dur"] for e in xs) == pytest.approx(res.makespan * 1e3)
    png = tmp_path / "t.png"
    write_png(str(png), spans, "t", plan.placement.stage_to_chunk)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_message_cpu_cost_is_charged_to_both_ends():
    plan = build_plan(Placement(2), 1, "1f1b")
    cost = CostModel(fwd_time=2, bwd_time=4, p2p_latency=0.5, p2p_cpu=0.25)
    # 0F0 (+send) -> hop -> 1F0 (+recv) -> 1B0 (+send) -> hop -> 0B0 (+recv)
    assert simulate(plan, cost).makespan == pytest.approx(6 + 2 * 0.5 + 4 * 0.25)
    # a wave turn is a same-rank hand-off: no message, no cpu charge at the turn
    wave = simulate(build_plan(Placement(1, 2, "wave"), 1), cost)
    assert wave.makespan == pytest.approx(6)


@pytest.mark.parametrize(
    "field", ["replica_latency", "p2p_latency", "p2p_cpu", "message_bytes", "p2p_bandwidth"]
)
def test_a_cost_of_nan_is_refused(field):
    """A NaN passed every `< 0` check: replica_latency=NaN simulated as 0 without a word,
    others failed in the tick conversion ("cannot convert float NaN to integer")."""
    from megatron_prt.core.placement import ConfigError

    with pytest.raises(ConfigError, match=f"cost {field} must be"):
        CostModel(**{field: float("nan")})


def test_every_stage_pays_the_steps_work():
    """[Note: every stage pays its step's work]: a profile's one pass put that work in the
    embedding and the head alone, so plans of more stages priced it fewer times than they
    run it. The `stage` entry adds it to every model stage (and round-trips through JSON)."""
    from megatron_prt.tune.problem import Problem

    layer = LayerCost(fwd=1.0, bwd=2.0, act=10.0, param=4.0)
    cost = CostModel(
        layers=(layer,) * 4,
        embedding=LayerCost(fwd=0.5, bwd=0.5),
        head=LayerCost(fwd=1.5, bwd=3.0),
        stage=LayerCost(fwd=0.25, bwd=0.125, wgrad=0.0),
    )
    placement = Placement(2, 2)
    times = cost.stage_times(placement)
    assert times.fwd == (1.75, 1.25, 1.25, 2.75)
    assert times.bwd == (2.625, 2.125, 2.125, 5.125)
    assert cost.stage_activation_bytes(placement) == (10.0,) * 4  # time only
    assert CostModel.from_dict(json.loads(json.dumps(cost.to_dict()))) == cost
    without = CostModel(layers=cost.layers, embedding=cost.embedding, head=cost.head)
    plan = build_plan(placement, 4)
    assert simulate(plan, cost).makespan > simulate(plan, without).makespan
    problem = Problem(cost.split_form(), build_plan(placement, 4, "zb"))
    counts = (1, 1, 1, 1)
    stage_costs = problem.stage_costs(counts)
    assert tuple(stage_costs.fwd) == problem.stage_times(counts).fwd  # the partitioner's sums


def test_the_stage_entry_is_time_only():
    """A hand-written stage entry without wgrad put half its backward into W, though the
    step's work is all before W; bytes on it would be counted on every stage."""
    from megatron_prt.core.placement import ConfigError

    layers = (LayerCost(fwd=1.0, bwd=2.0, wgrad=1.0),) * 2
    cost = CostModel(layers=layers, stage=LayerCost(fwd=0.5, bwd=0.5))
    assert cost.stage_wgrad_times(2) == (1.0, 1.0)
    with pytest.raises(ConfigError, match=r"cost stage .* is time only"):
        CostModel(layers=layers, stage=LayerCost(fwd=0.5, bwd=0.5, act=100.0))


def test_a_stage_holds_the_input_it_received():
    """Analytic ResNet blocks count their input as the previous block's output, true only
    on one rank: a stage that received it held it uncounted (ResNet-152 R=4 wave at m=8
    peaked 4% low). A layer's ``in_act`` is now held by a stage it begins; the partitioner's
    own per-stage sums agree."""
    from megatron_prt.core.placement import Placement
    from megatron_prt.sim.analytic import LINKS, cost_model, models
    from megatron_prt.tune.problem import Problem

    model, placement = models()["ResNet-50"], Placement(4, 1)
    cost = cost_model(model, placement, LINKS["nvlink"])
    counts = cost.layer_counts(placement.depth)
    act = cost.stage_activation_bytes(placement)
    firsts = [sum(counts[:k]) for k in range(placement.depth)]
    for k in range(1, placement.depth):
        own = sum(layer.act for layer in cost.layers[firsts[k] : firsts[k] + counts[k]])
        own += cost.head.act if k == placement.depth - 1 else 0.0
        received = model.layers[firsts[k]].in_bytes
        assert received == model.layers[firsts[k] - 1].out_bytes > 0
        assert act[k] == own + received
    assert act[0] == sum(layer.act for layer in cost.layers[: counts[0]]) + cost.embedding.act
    problem = Problem(cost, build_plan(placement, 4))
    assert problem.stage_costs(counts).act == list(act)
