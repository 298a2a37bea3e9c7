"""``--pipeline-reuse auto``: the flags; a run that profiles, tunes and switches plans
mid-training tracks a run that used the chosen plan from the start; with
``--pipeline-reuse-auto-candidates`` > 1 the measured-faster plan wins over the
predicted-faster one on every rank (fake clocks) while training tracks the non-pipelined
model (CPU, gloo, 2 ranks)."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

import pytest
from megatron_flags import parse, refusal

from megatron_prt.core.actions import Action, Op
from megatron_prt.core.placement import ConfigError, Placement
from megatron_prt.core.schedules import build_plan
from megatron_prt.megatron.args import AUTO_ITERATIONS, validate_args
from megatron_prt.megatron.auto import (
    RUNNING,
    AutoTuner,
    _tuned_within_running_memory,
    pick_conditions,
    pick_record,
    plan_hash,
    resume_pick,
    same_gradients,
)
from megatron_prt.megatron.config import ReuseConfig
from megatron_prt.sim.cost import CostModel, LayerCost
from megatron_prt.tune.measured import measured_cost, stage_bytes, stage_times
from megatron_prt.tune.search_plans import tune_layout

MODEL = ("--num-layers", 8, "--pipeline-model-parallel-size", 2, "--global-batch-size", 4)


def test_auto_flag_keeps_the_layout_and_profiles():
    config = validate_args(parse(*MODEL, "--pipeline-reuse", "auto:2"))
    assert config.placement == Placement(2, 2) and config.auto_iterations == AUTO_ITERATIONS
    plain = validate_args(parse(*MODEL, "--pipeline-reuse", "auto"))
    assert plain.placement == Placement(2, 1) and plain.auto_iterations == AUTO_ITERATIONS
    assert validate_args(parse(*MODEL, "--pipeline-reuse", "2")).auto_iterations == 0


def test_auto_candidates_flag():
    config = validate_args(parse(*MODEL, "--pipeline-reuse", "auto"))
    assert config.auto_candidates == ReuseConfig.auto_candidates == 3
    picked = parse(*MODEL, "--pipeline-reuse", "auto", "--pipeline-reuse-auto-candidates", 1)
    assert validate_args(picked).auto_candidates == 1
    message = refusal(*MODEL, "--pipeline-reuse", 2, "--pipeline-reuse-auto-candidates", 5)
    assert "--pipeline-reuse-auto-candidates 5 given with --pipeline-reuse 2" in message
    assert "auto:2" in message
    # its default given by name was accepted without auto, any other value refused
    message = refusal(*MODEL, "--pipeline-reuse", 2, "--pipeline-reuse-auto-candidates", 3)
    assert "--pipeline-reuse-auto-candidates 3 given with --pipeline-reuse 2" in message
    message = refusal(*MODEL, "--pipeline-reuse-auto-candidates", 5)
    assert "--pipeline-reuse-auto-candidates given without --pipeline-reuse" in message
    with pytest.raises((SystemExit, argparse.ArgumentTypeError)):
        parse(*MODEL, "--pipeline-reuse", "auto", "--pipeline-reuse-auto-candidates", 0)
    with pytest.raises(ConfigError, match="--pipeline-reuse-auto-candidates must be >= 1"):
        ReuseConfig(Placement(2, 1), 8, auto_candidates=0)


def test_auto_chooses_among_plans_with_the_running_gradients():
    """Every plan tune_layout offers runs the running plan's stage modules, split, micro-batches
    and backward kind; a plan of another placement does not (it is never switched to)."""
    placement, counts, m = Placement(2, 2), (3, 1, 1, 3), 4
    cost = CostModel(layers=(LayerCost(1.0, 2.0),) * 8, stage_layers=counts)
    running = build_plan(placement, m)
    ranked = tune_layout(cost, placement, m).ranked
    assert len(ranked) > 1 and all(same_gradients(c, running, counts) for c in ranked)
    other = replace(ranked[0], plan=build_plan(Placement(2, 2, "wave"), m))
    assert not same_gradients(other, running, counts)
    assert not same_gradients(ranked[0], running, (2, 2, 2, 2))


class _Schedule:
    """The installed forward-backward function's auto surface: its tuner and resume."""

    def __init__(self, reuse: ReuseConfig) -> None:
        self.auto, self.switched = AutoTuner(reuse), []

    def resume_auto(self, plan) -> None:
        self.auto.resume(plan)
        self.switched.append(plan)


def test_a_checkpoints_auto_pick_runs_only_where_it_fits():
    """[Note: auto's pick is resumed]: the pick a checkpoint saved runs from the resumed
    run's first iteration under the same placement, layer split, micro-batch count and
    backward kind; under any other the resumed run profiles again, saying why."""
    reuse = ReuseConfig(Placement(2, 2), 8, (3, 1, 1, 3), auto_iterations=AUTO_ITERATIONS)
    saving = _Schedule(reuse)
    assert pick_record(saving, reuse) is None  # before the final switch: nothing to save
    pick = build_plan(reuse.placement, 4, schedule="gpipe")
    saving.auto.resume(pick)  # as the final switch sets it
    record = pick_record(saving, reuse)
    resumed = _Schedule(reuse)
    said = resume_pick(resumed, reuse, record, 4, "iter_0000004", True)
    assert resumed.switched == [pick] and resumed.auto.done and "profiling nothing" in said
    others = {
        "placement": replace(reuse, placement=Placement(2, 2, "wave")),
        "layer split": replace(reuse, stage_layers=(2, 2, 2, 2)),
        "backward kind": replace(reuse, split_backward=True),
    }
    for what, other in others.items():
        again = _Schedule(other)
        said = resume_pick(again, other, record, 4, "iter_0000004", True)
        assert not again.switched and not again.auto.done and f"another {what}" in said
    again = _Schedule(reuse)
    said = resume_pick(again, reuse, record, 8, "iter_0000004", True)
    assert not again.switched and "another micro-batch count" in said
    said = resume_pick(again, reuse, record, 4, "iter_0000004", False)
    assert not again.switched and "another tensor/pipeline/data-parallel grid" in said
    assert "profiling again" in resume_pick(again, reuse, None, 4, "iter_0000004", True)
    newer = {**json.loads(record["plan"]), "format_version": -1}  # another version's
    damaged = {**record, "plan": json.dumps(newer)}
    said = resume_pick(again, reuse, damaged, 4, "iter_0000004", True)
    assert not again.switched and "unreadable" in said


def test_a_pick_timed_under_other_conditions_is_not_resumed():
    """The record held only the plan and the split: a pick timed at one sequence length,
    micro-batch size, precision, recomputation or device ran after a resume under any
    other, profiling nothing. A record from before the conditions were kept still runs."""
    reuse = ReuseConfig(Placement(2, 2), 8, (3, 1, 1, 3), auto_iterations=AUTO_ITERATIONS)
    flags = argparse.Namespace(seq_length=128, micro_batch_size=2, bf16=True, hidden_size=64)
    timed = pick_conditions(flags)
    assert timed["recompute"] == [None, None, None] and timed["device"] == "cpu"
    saving = _Schedule(reuse)
    saving.auto.resume(build_plan(reuse.placement, 4, schedule="gpipe"))
    record = pick_record(saving, reuse, timed)
    for change, said_what in (
        ({"seq_length": 256}, "another seq_length (128 -> 256)"),
        ({"micro_batch_size": 4}, "another micro_batch_size (2 -> 4)"),
        ({"bf16": False}, "another dtype ('bfloat16' -> 'float32')"),
        ({"recompute_granularity": "selective"}, "recompute ([None, None, None] -> ['selective'"),
    ):
        again = _Schedule(reuse)
        now = pick_conditions(argparse.Namespace(**{**vars(flags), **change}))
        said = resume_pick(again, reuse, record, 4, "iter_0000004", True, now)
        assert not again.switched and said_what in said and "profiling again" in said, said
    same = _Schedule(reuse)
    assert "profiling nothing" in resume_pick(same, reuse, record, 4, "iter", True, timed)
    older = {k: v for k, v in record.items() if k != "conditions"}
    assert "profiling nothing" in resume_pick(
        _Schedule(reuse), reuse, older, 4, "iter", True, timed
    )


@pytest.mark.parametrize("split", [True, False], ids=["split-backward", "whole-backward"])
@pytest.mark.parametrize("direction", ["uni", "bi"])
def test_auto_offers_the_running_plan_and_nothing_holding_more(split, direction):
    """Split backward's candidates held 2-4x the running plan's activations and the running
    plan was never among them: auto always switched, possibly to a plan that runs out of
    memory. Now every candidate's busiest rank holds at most the running plan's layer
    activations, and the running plan competes."""
    placement, counts, m = Placement(2, 2, "loop", direction), (3, 1, 1, 3), 8
    reuse = ReuseConfig(placement, m, counts, split_backward=split)
    running = build_plan(placement, m, "zb" if split else "prt")
    spans = [_spans(placement, rank, m, split) for rank in range(2)]
    cost = measured_cost(placement, counts, spans, split_backward=split)
    unbounded = tune_layout(cost, placement, m, split_backward=split)
    result = _tuned_within_running_memory(reuse, running, cost, counts)
    held = result.budget_bytes
    assert any(c.plan == running and c.label == RUNNING for c in result.fitting())
    assert all(c.peak_bytes <= held for c in result.fitting())
    if split:  # what the unbounded search offered first held more than the running plan
        assert unbounded.winner.peak_bytes > held


def test_auto_prices_memory_in_the_measured_bytes_of_each_stage():
    """Memory was counted in layers, so a last stage whose head keeps 30 layers' worth of
    logits counted as its 3 layers: auto could switch to a plan holding more of its
    micro-batches, which the running plan's memory does not hold."""
    placement, counts, m = Placement(2, 2, "loop", "bi"), (3, 1, 1, 3), 8
    reuse = ReuseConfig(placement, m, counts, split_backward=True)
    running = build_plan(placement, m, "zb")
    spans = [_spans(placement, rank, m, True) for rank in range(2)]
    fits = {}
    for name, act in (("layers", None), ("bytes", [1.0, 1.0, 1.0, 30.0])):
        cost = measured_cost(placement, counts, spans, True, act)
        result = _tuned_within_running_memory(reuse, running, cost, counts)
        fits[name] = {(c.label, c.planned_for) for c in result.fitting()}
    assert fits["bytes"] < fits["layers"]  # admitted by counting layers, over in bytes
    assert fits["bytes"] == {(RUNNING, "seed")}


def test_stage_bytes_are_the_median_rise_of_each_forward():
    placement = Placement(2, 1)  # stage k on rank k
    rank0 = [("0F0", 100), ("0F1", 210), ("0B0", 110), ("0F2", 200), ("0B1", 100)]
    rank1 = [("1F0", 500), ("1B0", 0), ("1F1", 400), ("1B1", 0)]
    assert stage_bytes(placement, [rank0, rank1]) == [100.0, 450.0]
    assert stage_bytes(placement, [rank0, []]) is None  # stage 1 never metered


def _spans(placement, rank, m, split):
    """One traced iteration of ``rank``: every action of its stages, later stages slower."""
    ops = (Op.F, Op.I, Op.W) if split else (Op.F, Op.B)
    stages = placement.rank_stages[rank]
    return [
        [(Action(s, op, mb), 0.0, 0.1 * (1 + s)) for s in stages for op in ops for mb in range(m)]
    ]


def test_auto_with_a_plan_file_is_refused(tmp_path):
    message = refusal(*MODEL, "--pipeline-reuse", "auto", "--pipeline-reuse-plan", "p.json")
    assert "--pipeline-reuse auto and --pipeline-reuse-plan both set" in message


def test_auto_with_a_batch_rampup_is_refused():
    message = refusal(*MODEL, "--pipeline-reuse", "auto", "--rampup-batch-size", 2, 2, 100)
    assert "--pipeline-reuse auto and --rampup-batch-size both set" in message


def test_bad_auto_value_is_refused():
    with pytest.raises((SystemExit, argparse.ArgumentTypeError)):
        parse(*MODEL, "--pipeline-reuse", "automatic")


def test_measured_costs_are_the_median_stage_times():
    """Spans of two ranks (R=1 loop uni: model stage k on rank k) give each stage's median
    forward and backward; a split backward counts I + W."""
    reuse = ReuseConfig(Placement(2, 1), 4, (3, 1), split_backward=True)
    rank0 = [[(Action(0, Op.F, mb), 0.0, 0.3 + 0.01 * mb) for mb in range(3)]]
    rank0[0] += [(Action(0, Op.I, mb), 1.0, 1.2) for mb in range(3)]
    rank0[0] += [(Action(0, Op.W, mb), 2.0, 2.2) for mb in range(3)]
    rank1 = [[(Action(1, Op.F, mb), 0.0, 0.1) for mb in range(3)]]
    rank1[0] += [(Action(1, Op.I, mb), 0.0, 0.1) for mb in range(3)]
    rank1[0] += [(Action(1, Op.W, mb), 0.0, 0.1) for mb in range(3)]
    fwd, bwd, share = stage_times(reuse.placement, [rank0, rank1])
    assert fwd == pytest.approx([0.31, 0.1]) and bwd == pytest.approx([0.4, 0.2])
    assert share == pytest.approx(0.5)
    cost = measured_cost(reuse.placement, (3, 1), [rank0, rank1], split_backward=True)
    times = cost.stage_times(reuse.placement)
    assert times.fwd == pytest.approx((0.31, 0.1)) and cost.stage_layers == (3, 1)
    with pytest.raises(ConfigError, match=r"must give D = R\*P = 2 counts"):  # an IndexError
        measured_cost(reuse.placement, (1, 1, 1, 1), [rank0, rank1], split_backward=True)
    with pytest.raises(ConfigError, match=r"act_bytes gives 3 stages, .* D = R\*P = 2"):
        measured_cost(reuse.placement, (3, 1), [rank0, rank1], True, [1.0, 2.0, 3.0])


def _train_auto(rank, world, kind, m, reuse, state, clocks=None):
    """``clocks[rank][i]``: this rank's fake seconds for a call of candidate ``i``."""
    from megatron_models import train

    import megatron_prt.megatron as integration
    from megatron_prt.megatron import auto

    made, make = [], integration.make_forward_backward_func

    def making(*args, **kwargs):
        made.append(make(*args, **kwargs))
        if clocks is not None:
            made[0].auto.step_seconds = clocks[rank].get
        return made[0]

    integration.make_forward_backward_func = making
    result = train(rank, world, kind, m, reuse, state)
    tuner = made[0].auto
    ran = made[0].pipeline().plan  # the plan of the last training call
    picked = tuner.picked
    return {
        **result,
        "plan": auto.chosen[0].to_dict(),
        "ran": ran.to_dict(),
        "candidates": [c.plan.to_dict() for c in tuner.candidates],
        "pick": None if picked is None else (picked.index, picked.medians),
        "timeline": tuner.timeline,
        "metering": made[0].pipeline().measure_memory,
    }


def test_auto_switches_and_tracks_the_chosen_plan_from_the_start():
    """Two profiled calls (warm-up, traced), then the tuned plan for the third: the run
    matches one that ran that plan from the first step, up to summation order (the first
    two steps accumulate micro-batch gradients in another order)."""
    pytest.importorskip("megatron.core")
    import torch
    from megatron_models import LAYERS_TRAIN, reference, train
    from test_megatron_training import TOL

    from megatron_prt.core.plan import Plan
    from megatron_prt.runtime.local import all_ok, run_local

    m = 4
    state = all_ok(run_local(1, reference, "gpt", LAYERS_TRAIN, m))[0]["state"]
    layout = ReuseConfig(Placement(2, 2), LAYERS_TRAIN, (3, 1, 1, 3))
    once = replace(layout, auto_iterations=2, auto_candidates=1)  # K = 1: no measured pick
    auto_run = all_ok(run_local(2, _train_auto, "gpt", m, once, state))
    assert all(r["pick"] is None and len(r["candidates"]) == 1 for r in auto_run)
    metered = stage_bytes(layout.placement, [r["timeline"] for r in auto_run])
    assert metered and all(b > 0 for b in metered)  # the warm-up call was metered,
    assert not any(r["metering"] for r in auto_run)  # and only it
    plans = [Plan.from_dict(r["plan"]) for r in auto_run]
    assert len({plan_hash(p) for p in plans}) == 1  # every rank runs rank 0's choice
    chosen = plans[0]
    assert all(Plan.from_dict(r["ran"]) == chosen for r in auto_run)  # the third call ran it
    assert chosen.placement == layout.placement
    assert chosen != build_plan(layout.placement, m)  # a switch: not the running plan
    fixed = all_ok(run_local(2, train, "gpt", m, replace(layout, plan=chosen), state))
    for got, want in zip(auto_run, fixed, strict=True):
        torch.testing.assert_close(torch.tensor(got["norms"]), torch.tensor(want["norms"]), **TOL)
        for name, values in got["params"].items():
            for value, other in zip(values, want["params"][name], strict=True):
                torch.testing.assert_close(value, other, **TOL, msg=name)
    torch.testing.assert_close(
        torch.tensor(auto_run[-1]["losses"]), torch.tensor(fixed[-1]["losses"]), **TOL
    )


def test_auto_keeps_the_measured_faster_plan_and_tracks_the_reference(monkeypatch):
    """K = 2, one timed call each: with fake clocks, the predicted second (candidate 1) is
    the measured faster by the slowest rank's times (rank 0 alone would keep candidate 0), so
    every rank switches to it; training goes on through all four plans (profiled, the two
    candidates, the winner) and tracks the non-pipelined model."""
    pytest.importorskip("megatron.core")
    import megatron_models
    from megatron_models import LAYERS_TRAIN, reference, train
    from test_megatron_training import TOL

    from megatron_prt.core.plan import Plan
    from megatron_prt.runtime.local import all_ok, run_local

    # 2 profiled calls, 2 warm-ups, 2 timed, then one call of the winner
    monkeypatch.setattr(megatron_models, "STEPS", 7)
    m = 4
    state = all_ok(run_local(1, reference, "gpt", LAYERS_TRAIN, m))[0]["state"]
    want = all_ok(run_local(1, train, "gpt", m, None, state))[0]
    layout = ReuseConfig(
        Placement(2, 2), LAYERS_TRAIN, (3, 1, 1, 3), auto_iterations=2, auto_candidates=2
    )
    layout = replace(layout, auto_pick_reps=1)
    clocks = {0: {0: 1.0, 1: 3.0}, 1: {0: 4.0, 1: 2.0}}  # slowest rank: 4.0 against 3.0
    got = all_ok(run_local(2, _train_auto, "gpt", m, layout, state, clocks, deadline_s=600))
    for result in got:
        candidates = [Plan.from_dict(d) for d in result["candidates"]]
        assert len(candidates) == 2 and candidates[0] != candidates[1]
        assert result["pick"] == (1, (4.0, 3.0))
        assert Plan.from_dict(result["plan"]) == candidates[1]  # not the predicted best
        assert Plan.from_dict(result["ran"]) == candidates[1]  # the last call ran it
    assert got[0]["candidates"] == got[1]["candidates"] and got[0]["plan"] == got[1]["plan"]
    megatron_models.assert_tracks_reference(got, want, TOL)


def test_pick_log_says_what_the_plans_were_built_for():
    """auto keeps the flags' layer split, even an uneven one: the log says "equal stage
    times", not "equal stages" (read as an equal layer split)."""
    from megatron_prt.megatron.auto import AutoCandidate, describe_pick
    from megatron_prt.tune.measured import MeasuredPick

    plan = build_plan(Placement(2, 2), 4)
    candidates = tuple(
        AutoCandidate(plan, "PRT loop/uni R=2", planned, 0.01)
        for planned in ("equal stages", "costs")
    )
    line = describe_pick(MeasuredPick(candidates, ((0.02,), (0.01,)), 1), reps=1)
    assert "(plan for equal stage times) predicted 10.00 ms, measured 20.00 ms;" in line
    assert (
        "(plan for the traced stage times) predicted 10.00 ms, measured 10.00 ms <- chosen" in line
    )
    assert "equal stages" not in line


def test_auto_keeps_the_running_plan_where_no_schedule_builds():
    """One micro-batch under split backward with unequal metered bytes: zb's byte caps
    build no plan, and the search raised before the running plan was scored, aborting a run
    that trained (``tuning on rank 0 failed: no schedule could be built``)."""
    placement, counts, m = Placement(2, 2), (1, 1, 1, 1), 1
    reuse = ReuseConfig(placement, sum(counts), counts, split_backward=True)
    running = build_plan(placement, m, "zb")
    spans = [_spans(placement, rank, m, True) for rank in range(2)]
    cost = measured_cost(placement, counts, spans, True, [1.0, 2.0, 1.0, 3.0])
    with pytest.raises(ConfigError, match="no schedule could be built"):
        tune_layout(cost, placement, m, split_backward=True)
    result = _tuned_within_running_memory(reuse, running, cost, counts)
    assert [(c.label, c.plan) for c in result.ranked] == [(RUNNING, running)]


def _train_with_tuning_broken(rank, world, m, reuse, state):
    import megatron_models

    from megatron_prt.core.replay import PlanError
    from megatron_prt.megatron import auto

    def broken(*args, **kwargs):
        raise PlanError("a stand-in for a planner bug under these measured times")

    auto.tune_layout = broken  # rank 0 alone tunes
    try:
        megatron_models.train(rank, world, "gpt", m, reuse, state)
    except ConfigError as exc:
        return str(exc)
    return "trained"


def test_any_error_in_rank_0s_tuning_reaches_every_rank():
    """Only a ConfigError was broadcast: any other error on rank 0 left rank 1 with a closed
    gloo connection naming nothing (over NCCL: waiting in the broadcast until killed)."""
    pytest.importorskip("megatron.core")
    from megatron_models import LAYERS_TRAIN, reference

    from megatron_prt.runtime.local import all_ok, run_local

    state = all_ok(run_local(1, reference, "gpt", LAYERS_TRAIN, 4))[0]["state"]
    reuse = ReuseConfig(Placement(2, 2), LAYERS_TRAIN, None, auto_iterations=2, auto_candidates=1)
    said = all_ok(run_local(2, _train_with_tuning_broken, 4, reuse, state, deadline_s=60))
    for text in said:
        assert "tuning on rank 0 failed: PlanError('a stand-in for a planner bug" in text, said
