"""The layer stack's results: rows per m with their predictions, the two targets, and
the report, chart and data (:func:`write_outputs`)."""

from __future__ import annotations

from dataclasses import asdict
from functools import partial
from itertools import product

from ...sim.cost import CostModel
from ..common import (
    add_measured,
    add_ratios,
    wire_md,
)
from ..report import (
    md_table,
    ms,
    plot_panels,
    ratio,
    replica_cal_md,
    report_head,
    sim_sum_md,
    write_report,
)
from .configs import GLOO, NAME, PRT_TRANSPORT_ARG, SHM, Config, all_configs, baseline_key
from .ranks import cost_models


# -- results -------------------------------------------------------------------------------
def summarize(args, ranks: list[dict]) -> dict:
    """Rows per m (medians, predictions, per-rank peaks) and the two targets."""
    first = ranks[0]
    costs = cost_models(args, first, first["wires"], first["replica"])
    rows = {m: m_rows(m, [r["by_m"][m] for r in ranks], costs) for m in args.microbatches}
    return {
        "layer": asdict(first["layer"]),
        "split_layer": asdict(first["split_layer"]),
        "head": asdict(first["head"]),
        "split_cpu_s": first["split_cpu_s"],
        "wires": first["wires"],
        "replica": first["replica"],
        "rows": rows,
        "sim_target": sim_target(rows),
        "torch_target": torch_target(rows),
    }


def m_rows(m: int, per_rank: list[dict], costs: dict[str, CostModel]) -> list[dict]:
    res = per_rank[0]
    rows = []
    for cfg in all_configs():
        row = {"key": cfg.key, "label": cfg.label, "transport": cfg.transport, "m": m}
        row["family"], row["split"] = cfg.family, cfg.split
        sim = add_measured(row, cfg.key, per_rank, costs[cfg.cost_key])
        if sim is not None:
            row["sim_peak_bytes"] = [r.peak_activation_bytes for r in sim.per_rank]
        if cfg.key in res["grad_gap"]:  # ran, and a torch row with a megatron-prt twin
            row["grad_gap"] = res["grad_gap"][cfg.key]
        rows.append(row)
    by_key = {row["key"]: row for row in rows}
    add_ratios(rows, lambda row: by_key.get(baseline_key(Config(row["label"], row["transport"]))))
    return rows


def sim_target(rows: dict) -> list[dict]:
    """Target 1: PRT's measured speedup over 1F1B >= 0.9 x the simulated speedup."""
    out = []
    for m, m_rows_ in rows.items():
        for row in m_rows_:
            if row["family"] != "prt" or row["label"].startswith("PRT 1F1B"):
                continue
            if "speedup_vs_sim" not in row:
                out.append({"m": m, "key": row["key"], "na": row.get("na", "no baseline")})
                continue
            out.append(
                {
                    "m": m,
                    "key": row["key"],
                    "measured_speedup": 1 / row["vs_1f1b"],
                    "sim_speedup": 1 / row["sim_vs_1f1b"],
                    "ratio": row["speedup_vs_sim"],
                    "met": row["speedup_vs_sim"] >= 0.9,
                }
            )
    return out


TORCH_GOALS = (  # (which PRT rows, the speedup over torch's best they must reach)
    ("any", 1.0),
    ("split backward", 1.10),
)


def torch_target(rows: dict) -> list[dict]:
    """Target 2: PRT's best configuration >= 1.0x torch's best schedule (by time, its
    zero-bubble ones included) at equal or lower peak activation memory (the larger of the
    per-rank peaks), per m; and PRT's best split-backward configuration >= 1.10x. PRT over
    gloo only (same wire) and over any wire."""
    out = []
    for m, m_rows_ in rows.items():
        ran = [row for row in m_rows_ if "na" not in row]
        torch_rows = [row for row in ran if row["family"] == "torch"]
        if not torch_rows:
            continue
        best_torch = min(torch_rows, key=lambda row: row["median_s"])
        budget = max(best_torch["peak_bytes"])
        for (rows_of, goal), wires in product(TORCH_GOALS, ((GLOO,), (GLOO, SHM))):
            fits = [
                row
                for row in ran
                if row["family"] == "prt"
                and (rows_of == "any" or row["split"])
                and row["transport"] in wires
                and max(row["peak_bytes"]) <= budget
            ]
            best = min(fits, key=lambda row: row["median_s"]) if fits else None
            ratio = best_torch["median_s"] / best["median_s"] if best else None
            out.append(
                {
                    "m": m,
                    "prt_rows": rows_of,
                    "goal": goal,
                    "prt_wires": "+".join(wires),
                    "torch_best": best_torch["key"],
                    "torch_ms": best_torch["median_s"] * 1e3,
                    "torch_peak": budget,
                    "prt_best": best["key"] if best else None,
                    "prt_ms": best["median_s"] * 1e3 if best else None,
                    "prt_peak": max(best["peak_bytes"]) if best else None,
                    "ratio": ratio,
                    "met": bool(ratio and ratio >= goal),
                }
            )
    return out


# -- report --------------------------------------------------------------------------------
def _kib(values) -> str:
    return " / ".join(f"{v / 1024:.0f}" for v in values)


def _wire_label(row: dict) -> str:
    if row["family"] == "torch":
        return "gloo"
    return f"{row['transport']} (transport={PRT_TRANSPORT_ARG[row['transport']]})"


TABLE_HEADER = (
    "configuration",
    "wire",
    "measured ms",
    "IQR",
    "vs PRT 1F1B",
    "sim ms",
    "sim vs 1F1B",
    "meas/sim",
    "speedup / sim speedup",
    "peak act KiB r0 / r1",
)


def table_md(rows: list[dict]) -> list[str]:
    cells = []
    for row in rows:
        if "na" in row:
            cells.append((row["label"], _wire_label(row), row["na"], *[""] * 7))
            continue
        ratios = (
            ratio(row, name)
            for name in ("vs_1f1b", "sim_vs_1f1b", "meas_over_sim", "speedup_vs_sim")
        )
        vs_1f1b, sim_vs, meas_sim, speedup = ratios
        cells.append(
            (
                row["label"],
                _wire_label(row),
                ms(row["median_s"]),
                f"{row['iqr_frac'] * 100:.0f}%",
                vs_1f1b,
                ms(row["sim_s"]),
                sim_vs,
                meas_sim,
                speedup,
                _kib(row["peak_bytes"]),
            )
        )
    return md_table(TABLE_HEADER, "ll" + "r" * 8, cells)


def targets_md(summary: dict) -> list[str]:
    lines = [
        "### Target 1: PRT's measured speedup over 1F1B >= 0.9 x the simulated speedup",
        "",
        *md_table(
            ("m", "configuration", "measured speedup", "simulated speedup", "ratio", "met"),
            "rlrrrl",
            (_sim_target_cells(t) for t in summary["sim_target"]),
        ),
    ]
    lines += [
        "",
        "### Target 2: PRT's best >= 1.0 x torch.distributed.pipelining's best (its "
        "zero-bubble schedules included), and PRT's best split-backward row >= 1.10 x, at equal "
        "or lower per-rank peak activation memory",
        "",
        *md_table(
            (
                "m",
                "PRT rows",
                "goal",
                "PRT wires",
                "torch best",
                "ms",
                "peak KiB",
                "PRT best within that peak",
                "ms",
                "peak KiB",
                "torch ms / PRT ms",
                "met",
            ),
            "rlrllrrlrrrl",
            (_torch_target_cells(t) for t in summary["torch_target"]),
        ),
    ]
    return lines


def _sim_target_cells(t: dict) -> tuple:
    if "na" in t:
        return (t["m"], t["key"], t["na"], "", "", "")
    met = "yes" if t["met"] else "no"
    speedups = (f"{t['measured_speedup']:.3f}", f"{t['sim_speedup']:.3f}")
    return (t["m"], t["key"], *speedups, f"{t['ratio']:.3f}", met)


def _torch_target_cells(t: dict) -> tuple:
    prt = (
        (t["prt_best"], f"{t['prt_ms']:.1f}", f"{t['prt_peak'] / 1024:.0f}", f"{t['ratio']:.3f}")
        if t["prt_best"]
        else ("none fits", "", "", "")
    )
    torch_best = (t["torch_best"], f"{t['torch_ms']:.1f}", f"{t['torch_peak'] / 1024:.0f}")
    met = "yes" if t["met"] else "no"
    return (t["m"], t["prt_rows"], f"{t['goal']:.2f}x", t["prt_wires"], *torch_best, *prt, met)


def grad_check_md(rows: list[dict]) -> list[str]:
    gaps = [row["grad_gap"] for row in rows if "grad_gap" in row]
    if not gaps:
        return []
    return [
        "Same computation: each torch schedule's gradients match megatron-prt's (gloo row with "
        f"the same stage split) to a max relative difference of {max(gaps):.1e}.",
        "",
    ]


def replica_sum_md(rows: list[dict]) -> list[str]:
    """Per bi row: the sum as measured inside the timed steps and as simulated."""
    lines = [
        f"* {sim_sum_md(row)} [{row['transport']}]; measured in the timed steps "
        f"(`runtime.reduce_replica_grads()` after `runtime.step`, waiting for the mirrored "
        f"rank included): median {ms(row['replica_sum_s'])} ms."
        for row in rows
        if "sim_replica_s" in row and "replica_sum_s" in row
    ]
    return [*lines, ""] if lines else []


def split_profile_md(summary: dict) -> list[str]:
    """The split-backward profile: I, W and B by CPU time, and the bytes held."""
    full, inp, wgt = summary["split_cpu_s"]
    layer, split, head = summary["layer"], summary["split_layer"], summary["head"]
    return [
        "Split backward, profiled in this launch on each rank's 1F1B stage (one micro-batch, "
        "`measure_split_overhead`: the full backward B and the input gradient I then the "
        "weight gradient W, alternating, medians of this thread's CPU time, mean over "
        f"ranks): B {full * 1e3:.3f} ms, I {inp * 1e3:.3f} ms + W {wgt * 1e3:.3f} ms = "
        f"{(inp + wgt) / full:.3f} x B. The `zb` rows' costs split the traced backward in "
        f"these proportions: per layer I {(split['bwd'] - split['wgrad']) * 1e3:.3f} ms, W "
        f"{split['wgrad'] * 1e3:.3f} ms. Bytes (`measure_split_memory`, counted as the "
        f"meter counts): per layer {layer['act'] / 1024:.0f} KiB from its forward until I, "
        f"{layer['wact'] / 1024:.0f} KiB from I until W (each linear's input and output "
        f"gradient); the loss {head['act'] / 1024:.0f} KiB until I. The `zb` plans are "
        "built under 1F1B's simulated peak with these bytes; `sim peak` shows the "
        "simulator's per-rank prediction.",
    ]


SIDE_HEADER = (
    "m",
    "schedule",
    "wire",
    "median ms",
    "IQR ms",
    "peak act KiB (max rank)",
    "sim peak KiB",
    "speedup over PRT 1F1B: measured",
    "simulated",
    "measured / simulated",
)


def side_by_side_rows(rows: list[dict]) -> list[tuple[str, dict]]:
    """(role, row) per schedule compared: megatron-prt's 1F1B, its best PRT (reuse) row and
    its best split-backward row on each wire, then every torch row that ran."""
    ran = [row for row in rows if "na" not in row]
    picked = []
    for wire in (GLOO, SHM):
        ours = [row for row in ran if row["family"] == "prt" and row["transport"] == wire]
        base = [row for row in ours if row["label"].startswith("PRT 1F1B")]
        reuse = [row for row in ours if not row["split"] and row not in base]
        split = [row for row in ours if row["split"]]
        picked += [("PRT 1F1B", row) for row in base]
        for role, group in (("best PRT", reuse), ("best split backward", split)):
            if group:
                picked.append((role, min(group, key=lambda row: row["median_s"])))
    picked += [("torch", row) for row in ran if row["family"] == "torch"]
    return picked


def side_by_side_md(rows_by_m: dict) -> list[str]:
    cells = []
    for m, rows in rows_by_m.items():
        for role, row in side_by_side_rows(rows):
            q1, q3 = row["quartiles_s"]
            name = row["label"] if role in ("PRT 1F1B", "torch") else f"{role}: {row['label']}"
            speedups = ("", "", "")
            if "vs_1f1b" in row:
                measured, simulated = 1 / row["vs_1f1b"], 1 / row["sim_vs_1f1b"]
                speedups = (f"{measured:.3f}", f"{simulated:.3f}", f"{measured / simulated:.3f}")
            cells.append(
                (
                    m,
                    name,
                    row["transport"],
                    ms(row["median_s"]),
                    f"{ms(q1)}-{ms(q3)}",
                    f"{max(row['peak_bytes']) / 1024:.0f}",
                    f"{max(row.get('sim_peak_bytes') or [0]) / 1024:.0f}",
                    *speedups,
                )
            )
    return [
        "Per m: megatron-prt's 1F1B, its fastest PRT (reuse) row and its fastest "
        "split-backward row, on each wire, and every torch.distributed.pipelining schedule "
        "(gloo). Speedups over megatron-prt's 1F1B on the same wire (torch: gloo); the "
        "target is measured / simulated >= 0.9. sim peak: the simulator's prediction from "
        "the profiled bytes (it counts the input and target per micro-batch, the meter the "
        "whole batch's storage once; torch's rows: what our runtime would hold for their "
        "order).",
        "",
        *md_table(SIDE_HEADER, "rllrrrrrrr", cells),
    ]


def report_md(args, summary: dict, info: dict) -> str:
    layer, wires = summary["layer"], summary["wires"]
    title = "megatron-prt vs torch.distributed.pipelining, measured (CPU): layer stack"
    lines = [
        *report_head(title, "layer_stack", info),
        f"Setup: {args.ranks} gloo ranks (one thread each) on this machine; model "
        f"{args.layers} x (Linear {args.hidden}x{args.hidden} + GELU), fp32, micro-batch "
        f"{args.mb_size}, MSE loss; the same data and stage split for every row; "
        f"{args.warmup} warm-up steps, then {args.reps} repetitions interleaved across all rows "
        "(a seeded shuffle per round: A C B, B A C, ...), median shown; a step's time is the "
        "slowest rank's; gradients are zeroed outside the timed region.",
        "",
        f"Profiled in this launch: per layer forward {layer['fwd'] * 1e3:.3f} ms, backward "
        f"{layer['bwd'] * 1e3:.3f} ms (traced 1F1B steps); per message: gloo "
        f"{wire_md(wires[GLOO])}; shared memory {wire_md(wires[SHM])} ([Note: a hop's time "
        "less its CPU] in `megatron_prt/tune/measured.py`).",
        "",
        *split_profile_md(summary),
        "",
        "Replica-gradient sum (bi), timed in this launch on megatron-prt's runtime for the bi "
        "placement (`time_replica_sync`: barrier, then `reduce_replica_grads()`, median; "
        "of the rank that waited least) with "
        f"this model's gradients and with a {max(4, args.hidden // 8)}-wide model's, fitted as "
        "latency + bytes / transfer rate + bytes / add rate (the add rate from a timed "
        f"`a + b`): gloo {replica_cal_md(summary['replica'][GLOO])}; shared memory "
        f"{replica_cal_md(summary['replica'][SHM])}. The bi rows' predictions include it.",
        "",
    ]
    lines += ["## Side by side", "", *side_by_side_md(summary["rows"]), ""]
    for m, rows in summary["rows"].items():
        lines += [f"## m = {m} micro-batches (P = {args.ranks})", "", *table_md(rows), ""]
        lines += grad_check_md(rows) + replica_sum_md(rows)
    lines += ["## Targets", "", *targets_md(summary), "", *notes_md(), ""]
    return "\n".join(lines)


def notes_md() -> list[str]:
    return [
        "## How to read this",
        "",
        "* wire: `gloo` is torch.distributed point-to-point over loopback TCP, what "
        "torch.distributed.pipelining uses and what megatron-prt uses with "
        '`transport="torch"`; `shm` is megatron-prt\'s shared-memory transport, its CPU '
        'default (`transport="auto"`). Compare torch\'s rows with the gloo rows.',
        "* vs PRT 1F1B: measured time / the time of megatron-prt's R=1 plan (1F1B) over the "
        "same wire (torch's rows: over gloo). Below 1 is faster.",
        "* sim ms: `megatron_prt.sim.simulate` of the plan that ran (torch's schedules: their "
        "compute order converted to a plan; their split backward as I and W of half a "
        "backward each, DualPipeV's overlapped F+B as F then B) under the costs profiled above"
        " (the PRT zb rows: under the split profile, I and W in their CPU-time proportions),"
        " messages included "
        "(latency and CPU of the row's "
        "wire). speedup / sim speedup = (measured speedup over 1F1B) / (simulated speedup).",
        "* peak act: the most activation bytes each rank held for backward during one "
        "untimed step, counted by `megatron_prt.runtime.memory.ActivationMeter` (autograd's "
        "saved tensors by storage, plus the stage inputs and outputs a runtime keeps for "
        "backward), with `PipelineRuntime(measure_memory=True)` for PRT and the same meter "
        "hooked around the PipelineStage forward/backward calls for torch. Buffers that "
        "torch.distributed.pipelining allocates once and keeps between steps (one receive "
        "buffer per micro-batch and stage) are not counted.",
        "* PRT plans are generated from the profiled costs (what a user does after "
        "profiling). PRT wave/bi R=2 holds two weight replicas per rank; its measured time "
        "includes summing the replica gradients (`runtime.reduce_replica_grads()`) and so "
        "does its simulated time (`megatron_prt.sim.replica_sync`: each rank pair starts "
        "once both have finished their backward passes, at the calibrated cost).",
        "* PRT zb rows: megatron-prt's split-backward plan (`core.zerobubble.zero_bubble`: "
        "F/I/W under 1F1B's simulated activation peak, by the profiled bytes held until I "
        "and from I until W) run by the same runtime, which defers every `nn.Linear`'s "
        "weight-gradient GEMM to W (`runtime/wgrad.py`); their peak counts what a stage "
        "holds between I and W (each layer's input and output gradient).",
        "* n/a: the schedule refused the configuration; its own message is shown.",
    ]


COLORS = {("prt", GLOO): "tab:blue", ("prt", SHM): "tab:green", ("torch", GLOO): "tab:orange"}
LEGEND = (
    (COLORS[("prt", GLOO)], "megatron-prt, gloo (transport=torch)"),
    (COLORS[("prt", SHM)], "megatron-prt, shm (transport=auto)"),
    (COLORS[("torch", GLOO)], "torch.distributed.pipelining, gloo"),
)


def write_outputs(args, summary: dict, info: dict) -> list[str]:
    plot = partial(
        plot_panels,
        color_of=lambda row: COLORS[(row["family"], row["transport"])],
        legend=LEGEND,
        title="Layer stack: time per training step on CPU (lower is better)",
    )
    return write_report(args, NAME, report_md(args, summary, info), summary, info, plot)
