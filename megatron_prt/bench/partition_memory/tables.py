"""partition_memory's step 4: the report's tables and findings, and the simulated levers
and regimes."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import partial

from ...core import Placement
from ...core.placement import ConfigError
from ...tune.partition import DEFAULT_SLACK
from ..report import md_table
from .cases import (
    AGREEMENT_TARGET,
    BALANCE_TARGET,
    LEAST_MEMORY_SLACK,
    MIB,
    REUSES,
    THROUGHPUT_TARGET,
    Bert,
    Config,
    Measured,
    PartitionCase,
    Pick,
    Prediction,
    balanced_config,
    best_by_direction,
    pick_wave,
    placement_label,
    predict,
    profile,
    target_slack,
    uniform_config,
    wave_placements,
)

# -- step 4: report ------------------------------------------------------------------------------
Rows = list[tuple[Config, Prediction, list[Measured]]]


def mib(value: float) -> str:
    return f"{value / MIB:.2f}"


def spread(values: Sequence[float]) -> float:
    """Largest over smallest."""
    return max(values) / min(values)


def layers_text(config: Config) -> str:
    return ",".join(map(str, config.stage_layers))


def measured_rows(case: PartitionCase, measured: dict[Config, list[Measured]]) -> Rows:
    """Each measured configuration once, in the order of ``case.measured()``."""
    seen: dict[Config, Prediction] = dict(case.measured())
    return [(c, p, measured[c]) for c, p in seen.items()]


def per_rank_table(rows: Rows, model_act: float) -> list[str]:
    """One row per (configuration, rank), MiB; *mbs* counts activation peaks in micro-batches
    through the whole model (1F1B's rank 0 holds about 1)."""
    header = (
        "configuration",
        "rank",
        "act pred",
        "act meas",
        "meas/pred",
        "act pred, mbs",
        "state pred",
        "state meas",
        "total pred",
        "total meas",
    )
    cells = [
        (
            config.label,
            rank,
            mib(pred.act[rank]),
            mib(m.act_peak),
            f"{m.act_peak / pred.act[rank]:.3f}",
            f"{pred.act[rank] / model_act:.2f}",
            mib(pred.state[rank]),
            mib(m.state),
            mib(pred.totals[rank]),
            mib(m.total),
        )
        for config, pred, ranks in rows
        for rank, m in enumerate(ranks)
    ]
    return md_table(header, "l" * len(header), cells)


def summary_table(rows: Rows, case: PartitionCase) -> list[str]:
    """One row per configuration: stage layers, time (against the best uniform PRT of its
    direction and of any), largest peaks and balance."""
    f1b_max = case.f1b[1].max_total
    header = (
        "configuration",
        "stage layers",
        "sim makespan s",
        "throughput vs best uniform PRT, same direction",
        "vs best uniform, any direction",
        "max total pred MiB",
        "max/min pred",
        "max total meas MiB",
        "max/min meas",
        "max pred vs 1F1B",
    )
    cells = []
    for config, pred, ranks in rows:
        totals = [m.total for m in ranks]
        same = case.best_makespan(config.placement.direction)
        cells.append(
            (
                config.label,
                layers_text(config),
                f"{pred.makespan:.3f}",
                f"{same / pred.makespan:.3f}",
                f"{case.best_uniform[1].makespan / pred.makespan:.3f}",
                mib(pred.max_total),
                f"{pred.balance:.3f}",
                mib(max(totals)),
                f"{spread(totals):.3f}",
                f"{pred.max_total / f1b_max:.3f}",
            )
        )
    return md_table(header, "l" * len(header), cells)


def worst_deviation(rows: Rows) -> float:
    """Largest |measured / predicted - 1| of an activation peak, any rank and configuration."""
    return max(
        abs(m.act_peak / pred.act[r] - 1.0) for _, pred, ranks in rows for r, m in enumerate(ranks)
    )


def target_cells(pick: Pick, measured, f1b_meas, best_makespan, f1b_max) -> list[tuple]:
    """(value text, met) of the first three targets for one wave + balanced pick."""
    config, pred = pick.balanced
    totals = [m.total for m in measured[config]]
    f1b_meas_max = max(m.total for m in f1b_meas)
    thr = best_makespan / pred.makespan
    return [
        (
            f"{pred.balance:.3f} / {spread(totals):.3f}",
            pred.balance <= BALANCE_TARGET and spread(totals) <= BALANCE_TARGET,
        ),
        (
            f"{mib(pred.max_total)} vs {mib(f1b_max)} / {mib(max(totals))} vs {mib(f1b_meas_max)}",
            pred.max_total < f1b_max and max(totals) < f1b_meas_max,
        ),
        (f"{thr:.3f}", thr >= THROUGHPUT_TARGET),
    ]


def targets_table(
    case: PartitionCase, measured: dict[Config, list[Measured]], rows: Rows
) -> list[str]:
    names = [
        f"per-rank peak (act + state) max/min <= {BALANCE_TARGET} (pred / meas)",
        "max peak below uniform 1F1B's max, MiB (pred / meas)",
        f"simulated throughput >= {THROUGHPUT_TARGET} x best uniform PRT of the same direction "
        f"({'; '.join(case.best[d][0].label for d in case.picks)})",
    ]
    f1b_config, f1b_pred = case.f1b
    columns = [
        target_cells(
            pick, measured, measured[f1b_config], case.best_makespan(d), f1b_pred.max_total
        )
        for d, pick in case.picks.items()
    ]
    labels = [pick.balanced[0].label for pick in case.picks.values()]
    cells = [
        (name, *(f"{col[i][0]}: {'met' if col[i][1] else 'MISSED'}" for col in columns))
        for i, name in enumerate(names)
    ]
    worst = worst_deviation(rows)
    verdict = "met" if worst <= AGREEMENT_TARGET else "MISSED"
    name = (
        f"measured activation peaks within {AGREEMENT_TARGET:.0%} of predicted (worst rank "
        f"of all {len(rows)} configurations)"
    )
    cells.append((name, f"{worst:.2%}: {verdict}", *[""] * (len(labels) - 1)))
    best_any = case.best_uniform
    name = (
        "for comparison: simulated throughput vs the best uniform PRT of any direction "
        f"({best_any[0].label})"
    )
    ratios = (f"{best_any[1].makespan / p.balanced[1].makespan:.3f}" for p in case.picks.values())
    cells.append((name, *ratios))
    return md_table(("target", *labels), "l" * (1 + len(labels)), cells)


def findings(case: PartitionCase, rows: Rows, costs: dict) -> list[str]:
    """Where the memory goes, in numbers from this run (activation peaks in micro-batches
    through the whole model)."""
    model_act = costs["activation_bytes"]
    _, f1b = case.f1b
    top = max(range(len(f1b.totals)), key=lambda r: f1b.totals[r])
    lines = [
        f"- 1F1B's largest rank ({top}) holds {f1b.act[top] / model_act:.2f} micro-batches of "
        f"activations and {mib(f1b.state[top])} MiB of state."
    ]
    for direction, pick in case.picks.items():
        config, pred = pick.balanced
        low = min(pred.act) / model_act
        lines.append(
            f"- {config.label}: activations {low:.2f} to {max(pred.act) / model_act:.2f} "
            f"micro-batches per rank, state {mib(min(pred.state))} to {mib(max(pred.state))} "
            f"MiB" + (" (two weight replicas per rank)." if direction == "bi" else ".")
        )
    empty = [c.label for c, _, _ in rows if _has_pass_through_stage(c)]
    if empty:
        lines.append(
            f"- {', '.join(empty)}: a stage with no layer, embedding or head keeps its input "
            f"(one message, {costs['message_bytes']} bytes) per micro-batch in flight, which "
            "the cost model counts (`CostModel.stage_input_act`)."
        )
    return lines


def _has_pass_through_stage(config: Config) -> bool:
    return any(n == 0 for n in config.stage_layers[1:-1])


def candidate_table(case: PartitionCase) -> list[str]:
    """Every wave + balanced candidate of the picks, simulated."""
    f1b_max = case.f1b[1].max_total
    header = (
        "candidate",
        "stage layers",
        "throughput vs best uniform, same direction",
        "max MiB",
        "max/min",
        "max vs 1F1B",
    )
    cells = [
        (
            config.label,
            layers_text(config),
            f"{case.best_makespan(config.placement.direction) / pred.makespan:.3f}",
            mib(pred.max_total),
            f"{pred.balance:.3f}",
            f"{pred.max_total / f1b_max:.3f}",
        )
        for config, pred in case.wave_candidates
    ]
    return md_table(header, "l" * len(header), cells)


# -- levers (simulated) ---------------------------------------------------------------------------
@dataclass(frozen=True)
class LeverRow:
    placement: Placement
    variant: str
    config: Config | None  # None: no partition meets the variant's condition
    pred: Prediction | None
    note: str = ""


def lever_placements(ranks: int) -> list[Placement]:
    return [
        Placement(ranks, r, p, d) for r in REUSES for p in ("loop", "wave") for d in ("uni", "bi")
    ]


def lever_rows(
    costs: dict, ranks: int, microbatches: int, best: dict[str, float], f1b_max: float
) -> list[LeverRow]:
    """Per placement (R, loop/wave, uni/bi): the partitioner at slack 3%, 10%, 30%, at any
    speed, at the slack that just meets the throughput target, and with 1F1B's largest
    per-rank peak as a memory budget (fastest partition within it). ``best``: the best
    uniform PRT makespan per direction."""
    rows = []
    for placement in lever_placements(ranks):
        best_makespan = best[placement.direction]
        make = partial(balanced_config, costs, placement, microbatches)
        variants = [(f"slack {s:.0%}", partial(make, slack=s)) for s in (DEFAULT_SLACK, 0.1, 0.3)]
        variants.append(("any speed", partial(make, slack=LEAST_MEMORY_SLACK)))
        slack = target_slack(costs, placement, microbatches, best_makespan / THROUGHPUT_TARGET)
        if slack >= 0:
            variants.append((f"slack {slack:.1%} (throughput target)", partial(make, slack=slack)))
        else:
            fastest = THROUGHPUT_TARGET * (1 + slack)  # throughput of the fastest partition
            note = f"unreachable: the fastest partition found reaches {fastest:.3f}"
            rows.append(LeverRow(placement, "throughput target", None, None, note))
        variants.append(("budget = 1F1B max", partial(make, budget_bytes=f1b_max)))
        rows += [_lever_row(costs, placement, microbatches, v, build) for v, build in variants]
    return rows


def _lever_row(costs, placement, microbatches, variant, build) -> LeverRow:
    try:
        config = build()
    except ConfigError as exc:  # the budget is out of reach: say what is reachable
        return LeverRow(placement, variant, None, None, str(exc).split(" (rank")[0])
    return LeverRow(placement, variant, config, predict(costs, config, microbatches))


def lever_table(rows: Sequence[LeverRow], best: dict[str, float], f1b_max: float) -> list[str]:
    header = (
        "placement",
        "partition",
        "stage layers",
        "throughput vs best uniform, same direction",
        "max MiB",
        "max/min",
        "max vs 1F1B",
    )
    cells = []
    for row in rows:
        where = placement_label(row.placement)
        if row.config is None:
            cells.append((where, row.variant, row.note, "", "", "", ""))
            continue
        pred = row.pred
        cells.append(
            (
                where,
                row.variant,
                layers_text(row.config),
                f"{best[row.placement.direction] / pred.makespan:.3f}",
                mib(pred.max_total),
                f"{pred.balance:.3f}",
                f"{pred.max_total / f1b_max:.3f}",
            )
        )
    return md_table(header, "l" * len(header), cells)


def lever_findings(rows: Sequence[LeverRow], best: dict[str, float], f1b_max: float) -> list[str]:
    """What the levers reach, in three lines."""
    done = [r for r in rows if r.config is not None]

    def thr(row):
        return best[row.placement.direction] / row.pred.makespan

    def name(row):
        return f"{placement_label(row.placement)} at {row.variant}"

    fast = [r for r in done if thr(r) >= THROUGHPUT_TARGET]
    small = [r for r in done if r.pred.max_total < f1b_max]
    all_three = [r for r in fast if r in small and r.pred.balance <= BALANCE_TARGET]
    lines = [f"- Rows meeting all three simulated targets: {len(all_three)}"]
    lines[-1] += (": " + "; ".join(name(r) for r in all_three) + ".") if all_three else "."
    if small:
        fastest = max(small, key=thr)
        lines.append(
            f"- Fastest partition below 1F1B's max: {name(fastest)}, throughput "
            f"{thr(fastest):.3f} of the best uniform PRT of its direction, max "
            f"{fastest.pred.max_total / f1b_max:.3f} x 1F1B."
        )
    if fast:
        least = min(fast, key=lambda r: r.pred.max_total)
        lines.append(
            f"- Least memory at >= {THROUGHPUT_TARGET} throughput: {name(least)}, max "
            f"{least.pred.max_total / f1b_max:.3f} x 1F1B, max/min {least.pred.balance:.3f}."
        )
    return lines


# -- regimes: other micro-batch sizes and counts (simulated) --------------------------------------
@dataclass(frozen=True)
class Regime:
    """One shape and micro-batch count, simulated: 1F1B's prediction, the best uniform PRT
    makespan (s), and per direction the :func:`pick_wave` choice at the default slack and
    the least-memory wave partition at the throughput target (None: unreachable)."""

    model: Bert
    microbatches: int
    layer_act_per_param: float
    f1b: Prediction
    best_makespan: dict[str, float]  # per direction
    picked: dict[str, tuple[Config, Prediction]]
    least: dict[str, tuple[Config, Prediction] | None]


def regimes(model: Bert, ranks: int, shapes: Sequence[tuple[int, int, int]], base_costs):
    """(seq, mbs, m) each; shapes other than ``model``'s are profiled with 2 layers."""
    out = []
    for seq, mbs, microbatches in shapes:
        shape = replace(model, seq=seq, mbs=mbs)
        costs = base_costs if shape == model else profile(shape, reps=2, profile_layers=2)
        out.append(_regime(shape, costs, ranks, microbatches))
    return out


def _regime(model: Bert, costs: dict, ranks: int, microbatches: int) -> Regime:
    f1b = uniform_config(Placement(ranks, 1, "loop", "uni"), len(costs["layers"]))
    best = {d: cp[1].makespan for d, cp in best_by_direction(costs, ranks, microbatches).items()}
    picked, least = {}, {}
    for direction in ("uni", "bi"):
        yardstick = best[direction]
        default, targeted = [], []
        for placement in [p for p in wave_placements(ranks) if p.direction == direction]:
            config = balanced_config(costs, placement, microbatches)
            default.append((config, predict(costs, config, microbatches)))
            slack = target_slack(costs, placement, microbatches, yardstick / THROUGHPUT_TARGET)
            if slack >= 0:
                config = balanced_config(costs, placement, microbatches, slack=slack)
                targeted.append((config, predict(costs, config, microbatches)))
        picked[direction] = pick_wave(default, yardstick)
        fast = [cp for cp in targeted if yardstick / cp[1].makespan >= THROUGHPUT_TARGET]
        least[direction] = min(fast, key=lambda cp: cp[1].max_total) if fast else None
    layer = costs["layers"][-1]
    return Regime(
        model,
        microbatches,
        layer["act"] / layer["param"],
        predict(costs, f1b, microbatches),
        best,
        picked,
        least,
    )


def regime_table(found: Sequence[Regime]) -> list[str]:
    header = (
        "seq",
        "mbs",
        "m",
        "layer act/param",
        "1F1B max MiB",
        "wave pick (slack 3%)",
        "throughput",
        "max/min",
        "max vs 1F1B",
        "least memory at the throughput target",
        "throughput",
        "max/min",
        "max vs 1F1B",
    )
    lines = []
    for regime in found:
        for direction in ("uni", "bi"):
            cells = [
                str(regime.model.seq),
                str(regime.model.mbs),
                str(regime.microbatches),
                f"{regime.layer_act_per_param:.2f}",
                mib(regime.f1b.max_total),
            ]
            for choice in (regime.picked[direction], regime.least[direction]):
                cells += _regime_cells(regime.best_makespan[direction], regime, choice)
            lines.append(cells)
    return md_table(header, "l" * len(header), lines)


def _regime_cells(best_makespan: float, regime: Regime, choice) -> list[str]:
    if choice is None:
        return ["unreachable", "", "", ""]
    config, pred = choice
    return [
        config.label.removesuffix(" balanced"),
        f"{best_makespan / pred.makespan:.3f}",
        f"{pred.balance:.3f}",
        f"{pred.max_total / regime.f1b.max_total:.3f}",
    ]


def inflight(depth: int, microbatches: int) -> float:
    """Micro-batches held through the whole model, summed over a 1F1B-shaped pipeline of
    ``depth`` equal stages: stage s keeps min(m, depth - s) in flight, each 1/depth of it."""
    return sum(min(microbatches, depth - s) for s in range(depth)) / depth


def inflight_reading(ranks: int, microbatches: int) -> list[str]:
    """Why the number of micro-batches decides whether PRT can go below 1F1B's peak."""
    header = (
        "m",
        "1F1B total",
        "1F1B rank 0",
        "R=2 total",
        "R=2 per rank (mean)",
        "R=4 per rank (mean)",
    )
    cells = []
    for m in sorted({microbatches, ranks, 2 * ranks, 4 * ranks}):
        f1b, r2, r4 = (inflight(r * ranks, m) for r in (1, 2, 4))
        per_rank = (f"{min(m, ranks) / ranks:.2f}", f"{r2:.2f}", f"{r2 / ranks:.2f}")
        cells.append((m, f"{f1b:.2f}", *per_rank, f"{r4 / ranks:.2f}"))
    rows = md_table(header, "l" * len(header), cells)
    return [
        "Why the number of micro-batches decides it: in a pipeline of D equal stages run "
        "1F1B-style, stage s keeps min(m, D - s) micro-batches in flight, each through 1/D of "
        "the model. Summed, in micro-batches through the whole model (equal stages, no "
        f"embedding or head; P = {ranks}):",
        "",
        *rows,
        "",
        "1F1B's rank 0 holds min(m, P)/P of a model's activations and sets 1F1B's max. With "
        "m >= 2P the equal-stage mean per rank of a uni PRT pipeline (D = R x P stages) is "
        "above that, so a partition under 1F1B's max must shift layers onto the late stages "
        "(fewer micro-batches in flight) and pay in time, within the slack at best (the "
        "regimes table). With m <= P, R=2's mean per rank is below 1F1B's rank 0: a balanced "
        "partition sits below 1F1B's max at full speed, the regime where PRT's memory "
        "balance pays.",
    ]
