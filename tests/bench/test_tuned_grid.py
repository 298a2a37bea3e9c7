"""The tuned grid's configurations: exhaustive over R, placement, direction, split backward
and split, without the ones that cannot exist; every plan valid for its placement."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from dataclasses import replace
from types import SimpleNamespace

from megatron_prt.bench.tuned_grid import markdown, summarize
from megatron_prt.bench.tuned_grid.grid import PREDICTED, TUNED, grid_entries, tuned_entries
from megatron_prt.core import Placement, build_plan
from megatron_prt.core.validate import validate
from megatron_prt.sim.cost import CostModel, LayerCost
from megatron_prt.sim.simulate import simulate


def _cost(layers: int) -> CostModel:
    head = [LayerCost(3.0, 6.0, wgrad=3.0)]
    return CostModel(layers=(LayerCost(1.0, 2.0, wgrad=1.0),) * (layers - 1) + tuple(head))


def test_grid_covers_every_configuration_that_exists():
    entries = grid_entries(_cost(8), 2, 8)
    labels = [e.label for e in entries]
    assert len(labels) == len(set(labels))
    shapes = {e.label.split(",")[0] for e in entries}
    # R=1: loop only; R=2..4: loop and wave; uni and bi; split backward off and on
    assert len(shapes) == (1 + 2 * 3) * 2 * 2
    assert "R=4 wave/bi split" in shapes and not any(s.startswith("R=1 wave") for s in shapes)
    assert any(label.endswith("balanced") for label in labels)  # the heavy head moves layers
    for e in entries:
        validate(e.plan)
        assert sum(e.stage_layers) == 8 and len(e.stage_layers) == e.plan.placement.depth
        assert e.plan.split_backward == ("split" in e.label)


def test_reuse_beyond_the_layers_is_left_out():
    shapes = {e.label.split(",")[0] for e in grid_entries(_cost(6), 2, 4)}
    assert not any(s.startswith("R=4") for s in shapes) and "R=3 wave/uni" in shapes


def test_tuned_entries_are_the_tuners_best_distinct_runs():
    best, info = tuned_entries(_cost(8), 2, 8, top=4)
    assert len(best) == 4 == len(info["top"])
    predicted = [c["predicted_s"] for c in info["top"]]
    assert predicted == sorted(predicted)
    assert len({(e.stage_layers, e.plan.to_json()) for e in best}) == 4


def _stack_result(pick_index: int) -> dict:
    cost = _cost(8)
    entries = grid_entries(cost, 2, 8)
    best, info = tuned_entries(cost, 2, 8, top=3)
    times = {e.label: [1.0 + 0.01 * i] for i, e in enumerate(entries)}
    times[TUNED] = [0.9]
    if pick_index:
        times[PREDICTED] = [1.2]
    pick = {"index": pick_index, "reps": 1, "selection_s": [], "selection_median_s": [1, 2, 3]}
    return {
        "cost": cost,
        "compute_scale": 0.875,
        "entries": [_row(e) for e in entries],
        "tuned": _row(best[pick_index]),
        "predicted_best": _row(best[0]),
        "tune": {**info, "pick": pick},
        "times": times,
        "rematch": {
            "grid_best": entries[0].label,
            "times": {entries[0].label: [1.0, 1.1, 1.2], TUNED: [1.02, 1.05, 1.0]},
        },
    }


def test_report_prices_the_picked_plan_and_says_how_it_was_picked():
    summary = summarize([{"head": _stack_result(pick_index=2)}])["head"]
    best, info = tuned_entries(_cost(8), 2, 8, top=3)
    picked = best[2]
    assert summary["tuned"]["label"] == info["top"][2]["label"]
    priced = replace(_cost(8), stage_layers=picked.stage_layers)
    assert summary["tuned"]["predicted_s"] == simulate(picked.plan, priced).makespan
    assert summary["tuned_vs_grid_best"] == pytest.approx(0.9 / 1.0 - 1)
    assert summary["tuner_first_vs_grid_best"] == pytest.approx(1.2 / 1.0 - 1)
    # the same prediction against the pick's own selection median (3 s), timed earlier
    selection = summary["tuned"]["predicted_s"] / 3 - 1
    assert summary["tuned_predicted_vs_selection"] == pytest.approx(selection)
    machine = {"command": "x", "wall_s": 1, "load_start": 0, "load_end": 0}
    text = markdown({"head": summary}, {**machine, "top": 3, "pick_reps": 1})
    assert "How the pick is made" in text and "held out from the selection" in text
    assert f"| {selection:+.1%} |" in text
    assert f"| 3 | {summary['tuned']['top'][2]['label']} |" in text
    # the held-out rematch: its own medians, not the grid's repetitions
    assert summary["rematch"]["tuned_vs_grid_best"] == pytest.approx(1.02 / 1.1 - 1)
    assert "1100.00 / 1020.00, -7.3%" in text
    assert "traced per-layer times scaled by 0.875" in text


def _row(entry) -> tuple:
    return entry.label, entry.plan, entry.stage_layers


def test_report_when_the_clock_agrees_with_the_tuner():
    summary = summarize([{"head": _stack_result(pick_index=0)}])["head"]
    assert summary["tuner_first_vs_grid_best"] == summary["tuned_vs_grid_best"]


def test_rematch_times_the_grid_best_and_the_pick_again(monkeypatch):
    from megatron_prt.bench.tuned_grid import grid

    class Runner:
        def __init__(self, name):
            self.name = name

    runners = {"a": Runner("a"), "b": Runner("b"), TUNED: Runner(TUNED)}
    times = {"a": [2.0, 2.0], "b": [1.0, 3.0, 1.0], TUNED: [5.0]}  # b has the smaller median
    ran = []

    def fake_times(pair, reps, label, warm_steps):
        ran.append((list(pair), reps, warm_steps))
        return {key: [0.5] * reps for key in pair}

    monkeypatch.setattr(grid, "interleaved_times", fake_times)
    record = grid.rematch(runners, times, SimpleNamespace(reps=4, warm_steps=1), "x")["rematch"]
    assert ran == [(["b", TUNED], 4, 1)]  # timed warm, as the grid was
    assert record["grid_best"] == "b" and record["times"] == {"b": [0.5] * 4, TUNED: [0.5] * 4}


# -- the in-round fit ([Note: in-round fit]) ---------------------------------------------------
def _truth(cost: CostModel) -> CostModel:
    """The 'machine': compute 20% faster than traced, messages and the replica sum dearer."""
    return replace(cost.compute_scaled(0.8), p2p_cpu=0.05, replica_latency=0.3)


def _rows(cost: CostModel) -> list[tuple]:
    return [_row(e) for e in grid_entries(cost, 2, 8)]


def _measured(rows: list[tuple], machine: CostModel) -> dict[str, float]:
    return {
        label: simulate(plan, replace(machine, stage_layers=counts)).makespan
        for label, plan, counts in rows
    }


def test_reference_rows_are_the_fit_steps_plans_on_even_splits():
    from megatron_prt.bench.tuned_grid.in_round import reference_rows

    found = reference_rows(_rows(_cost(8)), 8, 2)
    assert [label for label, _, _ in found] == [
        "R=1 loop/uni, even",
        "R=4 loop/uni, even",
        "R=1 loop/bi, even",
        "R=1 loop/uni split, even",  # the split form's scale ([Note: the split form in place])
    ]
    assert [p.placement.reuse for _, p, _ in found] == [1, 4, 1, 1]
    plain = [row for row in _rows(_cost(8)) if not row[1].split_backward]
    assert len(reference_rows(plain, 8, 2)) == 3  # a grid without split rows: the first three
    # every layer its own stage needs R = layers / P in the grid: 10 layers on 2 ranks, R = 5
    assert reference_rows(_rows(_cost(10)), 10, 2) is None


def test_the_fits_split_step_is_the_grids_split_row():
    """The fit phase timed the zero-bubble order for equal unit stages; the tuner and the
    grid run the order built for the costs (here: rank 1 defers W), which ran 5-11% faster
    on two stacks while priced alike, so every split plan was predicted slow. [Note: the
    split form in place]"""
    from megatron_prt.bench.tuned_grid.stacks import split_reference

    cost = _cost(8)
    plan = split_reference(cost, 2, 8)
    row = {label: p for label, p, _ in _rows(cost)}["R=1 loop/uni split, even"]
    assert plan.compute_only() == row
    assert plan.compute_only() != build_plan(Placement(2, 1), 8, "zb").compute_only()
    # the report names the row; a fit on other costs may time an order no row runs
    from megatron_prt.bench.tuned_grid import _split_fit_row

    assert _split_fit_row(cost, _rows(cost), 2).endswith("grid row R=1 loop/uni split, even.")
    other = CostModel(layers=(LayerCost(1.0, 2.0, wgrad=0.2),) * 8)
    assert "no grid row" in _split_fit_row(other, _rows(cost), 2)
    assert _split_fit_row(None, _rows(cost), 2) == ""


def test_in_round_fit_predicts_the_other_rows_where_the_early_fit_drifted():
    from megatron_prt.bench.tuned_grid.in_round import in_round_fit

    profiled = _cost(8)
    rows = _rows(profiled)
    early = _measured(rows, _truth(profiled))  # the fit phase
    late = {label: 1.2 * s for label, s in early.items()}  # the host 20% slower by the grid
    fit = in_round_fit(profiled, rows, late, ranks=2)
    assert fit.scale == pytest.approx(0.96, rel=1e-4)
    for label, plan, counts in rows:
        assert fit.predict(plan, counts) == pytest.approx(late[label], rel=0.02), label
    assert fit.is_reference(*rows[0][1:]) and not fit.is_reference(*rows[-1][1:])
    assert in_round_fit(None, rows, late, ranks=2) is None  # no profiled costs: no fit


def test_report_gives_both_predictions_and_marks_a_reference_pick():
    result = _stack_result(pick_index=1)
    profiled = result["cost"]
    result["profiled_cost"] = profiled
    rows = result["entries"] + [(TUNED, *result["tuned"][1:]), (PREDICTED, *result["tuned"][1:])]
    result["times"] = {label: [s] for label, s in _measured(rows, _truth(profiled)).items()}
    summary = summarize([{"head": result}])["head"]
    record = summary["in_round"]
    assert record["tuned_vs_measured"] == pytest.approx(0.0, abs=0.02)
    assert record["references"][1] == "R=4 loop/uni, even" and not record["pick_is_reference"]
    assert all(r["in_round_s"] for r in summary["rows"])
    assert sum(r["reference"] for r in summary["rows"]) == 4
    machine = {"command": "x", "wall_s": 1, "load_start": 0, "load_end": 0}
    text = markdown({"head": summary}, {**machine, "top": 3, "pick_reps": 1})
    assert "Fitted in the grid's rounds (to R=1 loop/uni, even" in text
    assert "in-round vs measured" in text and "n/a" not in text
    others = len(summary["rows"]) - 4
    assert (
        f"other than the ones it was fitted to predicted within 10%: {others} of {others}." in text
    )
    assert text.count("(fitted to it)") == 4
    plain = markdown(summarize([{"head": _stack_result(0)}]), {**machine, "top": 3, "pick_reps": 1})
    assert "| n/a |" in plain  # no profiled costs kept: no in-round column to fill


# -- grid twins ([Note: grid twins]) -----------------------------------------------------------
def test_a_pick_running_a_grid_rows_plan_on_its_split_is_that_rows_twin():
    from megatron_prt.bench.tuned_grid.grid import grid_twins

    entries = grid_entries(_cost(8), 2, 8)
    row = next(e for e in entries if e.label == "R=1 loop/uni, even")
    same = replace(row, label="tuner's name for it")
    other_split = replace(row, label="moved", stage_layers=(3, 5))
    assert grid_twins(entries, {TUNED: same, PREDICTED: other_split}) == {TUNED: row.label}
    assert grid_twins(entries, {TUNED: other_split}) == {}


def test_rematch_times_a_twin_pick_with_its_rows_runtime(monkeypatch):
    from megatron_prt.bench.tuned_grid import grid

    runners = {"a": "runner a", "b": "runner b"}
    times = {"a": [2.0], "b": [1.0]}  # b is the grid's best
    ran = []

    def fake_times(pair, reps, label, warm_steps):
        ran.append(dict(pair))
        return {key: [0.5 + i] * reps for i, key in enumerate(pair)}

    monkeypatch.setattr(grid, "interleaved_times", fake_times)
    args = SimpleNamespace(reps=2, warm_steps=0)
    record = grid.rematch(runners, times, args, "x", {TUNED: "b"})["rematch"]
    assert ran[-1] == {"b": "runner b"}  # the pick is the best row: timed once
    assert record["times"][TUNED] == record["times"]["b"]
    record = grid.rematch(runners, times, args, "x", {TUNED: "a"})["rematch"]
    assert ran[-1] == {"b": "runner b", TUNED: "runner a"}  # the row's own runtime


def test_report_names_the_grid_row_a_twin_pick_is():
    result = _stack_result(pick_index=0)
    result["twins"] = {TUNED: result["entries"][0][0]}
    summary = summarize([{"head": result}])
    machine = {"command": "x", "wall_s": 1, "load_start": 0, "load_end": 0}
    text = markdown(summary, {**machine, "top": 3, "pick_reps": 1})
    assert f"(= grid row {result['entries'][0][0]}: same plan and split, timed once)" in text


# -- warm timed steps ([Note: warm timed steps]) ----------------------------------------------
def test_the_report_says_how_warm_a_timed_step_is_and_the_flag_is_checked():
    from megatron_prt.bench.tuned_grid import parse_args

    summary = summarize([{"head": _stack_result(0)}])
    machine = {"command": "x", "wall_s": 1, "load_start": 0, "load_end": 0, "top": 3}
    cold = markdown(summary, {**machine, "pick_reps": 1})
    warm = markdown(summary, {**machine, "pick_reps": 1, "warm_steps": 2})
    assert "right after the round's other rows (`--warm-steps 0`)" in cold
    assert "right after 2 untimed step(s) of the same row" in warm
    assert parse_args([]).warm_steps == 0 and parse_args(["--warm-steps", "1"]).warm_steps == 1
    with pytest.raises(SystemExit):
        parse_args(["--warm-steps", "-1"])


def test_no_stack_is_refused_at_the_flags(capsys):
    from megatron_prt.bench.tuned_grid import parse_args

    with pytest.raises(SystemExit):  # was: a launch of nothing, an empty report
        parse_args(["--stacks", ","])
    assert "--stacks: give at least one of equal, head, wide" in capsys.readouterr().err


def test_profiled_latency_is_the_one_way_time_less_both_ends_cpu(monkeypatch):
    """The tuned grid's costs take the shared-memory hop's one-way time less the CPU both
    ends spend on it as the latency ([Note: a hop's time less its CPU]); the one-way time
    whole counted the copies twice, once as time in flight."""
    from megatron_prt.bench.tuned_grid import stacks

    args = SimpleNamespace(
        mb_size=2, wide=8, hidden=8, burst=4, microbatches=2, layers=4, fit_steps=1, warm_steps=0
    )
    monkeypatch.setattr(stacks, "profile_layers", lambda *a: [LayerCost(1.0, 2.0)] * 4)
    monkeypatch.setattr(stacks, "replica_fields", lambda *a: {})
    monkeypatch.setattr(stacks, "shm_costs", lambda *a: (0.9e-3, 0.3e-3))  # one way, CPU
    monkeypatch.setattr(stacks, "agreed", lambda pair: pair)
    monkeypatch.setattr(stacks, "few_and_many_messages", lambda *a, **k: [])
    monkeypatch.setattr(stacks, "fit_in_place", lambda cost, timed, warn: (cost, 1.0))
    monkeypatch.setattr(stacks.dist, "broadcast_object_list", lambda shared, src: None)
    _, _, profiled = stacks.profile_costs(0, 2, "wide", args)
    assert profiled.p2p_cpu == pytest.approx(0.3e-3)
    assert profiled.p2p_latency == pytest.approx(0.9e-3 - 2 * 0.3e-3)
    monkeypatch.setattr(stacks, "shm_costs", lambda *a: (0.21e-3, 0.25e-3))  # all CPU
    assert stacks.profile_costs(0, 2, "wide", args)[2].p2p_latency == 0.0


def test_split_orders_smoke_reports_both_orders(tmp_path):
    """benchmarks/split_orders.py: the two zero-bubble orders and 1F1B per stack, timed and
    simulated, with every rank's compute per operation from the traced steps (the numbers
    are the report's, not checked here)."""
    import json

    from megatron_prt.bench.tuned_grid.split_orders import ORDERS, main

    assert main(["--smoke", "--stacks", "equal", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "split_orders.json").read_text())["stacks"]["equal"]
    assert set(data) == set(ORDERS)
    assert all(row["measured_s"] > 0 and row["simulated_s"] > 0 for row in data.values())
    unit, costs = data[ORDERS[1]]["plan"], data[ORDERS[2]]["plan"]
    assert unit != costs  # two orders of one configuration, as the report says
    ops = {ORDERS[0]: {"F", "B", "all"}, ORDERS[1]: {"F", "I", "W", "all"}}
    ops[ORDERS[2]] = ops[ORDERS[1]]
    for key, row in data.items():
        assert [set(busy) for busy in row["busy_s"]] == [ops[key]] * 2  # both ranks
        assert all(busy["all"] > 0 for busy in row["busy_s"])
    report = (tmp_path / "split_orders.md").read_text()
    assert "| equal |" in report and "busiest vs costs order" in report
    # the last column: the unit order's busiest rank against that rank in the costs order
    unit_busy = [busy["all"] for busy in data[ORDERS[1]]["busy_s"]]
    rank = unit_busy.index(max(unit_busy))
    ratio = unit_busy[rank] / data[ORDERS[2]]["busy_s"][rank]["all"]
    unit_row = next(line for line in report.splitlines() if f"| {ORDERS[1]} |" in line)
    assert unit_row.rstrip(" |").endswith(f"{ratio:.3f} (rank {rank})")
