"""The measured final pick ([Note: measured final pick] in megatron_prt/tune/measured.py):
among the tuner's top candidates the one with the smallest measured median wins, even when
the cost model predicted another one faster; every rank picks the same one. Timers are
fakes (no timing assertion); the real-runtime check only asks that the ranks agree and the
weights are untouched."""

from __future__ import annotations

import pytest
from tune_costs import assert_ranked, cost_dict

from megatron_prt.core.placement import ConfigError, Placement
from megatron_prt.sim.cost import CostModel
from megatron_prt.tune.measured import fastest, interleaved_rounds, pick_fastest, top_candidates
from megatron_prt.tune.search_plans import tune, tune_layout

M = 4


def _result():
    return tune(CostModel.from_dict(cost_dict()), 2, M, reuse_limit=2, split_backward=False)


def test_top_candidates_are_distinct_runs_in_predicted_order():
    result = _result()
    top = top_candidates(result, 4)
    assert len(top) == 4 and top[0] is result.winner
    assert_ranked(top)
    runs = {(c.stage_layers, c.plan.compute_only().to_json()) for c in top}
    assert len(runs) == 4
    with pytest.raises(ConfigError, match="--top"):
        top_candidates(result, 0)


def test_measured_faster_beats_predicted_faster():
    top = top_candidates(_result(), 3)
    measured = {0: 2.0, 1: 1.5, 2: 1.9}  # the predicted second is really the fastest
    picked = pick_fastest(top, lambda i: measured[i], reps=3)
    assert picked.winner is top[1] and picked.winner is not _result().winner
    assert picked.medians == (2.0, 1.5, 1.9)


def test_median_not_mean_and_ties_go_to_the_better_predicted():
    runs = {0: iter([1.0, 1.0, 9.0]), 1: iter([1.1, 1.1, 1.1])}  # one outlier step of 0
    assert pick_fastest(["a", "b"], lambda i: next(runs[i]), reps=3).winner == "a"
    assert pick_fastest(["a", "b"], lambda i: 1.0, reps=2).index == 0


def test_rounds_are_seeded_shuffles_so_no_candidate_always_follows_the_same_one():
    rounds = list(interleaved_rounds(4, 12))
    assert rounds == list(interleaved_rounds(4, 12))  # the same on every rank and launch
    assert all(sorted(r) == [0, 1, 2, 3] for r in rounds)
    # rotation kept each item behind one fixed other one in all but one round in four
    predecessors = {i: {r[r.index(i) - 1] for r in rounds if r.index(i) > 0} for i in range(4)}
    assert all(len(before) >= 2 for before in predecessors.values())
    order = []
    pick_fastest("abc", lambda i: order.append(i) or 1.0, reps=3)
    assert order == [i for r in interleaved_rounds(3, 3) for i in r]


def test_pick_from_timings_taken_outside_is_pick_fastests():
    """The training loop drives auto's timed calls: ``fastest`` over its timings picks as
    ``pick_fastest`` does when it drives them (median, a tie to the better predicted)."""
    runs = {0: [1.0, 1.0, 9.0], 1: [1.1, 1.1, 1.1], 2: [1.0, 1.0, 1.0]}
    steps = {i: iter(s) for i, s in runs.items()}
    driven = pick_fastest("abc", lambda i: next(steps[i]), reps=3)
    given = fastest("abc", [runs[0], runs[1], runs[2]])
    assert given == driven and given.winner == "a"
    with pytest.raises(ConfigError, match="timed steps for each of its 2 candidates"):
        fastest("ab", [[1.0], []])
    with pytest.raises(ConfigError, match="at least one"):
        fastest([], [])


def test_refuses_nothing_to_time():
    with pytest.raises(ConfigError, match="at least one"):
        pick_fastest([], lambda i: 1.0, reps=1)
    with pytest.raises(ConfigError, match="--pick-reps"):
        pick_fastest(["a"], lambda i: 1.0, reps=0)


# -- on 2 gloo ranks -------------------------------------------------------------------------
torch = pytest.importorskip("torch")

from parity_models import NUM_LAYERS, batch, loss_fn, make_layer  # noqa: E402

from megatron_prt.runtime import build_stages  # noqa: E402
from megatron_prt.runtime.local import all_ok, run_local  # noqa: E402
from megatron_prt.runtime.measured_pick import measured_pick, pick_plan  # noqa: E402


class _Idle:
    def step(self) -> None:
        pass

    def zero_grad(self) -> None:
        pass


def _disagreeing_clocks(rank, world):
    # alone, rank 0 would pick "a" and rank 1 "b"; the slowest rank's times: a 4.0, b 3.0
    local = {0: {0: 1.0, 1: 3.0}, 1: {0: 4.0, 1: 2.0}}[rank]
    picked = measured_pick(["a", "b"], [_Idle(), _Idle()], reps=3, step_seconds=local.get)
    return picked.winner, picked.medians


def test_ranks_agree_on_the_slowest_ranks_times():
    results = all_ok(run_local(2, _disagreeing_clocks, deadline_s=120))
    assert results[0] == results[1] == ("b", (4.0, 3.0))


def _own_clocks(rank, world):
    # each rank keeps its own times (no slowest-rank sum): rank 0 picks "a", rank 1 "b"
    from megatron_prt.runtime import measured_pick as module

    module._slowest = lambda seconds, group, wire: seconds
    local = {0: {0: 1.0, 1: 3.0}, 1: {0: 4.0, 1: 2.0}}[rank]
    try:
        measured_pick(["a", "b"], [_Idle(), _Idle()], reps=3, step_seconds=local.get)
    except ConfigError as exc:
        return str(exc)
    return "no error"


def test_ranks_that_pick_differently_all_raise():
    """Before, only the rank that disagreed with rank 0 raised; the other went on into its
    next collective and waited there."""
    results = all_ok(run_local(2, _own_clocks, deadline_s=120))
    assert all("found different candidates fastest ([0, 1]" in r for r in results), results
    assert all("candidate 0 on ranks [0]; candidate 1 on ranks [1]" in r for r in results)


PLACEMENT = Placement(2, 2)
COUNTS = (5, 1, 1, 5)


class _Counted(torch.nn.Module):
    """A layer with a buffer its forward moves (as BatchNorm's statistics) and a dropout
    draw from the global generator."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.register_buffer("calls", torch.zeros((), dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return torch.nn.functional.dropout(self.inner(x), 0.1)


def _real_pick(rank, world):
    layer = lambda i: _Counted(make_layer("mlp", i))  # noqa: E731
    stages = build_stages(PLACEMENT, rank, layer, NUM_LAYERS, COUNTS)
    state = [t.detach().clone() for _, s in sorted(stages.items()) for t in s.state_dict().values()]
    generator = torch.get_rng_state()
    cost = CostModel.from_dict(cost_dict())
    cost = CostModel(layers=cost.layers, stage_layers=COUNTS)
    top = top_candidates(tune_layout(cost, PLACEMENT, M), 3)
    xs, ys = batch("mlp", M)
    picked = pick_plan(top, stages, loss_fn, xs, ys, reps=2, dtype=torch.float64)
    after = [t.detach() for _, s in sorted(stages.items()) for t in s.state_dict().values()]
    unchanged = all(torch.equal(a, b) for a, b in zip(state, after, strict=True))
    return picked.index, len(top), unchanged, torch.equal(generator, torch.get_rng_state())


def test_pick_plan_on_real_runtimes_agrees_and_leaves_the_model_as_it_was():
    """The weights stayed, but the buffers (BatchNorm's running statistics) moved by every
    timed forward and the global generator advanced by every dropout draw."""
    results = all_ok(run_local(2, _real_pick, deadline_s=300))
    assert results[0][0] == results[1][0] and 0 <= results[0][0] < results[0][1]
    assert results[0][1] > 1 and all(r[2] and r[3] for r in results)


def test_top_candidates_per_configuration_are_different_configurations():
    result = tune(CostModel.from_dict(cost_dict()), 2, M, reuse_limit=2)

    def config(c):
        p = c.plan.placement
        return (p.reuse, p.placement, p.direction, c.plan.split_backward)

    plain = top_candidates(result, 6)
    assert len({config(c) for c in plain}) < 6  # near twins crowd the plain top 6
    diverse = top_candidates(result, 6, per_configuration=True)
    assert len({config(c) for c in diverse}) == len(diverse) == 6
    assert diverse[0] is result.winner
    assert_ranked(diverse)
    # each is its configuration's best predicted fitting candidate
    for c in diverse:
        assert c is next(x for x in result.fitting() if config(x) == config(c))


class _Counting:
    """Records ``zero_grad`` / ``step`` calls; the timed one is the step the clock sees."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def step(self) -> None:
        self.calls.append("step")

    def zero_grad(self) -> None:
        self.calls.append("zero")


def _warm_steps(rank, world):
    from megatron_prt.runtime import measured_pick as module

    seen = []  # what the runner had done each time the clock was read (this process only)
    module.time.perf_counter = lambda: seen.append(list(runner.calls)) or 0.0
    runner = _Counting()
    module.slowest_step_seconds(runner, warm_steps=2)
    picked = _Counting(), _Counting()
    measured_pick(["a", "b"], list(picked), reps=2, warmup=0, warm_steps=1)
    return runner.calls, seen[:2], [p.calls for p in picked]


def test_warm_steps_run_untimed_right_before_each_timed_step():
    """[Note: warm timed steps]: ``warm_steps`` untimed steps of the same runner, then the
    timed one (the clock starts after the warm steps, once its gradients are zeroed)."""
    runner_calls, clock_saw, picked_calls = all_ok(run_local(2, _warm_steps, deadline_s=120))[0]
    assert runner_calls == ["zero", "step", "zero", "step", "zero", "step"]
    assert clock_saw == [["zero", "step", "zero", "step", "zero"], runner_calls]
    one_round = ["zero", "step", "zero", "step"]  # warm step, then the timed step
    assert picked_calls == [one_round * 2, one_round * 2]


def test_negative_warm_steps_are_refused_not_taken_as_none():
    from megatron_prt.runtime.measured_pick import slowest_step_seconds

    with pytest.raises(ConfigError, match="warm_steps must be >= 0"):
        slowest_step_seconds(_Counting(), warm_steps=-1)
