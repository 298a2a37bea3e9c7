"""The measured grid against the tuner's pick (CPU, 2 gloo ranks, one thread each).

    python benchmarks/tuned_grid.py                    # out/bench/tuned_grid.{md,json,png}
    python benchmarks/tuned_grid.py --smoke            # tiny stacks, 1 repetition: it runs

For each of three layer stacks (:mod:`.stacks`: equal layers, a heavy head on the last
stage, large messages for little compute) one launch profiles the costs on the ranks,
plans an exhaustive grid (:func:`.grid.grid_entries`: R in {1, 2, 3, 4}, loop/wave,
uni/bi, split backward off/on, even and balanced splits), runs ``megatron-prt tune`` on the
same costs and picks among its ``--top`` best predicted candidates by the clock (a
selection phase of ``--pick-reps`` interleaved steps each: :mod:`.grid`), then times every
grid configuration and the pick as interleaved repetitions (medians), apart from the ones
that chose it. The report gives, per stack, the grid's best measured time against the tuned
pick's (target: within 5%) and the tuned pick's predicted against measured time (target:
within 10%) beside the prediction of a model fitted in the grid's own rounds (:mod:`.in_round`),
the selection, and every grid row. A pick that is a grid row's plan on its split is timed
once, as that row ([Note: grid twins] in :mod:`.grid`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Sequence
from dataclasses import replace

from ...runtime.local import all_ok, run_local
from ...sim.simulate import simulate
from ..flags import apply_smoke
from ..report import launch, write_report
from .chart import plot_grid
from .grid import PREDICTED, TUNED, worker
from .in_round import in_round_fit
from .stacks import STACKS, split_reference

DEFAULT_OUT = "out/bench"
NAME = "tuned_grid"


def _warmth(warm_steps: int) -> str:
    """The report's line on how warm a timed step is ([Note: warm timed steps])."""
    if not warm_steps:
        return (
            "Every timed step runs right after the round's other rows (`--warm-steps 0`): "
            "its weights, activations and rings come cold from memory."
        )
    return (
        f"Every timed step (fit, selection, grid, rematch) runs right after {warm_steps} "
        "untimed step(s) of the same row (`--warm-steps`), as in a training run that steps "
        "one runtime ([Note: warm timed steps] in `megatron_prt/runtime/measured_pick.py`)."
    )


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument(
        "--stacks", default=",".join(STACKS), help="comma-separated, of " + ", ".join(STACKS)
    )
    p.add_argument("-m", "--microbatches", type=int, default=8, help="micro-batches (default 8)")
    p.add_argument("--reps", type=int, default=21, help="timed repetitions per row (median)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per row")
    p.add_argument(
        "--warm-steps",
        type=int,
        default=0,
        help="untimed steps of a row right before each of its timed ones, in the fit, the "
        "selection and the grid (default 0: each step timed right after the round's other "
        "rows; [Note: warm timed steps])",
    )
    p.add_argument("--layers", type=int, default=8, help="layers per stack (default 8)")
    p.add_argument("--hidden", type=int, default=512, help="equal and head stacks' width")
    p.add_argument("--wide", type=int, default=8192, help="the wide stack's channels")
    p.add_argument("--mb-size", type=int, default=32, help="rows per micro-batch")
    p.add_argument("--profile-steps", type=int, default=5, help="traced profiling steps")
    p.add_argument(
        "--fit-steps",
        type=int,
        default=15,
        help="timed steps of each of the fit's reference steps (1F1B, every layer its own "
        "stage, R = 1 loop/bi, R = 1 in split backward as the tuner plans it) the costs are "
        "fitted to (default 15)",
    )
    p.add_argument("--burst", type=int, default=64, help="messages per CPU-cost burst")
    p.add_argument(
        "--top", type=int, default=6, help="tuner's best predicted candidates timed to pick one"
    )
    p.add_argument("--pick-reps", type=int, default=15, help="timed steps per candidate to pick")
    p.add_argument(
        "--no-keep-freed-memory",
        dest="keep_freed_memory",
        action="store_false",
        help="leave glibc's trimming on (page faults each step: [Note: freed memory kept])",
    )
    p.add_argument("--out", default=DEFAULT_OUT, help=f"report directory (default {DEFAULT_OUT})")
    p.add_argument("--smoke", action="store_true", help="tiny stacks, 1 repetition: checks it runs")
    args = p.parse_args(argv)
    args.stacks = [s for s in args.stacks.split(",") if s]
    if not args.stacks:
        p.error(f"--stacks: give at least one of {', '.join(STACKS)}")
    unknown = sorted(set(args.stacks) - set(STACKS))
    if unknown:
        p.error(f"--stacks: unknown {', '.join(unknown)}; choose from {', '.join(STACKS)}")
    if args.smoke:
        smoke = {"hidden": 32, "wide": 256, "mb_size": 2, "reps": 1, "warmup": 1}
        smoke |= {"profile_steps": 1, "burst": 4, "top": 2, "pick_reps": 1, "fit_steps": 1}
        apply_smoke(args, p, smoke)
    if args.warm_steps < 0:
        p.error(f"--warm-steps must be >= 0, got {args.warm_steps}")
    if min(args.top, args.pick_reps, args.fit_steps) < 1:
        p.error(
            f"--top, --pick-reps and --fit-steps must be >= 1, got {args.top}, "
            f"{args.pick_reps} and {args.fit_steps}"
        )
    return args


def summarize(per_rank: list[dict]) -> dict:
    """Per stack: every row (measured median, predicted), the grid's best, the tuned pick
    (and the tuner's predicted best when the clock chose another), the two targets' ratios
    and the selection."""
    out = {}
    for stack, res in per_rank[0].items():
        cost = res["cost"]
        picks = [(TUNED, *res["tuned"][1:]), (PREDICTED, *res["predicted_best"][1:])]
        medians = {label: statistics.median(times) for label, times in res["times"].items()}
        ranks = res["entries"][0][1].placement.ranks
        fit = in_round_fit(res.get("profiled_cost"), res["entries"], medians, ranks)
        rows = []
        for label, plan, counts in [*res["entries"], *picks]:
            if label == PREDICTED and label not in res["times"]:
                continue  # the predicted best is the pick: timed once, as the pick
            predicted = simulate(plan, replace(cost, stage_layers=counts)).makespan
            rows.append({"label": label, "measured_s": medians[label], "predicted_s": predicted})
            rows[-1]["in_round_s"] = fit.predict(plan, counts) if fit else None
            rows[-1]["reference"] = bool(fit and label != TUNED and fit.is_reference(plan, counts))
        grid = [r for r in rows if r["label"] not in (TUNED, PREDICTED)]
        tuned = next(r for r in rows if r["label"] == TUNED)
        first = next((r for r in rows if r["label"] == PREDICTED), tuned)
        best = min(grid, key=lambda r: r["measured_s"])
        top = res["tune"]["top"]
        pick = res["tune"]["pick"]
        out[stack] = {
            "costs": cost.to_dict(),
            "compute_scale": res["compute_scale"],
            "rows": sorted(grid, key=lambda r: r["measured_s"]),
            "grid_best": best,
            "predicted_best": min(grid, key=lambda r: r["predicted_s"]),
            "tuned": {**tuned, "label": top[pick["index"]]["label"], **res["tune"]},
            "tuner_first": {**first, "label": top[0]["label"]},
            "tuned_vs_grid_best": tuned["measured_s"] / best["measured_s"] - 1,
            "tuner_first_vs_grid_best": first["measured_s"] / best["measured_s"] - 1,
            "tuned_predicted_vs_measured": tuned["predicted_s"] / tuned["measured_s"] - 1,
            "tuned_predicted_vs_selection": tuned["predicted_s"]
            / pick["selection_median_s"][pick["index"]]
            - 1,
            "in_round": _in_round_record(fit, res["tuned"], tuned),
            "split_fit_row": _split_fit_row(res.get("profiled_cost"), res["entries"], ranks),
            "rematch": _rematch(res["rematch"]),
            "twins": res.get("twins", {}),
        }
    return out


def markdown(summary: dict, info: dict, chart: str | None = None) -> str:
    """The report: how the pick is made, the targets' table (and ``chart``, the picture's
    file name, below it), each stack's selection and grid rows (one long list of lines on
    purpose: the report reads top to bottom here)."""
    lines = [
        "# Measured grid vs the tuned pick (CPU, 2 ranks, one thread each)",
        "",
        f"Command: `{info['command']}`; wall time {info['wall_s']:.0f} s; load average "
        f"{info['load_start']:.1f} at start, {info['load_end']:.1f} at end. Times are medians "
        "of interleaved repetitions in one launch; predictions are the simulator's from costs "
        "profiled in the same launch.",
        "",
        f"How the pick is made: the tuner's {info['top']} best predicted candidates (one per "
        f"configuration: reuse, placement, direction, split backward; each in its best "
        f"predicted plan and split) are timed in place in a selection phase of their own (timed "
        f"interleaved steps per candidate: {info['pick_reps']}, after the warm-up; the "
        "slowest rank's time per step; "
        "`megatron_prt.runtime.measured_pick.measured_pick`) and the smallest median wins. "
        "The tuned row is then timed again in the grid's repetitions: the reported time is "
        "held out from the selection. Predicted is the simulator's for the picked plan; "
        "'tuner's first' is the candidate the tuner predicted fastest, timed in the same "
        "repetitions. Held-out rematch: after the grid, the grid's fastest row and the tuned "
        "pick are timed again on their own (the same number of interleaved repetitions): the "
        "grid's best is the smallest of some 45 noisy medians and so biased low in the "
        "repetitions that found it ([Note: held-out rematch] in "
        "`megatron_prt/bench/tuned_grid/grid.py`).",
        "",
        "Two predictions: fitted before the grid (the profiled costs fitted in place to "
        "four reference steps timed in a phase of their own, minutes earlier: what a user "
        "gets before running) and fitted in the grid's rounds (the same fit to the same four "
        "plans' medians as grid rows: 1F1B, every layer its own stage, R=1 loop/bi, R=1 "
        "loop/uni split (the split form's scale: [Note: the split form in place]), even "
        "splits; [Note: in-round fit] in `megatron_prt/bench/tuned_grid/in_round.py`): the "
        "second predicts every other row at the time it was measured, so the host's drift "
        "between phases drops out of it.",
        "",
        "A pick that is a grid configuration itself (the same plan on the same split) is timed "
        "once, as that grid row: two runtimes of one plan measured up to 19% apart in the same "
        "rounds of one launch, 1-8% on a quiet host, which says nothing about the plan "
        "([Note: grid twins] in `megatron_prt/bench/tuned_grid/grid.py`).",
        "",
        _warmth(info.get("warm_steps", 0)),
        "",
        "| stack | grid best (measured) | tuned pick | tuned measured | tuned vs grid best "
        "(target <= +5%) | tuned predicted | predicted vs measured (target within 10%) | "
        "predicted vs the pick's selection median (timed before the grid) | "
        "fitted in the grid's rounds: predicted vs measured | "
        "tuner's first vs grid best | held-out rematch: grid best / tuned ms, tuned vs grid "
        "best | grid rows |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for stack, s in summary.items():
        b, t, r = s["grid_best"], s["tuned"], s["rematch"]
        lines.append(
            f"| {stack} | {b['label']}: {1e3 * b['measured_s']:.2f} ms | {_pick_cell(s)} | "
            f"{1e3 * t['measured_s']:.2f} ms | {s['tuned_vs_grid_best']:+.1%} | "
            f"{1e3 * t['predicted_s']:.2f} ms | {s['tuned_predicted_vs_measured']:+.1%} | "
            f"{s['tuned_predicted_vs_selection']:+.1%} | {_in_round_cell(s['in_round'])} | "
            f"{s['tuner_first_vs_grid_best']:+.1%} | "
            f"{1e3 * r['grid_best_s']:.2f} / "
            f"{1e3 * r['tuned_s']:.2f}, {r['tuned_vs_grid_best']:+.1%} | {len(s['rows'])} |"
        )
    if chart:
        lines += ["", f"![every grid row, predicted against measured, per stack]({chart})"]
    for stack, s in summary.items():
        lines += _selection(stack, s["tuned"])
    for stack, s in summary.items():
        lines += _grid_rows(stack, s)
    return "\n".join(lines) + "\n"


def _split_fit_row(profiled, entries: list, ranks: int) -> str:
    """The report's sentence on which grid row ran the plan the fit's split step ran
    (``stacks.split_reference``, built for the profiled costs, where the grid's rows are
    built for the fitted ones, which may order it otherwise); empty when not known."""
    if profiled is None:
        return ""
    m = entries[0][1].num_microbatches
    timed = split_reference(profiled, ranks, m).compute_only()
    row = next((label for label, plan, _ in entries if plan == timed), None)
    if row is None:
        return " The fit's split step ran a plan no grid row runs (the fitted costs reorder it)."
    return f" The fit's split step ran the plan of grid row {row}."


def _grid_rows(stack: str, s: dict) -> list[str]:
    """A stack's fitted values and every grid row, both predictions against the measured."""
    fit = s["in_round"]
    costs = s["costs"]
    lines = [
        "",
        f"## {stack}: every grid row (fastest measured first)",
        "",
        "Fitted in place before the grid ([Note: compute fitted in place] in "
        "`megatron_prt/tune/measured.py`): traced per-layer times scaled by "
        f"{s['compute_scale']:.3f}, per-message CPU {1e3 * costs.get('p2p_cpu', 0.0):.3f} ms; "
        f"replica latency {1e3 * costs.get('replica_latency', 0.0):.3f} ms; "
        f"message latency {1e3 * costs.get('p2p_latency', 0.0):.3f} ms. "
        + _rows_within(s["rows"], "predicted_s")
        + s.get("split_fit_row", ""),
        "",
    ]
    if fit is not None:
        lines += [
            f"Fitted in the grid's rounds (to {', '.join(fit['references'])}): scale "
            f"{fit['compute_scale']:.3f}, per-message CPU {1e3 * fit['p2p_cpu']:.3f} ms, "
            f"replica latency {1e3 * fit['replica_latency']:.3f} ms. "
            + _rows_within(
                [r for r in s["rows"] if not r["reference"]],
                "in_round_s",
                "Rows other than the ones it was fitted to",
            ),
            "",
        ]
    lines += [
        "| configuration | measured ms | predicted ms | predicted vs measured | "
        "in-round predicted ms | in-round vs measured |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in s["rows"]:
        in_round = r.get("in_round_s")
        cells = ("n/a", "n/a")
        if in_round is not None:
            mark = " (fitted to it)" if r["reference"] else ""
            cells = (f"{1e3 * in_round:.2f}", f"{in_round / r['measured_s'] - 1:+.1%}{mark}")
        lines.append(
            f"| {r['label']} | {1e3 * r['measured_s']:.2f} | {1e3 * r['predicted_s']:.2f} | "
            f"{r['predicted_s'] / r['measured_s'] - 1:+.1%} | {cells[0]} | {cells[1]} |"
        )
    return lines


def _rows_within(rows: list[dict], key: str, which: str = "Rows") -> str:
    """How many rows ``key`` predicts within 10% of their measured median."""
    near = sum(abs(r[key] / r["measured_s"] - 1) <= 0.10 for r in rows if r.get(key))
    return f"{which} predicted within 10%: {near} of {len(rows)}."


def _in_round_record(fit, pick: tuple, tuned: dict) -> dict | None:
    """The in-round fit ([Note: in-round fit] in :mod:`.in_round`): its fitted values, the
    reference rows, whether the pick is one of them, the pick's in-round prediction error."""
    if fit is None:
        return None
    _, plan, counts = pick
    return {
        "compute_scale": fit.scale,
        "p2p_cpu": fit.cost.p2p_cpu,
        "replica_latency": fit.cost.replica_latency,
        "references": [label for label, _, _ in fit.references],
        "pick_is_reference": fit.is_reference(plan, counts),
        "tuned_vs_measured": tuned["in_round_s"] / tuned["measured_s"] - 1,
    }


def _pick_cell(s: dict) -> str:
    """The tuned pick's label; a grid row's twin ([Note: grid twins]) says which row."""
    row = s["twins"].get(TUNED)
    twin = f" (= grid row {row}: same plan and split, timed once)" if row else ""
    return s["tuned"]["label"] + twin


def _in_round_cell(record: dict | None) -> str:
    if record is None:
        return "n/a"
    mark = " (a reference row)" if record["pick_is_reference"] else ""
    return f"{record['tuned_vs_measured']:+.1%}{mark}"


def _rematch(record: dict) -> dict:
    """The held-out rematch ([Note: held-out rematch] in :mod:`.grid`): both medians and
    the tuned pick's over the grid's best."""
    medians = {key: statistics.median(s) for key, s in record["times"].items()}
    best = medians[record["grid_best"]]
    return {
        "grid_best": record["grid_best"],
        "grid_best_s": best,
        "tuned_s": medians[TUNED],
        "tuned_vs_grid_best": medians[TUNED] / best - 1,
    }


def _selection(stack: str, tuned: dict) -> list[str]:
    """The selection phase's table: each candidate's predicted and selection median."""
    pick = tuned["pick"]
    lines = [
        "",
        f"## {stack}: the selection (tuner's top {len(tuned['top'])}, predicted order)",
        "",
        "| # | candidate | predicted ms | selection median ms | picked |",
        "|---:|---|---:|---:|---|",
    ]
    for i, (c, median) in enumerate(zip(tuned["top"], pick["selection_median_s"], strict=True)):
        mark = "yes" if i == pick["index"] else ""
        lines.append(
            f"| {i + 1} | {c['label']} | {1e3 * c['predicted_s']:.2f} | {1e3 * median:.2f} | "
            f"{mark} |"
        )
    return lines


def _chart(out: str, summary: dict) -> str | None:
    """The picture's file name under ``out``, or None where none was drawn (no matplotlib,
    or drawing failed: the launch's numbers still get their report); a picture left from
    an earlier launch is removed then, so the report never sits beside another's."""
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"{NAME}.png")
    try:
        if plot_grid(path, summary):
            return f"{NAME}.png"
    except Exception as exc:  # a broken matplotlib must not cost the launch's report
        print(f"tuned grid: no picture ({type(exc).__name__}: {exc})", file=sys.stderr)
    if os.path.exists(path):
        os.remove(path)
    return None


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    command = " ".join(["python benchmarks/tuned_grid.py", *argv])
    per_rank, info = launch(command, lambda: all_ok(run_local(2, worker, args, deadline_s=1800)))
    summary = summarize(per_rank)
    info.update(top=args.top, pick_reps=args.pick_reps, warm_steps=args.warm_steps)
    chart = _chart(args.out, summary)
    md, _ = write_report(args, NAME, markdown(summary, info, chart), {"stacks": summary}, info)
    print(f"wrote {md} ({info['wall_s']:.0f} s)")
    return 0
