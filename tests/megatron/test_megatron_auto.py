"""``--pipeline-reuse auto``: the flag, and a run that profiles, tunes and switches plans
mid-training tracks a run that used the chosen plan from the start (CPU, gloo, 2 ranks)."""

from __future__ import annotations

import argparse
from dataclasses import replace

import pytest
from megatron_flags import parse, refusal

from megatron_prt.core.actions import Action, Op
from megatron_prt.core.placement import Placement
from megatron_prt.core.schedules import build_plan
from megatron_prt.megatron.args import AUTO_ITERATIONS, validate_args
from megatron_prt.megatron.auto import plan_hash
from megatron_prt.megatron.config import ReuseConfig
from megatron_prt.tune.measured import measured_cost, stage_times

MODEL = ("--num-layers", 8, "--pipeline-model-parallel-size", 2, "--global-batch-size", 4)


def test_auto_flag_keeps_the_layout_and_profiles():
    config = validate_args(parse(*MODEL, "--pipeline-reuse", "auto:2"))
    assert config.placement == Placement(2, 2) and config.auto_iterations == AUTO_ITERATIONS
    plain = validate_args(parse(*MODEL, "--pipeline-reuse", "auto"))
    assert plain.placement == Placement(2, 1) and plain.auto_iterations == AUTO_ITERATIONS
    assert validate_args(parse(*MODEL, "--pipeline-reuse", "2")).auto_iterations == 0


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


def _train_auto(rank, world, kind, m, reuse, state):
    from megatron_models import train

    import megatron_prt.megatron as integration
    from megatron_prt.megatron import auto

    made, make = [], integration.make_forward_backward_func
    integration.make_forward_backward_func = lambda *a, **k: made.append(make(*a, **k)) or made[0]
    result = train(rank, world, kind, m, reuse, state)
    ran = made[0].pipeline().plan  # the plan of the last (third) training call
    return {**result, "plan": auto.chosen[0].to_dict(), "ran": ran.to_dict()}


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
    auto_run = all_ok(
        run_local(2, _train_auto, "gpt", m, replace(layout, auto_iterations=2), state)
    )
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
