"""The per-message CPU and the compute scale fitted in place ([Note: per-message CPU in
place], [Note: compute fitted in place] in megatron_prt/tune/measured.py): from two step
times of the same layers, one plan with few messages and one with many, the fit finds the
CPU per message under which the simulator reproduces their gap (below the isolated figure
too, down to 0) and, jointly, the factor on every compute time under which it reproduces both.
Step times here come from the simulator itself at a known CPU and scale, so the answer is
known."""

from __future__ import annotations

import warnings
from dataclasses import replace

import pytest

from megatron_prt.core import Placement, build_plan
from megatron_prt.core.placement import ConfigError
from megatron_prt.sim.cost import CostModel, LayerCost
from megatron_prt.sim.simulate import simulate
from megatron_prt.tune.measured import (
    MAX_SPLIT_SCALE,
    MIN_SPLIT_SCALE,
    fit_in_place,
    message_cpu_in_place,
)

LAYERS = (LayerCost(1.0, 2.0),) * 8
# unequal layers with every optional time given, an embedding and a head: all scale
RICH = tuple(
    LayerCost(1.0 + 0.1 * k, 2.0 + 0.2 * k, wgrad=0.9, full_bwd=3.0, selective_bwd=2.5)
    for k in range(8)
)
FEW = build_plan(Placement(2, 1), 2, "1f1b")
MANY = build_plan(Placement(2, 4), 2, "prt")


def _timed(cost: CostModel) -> list:
    return [(plan, simulate(plan, cost).makespan) for plan in (FEW, MANY)]


@pytest.mark.parametrize("true_cpu", [0.05, 0.2, 0.7])
def test_fit_recovers_the_cpu_that_made_the_steps(true_cpu):
    isolated = CostModel(layers=LAYERS, p2p_latency=0.01, p2p_cpu=0.01)
    measured = _timed(CostModel(layers=LAYERS, p2p_latency=0.01, p2p_cpu=true_cpu))
    # far finer than any measured step resolves; the simulator's event times are not exact
    assert message_cpu_in_place(isolated, measured) == pytest.approx(true_cpu, rel=1e-4)


def test_fit_goes_below_the_isolated_figure_when_the_steps_say_so():
    # the tuned grid's 1 MiB messages cost less in a step than their burst timed: kept at
    # the isolated figure, the many-message step simulated 6-17% above its median
    isolated = CostModel(layers=LAYERS, p2p_latency=0.01, p2p_cpu=0.3)
    measured = _timed(CostModel(layers=LAYERS, p2p_latency=0.01, p2p_cpu=0.1))
    assert message_cpu_in_place(isolated, measured) == pytest.approx(0.1, rel=1e-4)


def test_fit_gives_free_messages_when_even_they_simulate_a_larger_gap():
    isolated = CostModel(layers=LAYERS, p2p_latency=0.01, p2p_cpu=0.3)
    (few, few_s), (many, many_s) = _timed(CostModel(layers=LAYERS, p2p_latency=0.01))
    timed = [(few, few_s), (many, many_s - 0.5)]
    with pytest.warns(UserWarning, match="fitted at 0; time both steps again"):
        assert message_cpu_in_place(isolated, timed) == 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert message_cpu_in_place(isolated, timed, warn=False) == 0.0


def test_the_joint_fit_warns_only_of_its_answer(monkeypatch):
    # the rounds on the way may pass through 0: only the fitted model may warn
    from megatron_prt.tune import measured

    seen = []
    inner = measured.message_cpu_in_place

    def recorded(cost, timed, warn=True):
        seen.append(warn)
        return inner(cost, timed, warn)

    monkeypatch.setattr(measured, "message_cpu_in_place", recorded)
    traced = CostModel(layers=LAYERS, p2p_latency=0.01, p2p_cpu=0.01)
    fit_in_place(traced, _timed(replace(traced, p2p_cpu=0.2)))
    assert seen and not any(seen)


def test_a_bi_step_faster_than_a_free_sum_fits_0_and_warns_unless_told_not():
    bi = build_plan(Placement(2, 1, "loop", "bi"), 2)
    traced = CostModel(layers=LAYERS, p2p_latency=0.01, p2p_cpu=0.05, replica_latency=0.1)
    timed = [*_timed(traced), (bi, 0.9 * simulate(bi, traced).makespan)]
    with pytest.warns(UserWarning, match="replica latency is fitted at 0"):
        assert fit_in_place(traced, timed)[0].replica_latency == 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fit_in_place(traced, timed, warn=False)[0].replica_latency == 0.0


def test_cost_files_without_p2p_cpu_still_load():
    old = {"layers": [{"fwd": 1.0, "bwd": 2.0}] * 4, "p2p_latency": 0.01}
    assert CostModel.from_dict(old).p2p_cpu == 0.0
    fitted = CostModel.from_dict({**old, "p2p_cpu": 0.02})
    assert fitted.p2p_cpu == 0.02 and CostModel.from_dict(fitted.to_dict()) == fitted


@pytest.mark.parametrize("true_scale, true_cpu", [(0.8, 0.1), (1.3, 0.02), (0.5, 0.4)])
def test_joint_fit_recovers_scale_and_cpu(true_scale, true_cpu):
    ends = {"embedding": LayerCost(0.5, 0.7), "head": LayerCost(2.0, 3.0, wgrad=1.0)}
    traced = CostModel(layers=RICH, p2p_latency=0.01, p2p_cpu=0.01, **ends)
    truth = replace(traced.compute_scaled(true_scale), p2p_cpu=true_cpu)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # rounds passing through 0 on the way do not warn
        fitted, scale = fit_in_place(traced, _timed(truth))
    assert scale == pytest.approx(true_scale, rel=1e-4)
    assert fitted.p2p_cpu == pytest.approx(true_cpu, rel=1e-3)
    assert fitted.head.wgrad == pytest.approx(1.0 * true_scale, rel=1e-4)
    for got, want in zip(fitted.layers, truth.layers, strict=True):
        for name in ("fwd", "bwd", "wgrad", "full_bwd", "selective_bwd"):
            assert getattr(got, name) == pytest.approx(getattr(want, name), rel=1e-4)
    for plan, seconds in _timed(truth):  # both steps come out as measured
        assert simulate(plan, fitted).makespan == pytest.approx(seconds, rel=1e-5)


def test_the_cpu_fit_alone_misreads_a_compute_scale_as_message_cost():
    # what the joint fit is for: with traced times 25% too high, fitting the message CPU
    # alone cannot match the few-message step, and the CPU it finds is not the true one
    traced = CostModel(layers=LAYERS, p2p_latency=0.01, p2p_cpu=0.01)
    truth = replace(traced.compute_scaled(0.8), p2p_cpu=0.1)
    alone = replace(traced, p2p_cpu=message_cpu_in_place(traced, _timed(truth)))
    few, few_s = _timed(truth)[0]
    assert simulate(few, alone).makespan > 1.2 * few_s
    assert fit_in_place(traced, _timed(truth))[1] == pytest.approx(0.8, rel=1e-4)


def test_scaling_leaves_bytes_and_messages_alone():
    cost = CostModel(
        layers=(LayerCost(1.0, 2.0, act=5.0, param=7.0, wact=3.0),) * 2,
        p2p_latency=0.2,
        p2p_cpu=0.1,
        message_bytes=9.0,
        replica_latency=0.3,
    )
    scaled = cost.compute_scaled(0.5)
    assert scaled.layers[0] == LayerCost(0.5, 1.0, act=5.0, param=7.0, wact=3.0)
    assert (scaled.p2p_latency, scaled.p2p_cpu, scaled.message_bytes) == (0.2, 0.1, 9.0)
    assert scaled.replica_latency == 0.3 and scaled.embedding is None
    assert (scaled.fwd_time, scaled.bwd_time) == (0.5, 1.0)


@pytest.mark.parametrize("true_latency", [0.0, 0.05, 0.6, 2.5])
def test_a_bi_step_sets_the_replica_latency(true_latency):
    bi = build_plan(Placement(2, 1, "loop", "bi"), 2)
    traced = CostModel(layers=RICH, p2p_latency=0.01, p2p_cpu=0.01, replica_latency=0.1)
    truth = replace(traced.compute_scaled(0.9), p2p_cpu=0.05, replica_latency=true_latency)
    timed = [*_timed(truth), (bi, simulate(bi, truth).makespan)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fitted, scale = fit_in_place(traced, timed)
    assert scale == pytest.approx(0.9, rel=1e-4)  # the uni steps alone set scale and CPU
    # below the figure timed alone (0.1) too, down to 0, where the bi step says so
    assert fitted.replica_latency == pytest.approx(true_latency, rel=1e-4, abs=1e-4)
    at_zero = [w for w in caught if "replica latency is fitted at 0" in str(w.message)]
    assert bool(at_zero) == (fitted.replica_latency == 0.0)
    with pytest.raises(ConfigError, match="must be of a bi plan"):
        fit_in_place(traced, [*_timed(truth), _timed(truth)[1]])


SPLIT_RICH = tuple(
    replace(layer, split_fwd=1.1 + 0.1 * k, split_bwd=2.6 + 0.2 * k) for k, layer in enumerate(RICH)
)


@pytest.mark.parametrize("true_split", [0.7, 1.0, 1.4])
def test_a_split_step_sets_the_split_forms_scale(true_split):
    """[Note: the split form in place]: the split form traced 21-36% high against steps that
    ran as fast as the plain ones; a split step timed beside the others sets its scale, the
    plain times (and the uni and bi fits) untouched."""
    split = build_plan(Placement(2, 1), 4, "zb")
    other_split = build_plan(Placement(2, 2, "wave"), 4, "zb")
    head = LayerCost(2.0, 3.0, wgrad=1.0, split_fwd=2.1, split_bwd=3.5)
    traced = CostModel(layers=SPLIT_RICH, p2p_latency=0.01, p2p_cpu=0.01, head=head)
    truth = replace(traced.compute_scaled(0.9).split_scaled(true_split), p2p_cpu=0.05)
    timed = [*_timed(truth), (split, simulate(split, truth).makespan)]
    fitted, scale = fit_in_place(traced, timed)
    assert scale == pytest.approx(0.9, rel=1e-4)
    for got, want in zip(fitted.layers, truth.layers, strict=True):
        for name in ("fwd", "bwd", "split_fwd", "split_bwd", "wgrad"):
            assert getattr(got, name) == pytest.approx(getattr(want, name), rel=1e-4)
    assert fitted.head.split_bwd == pytest.approx(truth.head.split_bwd, rel=1e-4)
    want = simulate(other_split, truth).makespan  # a split plan the fit never saw
    assert simulate(other_split, fitted).makespan == pytest.approx(want, rel=1e-4)
    unfitted = fit_in_place(traced, timed[:2])[0]
    if true_split != 1.0:  # what the fit corrects: the traced split form's error
        assert simulate(other_split, unfitted).makespan != pytest.approx(want, rel=1e-2)


def test_no_scale_fits_a_step_the_messages_alone_outlast():
    # the old code looped 50 rounds to a scale of 0 and named no cause
    traced = CostModel(layers=LAYERS, p2p_latency=0.5, p2p_cpu=0.5)
    timed = _timed(traced)
    few = timed[0][0]
    too_fast = [(few, 0.5 * simulate(few, traced.compute_scaled(0.0)).makespan), timed[1]]
    with pytest.raises(ConfigError, match=r"no compute scale fits .* mostly compute"):
        fit_in_place(traced, too_fast)


def test_a_step_of_microseconds_fits_within_the_simulators_resolution():
    """The simulator rounds each duration to 1/10,000 of the shortest, so a 4 ms step of
    layers of 30-170 us moves in jumps of a few millionths as the scale moves: the old fit
    circled within 3e-6 of the measured time for 50 rounds and refused 47 of 200 such
    steps (a smoke run of the tuned grid failed on one); the closest round is the fit."""
    fwd = [1.23e-4, 9.93e-5, 3.84e-5, 3.66e-5, 3.24e-5, 3.38e-5, 3.34e-5, 9.51e-5]
    bwd = [4.20e-5, 4.59e-5, 5.02e-5, 4.73e-5, 4.89e-5, 5.72e-5, 9.94e-5, 1.71e-4]
    layers = tuple(LayerCost(f, b) for f, b in zip(fwd, bwd, strict=True))
    traced = CostModel(layers=layers, p2p_latency=1.4e-5, p2p_cpu=2.78e-5)
    few, many = build_plan(Placement(2, 1), 8, "1f1b"), build_plan(Placement(2, 4), 8, "prt")
    for k in range(0, 200, 5):
        few_s = 0.0040187 + k * 1.3e-8
        fitted, scale = fit_in_place(traced, [(few, few_s), (many, 0.0064254)])
        assert simulate(few, fitted).makespan == pytest.approx(few_s, rel=1e-4), k
        assert fitted == replace(traced.compute_scaled(scale), p2p_cpu=fitted.p2p_cpu)


def test_a_hops_latency_is_its_one_way_time_less_both_ends_cpu():
    """[Note: a hop's time less its CPU]: a simulated one-way hop (sender's CPU, time in
    flight, receiver's CPU) timed whole gives back the time in flight; a hop that is all
    CPU (shared memory) gives 0, never less; a free hop stays free."""
    from megatron_prt.tune.measured import hop_in_flight

    cpu, in_flight = 0.25e-3, 0.05e-3
    assert hop_in_flight(cpu + in_flight + cpu, cpu) == pytest.approx(in_flight)
    assert hop_in_flight(0.21e-3, 0.25e-3) == 0.0  # the wide stack's shared-memory message
    assert hop_in_flight(0.0, 0.0) == 0.0


@pytest.mark.parametrize("off", [0.1, 10.0])
def test_a_split_step_beyond_the_fits_bounds_warns(off):
    """A split step no scale within [MIN_SPLIT_SCALE, MAX_SPLIT_SCALE] reproduces was priced
    at the bound without a word; now it warns, naming the measured and simulated step."""
    split = build_plan(Placement(2, 1), 4, "zb")
    traced = CostModel(layers=SPLIT_RICH, p2p_latency=0.01, p2p_cpu=0.01)
    truth = replace(traced.compute_scaled(0.9), p2p_cpu=0.05)
    seconds = simulate(split, truth).makespan * off
    with pytest.warns(UserWarning, match=r"split-backward step .* the fit's bound"):
        fitted, _ = fit_in_place(traced, [*_timed(truth), (split, seconds)])
    bound = MIN_SPLIT_SCALE if off < 1 else MAX_SPLIT_SCALE
    scaled = fit_in_place(traced, _timed(truth))[0].split_scaled(bound)
    assert fitted.layers == scaled.layers
