"""Every benchmark report's rendering: markdown tables (:func:`md_table`), the head with the
command and the machine, number formats, the chart of measured vs simulated time and writing
the three outputs (``.md``, ``.png``, ``.json``). torch and matplotlib load only when a
measured section asks for the machine or a chart, so the simulated benchmarks (paper_scale,
partition_memory's planning) use this module without them."""

from __future__ import annotations

import datetime
import json
import os
import platform
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

T = TypeVar("T")


def md_table(header: Sequence[str], align: str, rows: Iterable[Sequence[object]]) -> list[str]:
    """A markdown table: the ``header`` cells, the alignment row (``align`` has one letter per
    column: ``l`` left, ``r`` right) and one line per row of ``rows`` (cells formatted with
    ``str``). Raises ValueError naming the row whose length differs from the header's."""
    if len(align) != len(header):
        raise ValueError(f"align {align!r} has {len(align)} columns, the header {len(header)}")
    rule = {"l": "---", "r": "---:"}
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(rule[a] for a in align) + "|"]
    for i, row in enumerate(rows):
        cells = [str(cell) for cell in row]
        if len(cells) != len(header):
            raise ValueError(f"table row {i} has {len(cells)} cells, the header {len(header)}")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def launch(command: str, measure: Callable[[], T]) -> tuple[T, dict]:
    """``measure()`` and the report's ``info`` around it: :func:`machine`, ``command``, the
    load average at start and end and the wall time."""
    info = {**machine(), "command": command, "load_start": os.getloadavg()[0]}
    start = time.perf_counter()
    result = measure()
    info["wall_s"] = time.perf_counter() - start
    info["load_end"] = os.getloadavg()[0]
    return result, info


def write_report(
    args,
    name: str,
    markdown: str,
    summary: dict,
    info: dict,
    plot: Callable[[str, dict], None] | None = None,
) -> list[str]:
    """``name``.md (``markdown``), .png (``plot(path, summary["rows"])``, none without
    ``plot``) and .json (the machine, the flags and ``summary``) under ``args.out``; returns
    their paths."""
    os.makedirs(args.out, exist_ok=True)
    exts = ("md", "png", "json") if plot is not None else ("md", "json")
    paths = [os.path.join(args.out, f"{name}.{ext}") for ext in exts]
    with open(paths[0], "w") as f:
        f.write(markdown)
    if plot is not None:
        plot(paths[1], summary["rows"])
    with open(paths[-1], "w") as f:
        json.dump({"machine": info, "args": vars(args), **summary}, f, indent=1, default=str)
    return paths


def report_head(title: str, section: str, info: dict) -> list[str]:
    """The title, the command that wrote the report and the machine."""
    return [
        f"# {title}",
        "",
        f"Written by `megatron-prt bench` (section `megatron_prt.bench.{section}`). Command:",
        "",
        "```",
        info["command"],
        "```",
        "",
        machine_md(info),
        "",
    ]


def machine() -> dict:
    """CPU model, core count, torch and Python versions, the date (UTC)."""
    model = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        model = names[0] if names else platform.processor() or model
    except OSError:
        pass
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "torch": _torch_version(),
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def machine_md(info: dict) -> str:
    return (
        f"Machine: {info['cpu']}, {info['cores']} cores; torch {info['torch']}, Python "
        f"{info['python']}; {info['date']}; load average (1 min) {info['load_start']:.2f} at "
        f"start, {info['load_end']:.2f} at end; wall time {info['wall_s']:.0f} s."
    )


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def ratio(row: dict, name: str) -> str:
    return f"{row[name]:.3f}" if name in row else "-"


def _torch_version() -> str:
    import torch  # only the measured sections describe their machine

    return torch.__version__


def replica_cal_md(cal: dict) -> str:
    """One phrase: the two timed points and the fitted latency and bandwidths."""
    (b0, b1), (t0, t1) = cal["bytes"], cal["seconds"]

    def rate(s_per_byte: float) -> str:
        return f"{1e-9 / s_per_byte:.2f} GB/s" if s_per_byte else "free"

    return (
        f"{t0 * 1e3:.3f} ms at {b0 / 2**10:.0f} KiB and {t1 * 1e3:.2f} ms at "
        f"{b1 / 2**20:.2f} MiB per rank, i.e. latency {cal['latency_s'] * 1e3:.3f} ms, "
        f"transfer {rate(cal['wire_s_per_byte'])} each way, add {rate(cal['add_s_per_byte'])}"
    )


def sim_sum_md(row: dict) -> str:
    """Per bi row: the sums' simulated share and what the prediction was without them."""
    tied = row.get("sim_tied_s", 0.0)
    then = f", then the tied embedding sum {ms(tied)} ms," if tied else ""
    return (
        f"{row['label']}: the replica-gradient sum is {ms(row['sim_replica_s'])} ms{then} of "
        f"the simulated {ms(row['sim_s'])} ms, meas/sim {row['median_s'] / row['sim_s']:.3f} "
        f"(leaving {'both sums' if tied else 'the sum'} out: sim {ms(row['sim_no_sum_s'])} "
        f"ms, meas/sim {row['median_s'] / row['sim_no_sum_s']:.3f})"
    )


def plot_panels(
    path: str,
    rows_by_m: dict,
    *,
    color_of: Callable[[dict], str],
    legend: Sequence[tuple[str, str]],
    title: str,
) -> None:
    """One panel per m: median time per row (whiskers: quartiles), simulated time as a
    black diamond; ``legend``: (color, label) pairs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    n = len(rows_by_m)
    labels = [row["key"] for row in next(iter(rows_by_m.values()))]
    height = 2.5 + 0.27 * len(labels)
    fig, axes = plt.subplots(1, n, figsize=(2.6 + 3.4 * n, height), sharey=True, squeeze=False)
    for ax, (m, rows) in zip(axes[0], rows_by_m.items(), strict=True):
        _plot_panel(ax, m, rows, color_of)
    axes[0][0].set_yticks(range(len(labels)), labels, fontsize=7)
    axes[0][0].invert_yaxis()
    handles = [Patch(color=color, label=label) for color, label in legend]
    handles.append(Line2D([], [], marker="D", color="black", linestyle="", label="simulated"))
    fig.legend(handles=handles, loc="lower center", ncol=2, fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.75 / height, 1, 1))  # legend below: about 0.75 inch
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_panel(ax, m, rows: list[dict], color_of: Callable[[dict], str]) -> None:
    for y, row in enumerate(rows):
        if "na" in row:
            ax.text(0, y, " n/a", va="center", fontsize=7)
            continue
        median, (q1, q3) = row["median_s"] * 1e3, (q * 1e3 for q in row["quartiles_s"])
        ax.barh(y, median, color=color_of(row), xerr=[[median - q1], [q3 - median]], capsize=2)
        ax.plot(row["sim_s"] * 1e3, y, marker="D", color="black", markersize=3.5)
    ax.set_xlabel("ms per step (median)")
    ax.set_title(f"m = {m}")
