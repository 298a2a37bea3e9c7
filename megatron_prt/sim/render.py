"""Renderers for a simulated (or measured) timeline: text grid, Chrome trace, PNG.

All take per-rank lists of ``(action, start, end)`` spans so that the simulator's prediction
and the runtime's measured trace draw the same way.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from ..core.actions import Action, Op
from ..core.plan import Plan
from ..core.replay import Timeline

Span = tuple[Action, float, float]


def spans_of(plan: Plan, timeline: Timeline) -> list[list[Span]]:
    return [
        [(a, timeline.start[a], timeline.end[a]) for a in plan.compute_actions(r)]
        for r in range(plan.placement.ranks)
    ]


def ascii_grid(spans: Sequence[Sequence[Span]], width: int = 120) -> str:
    """One row per rank; each action is drawn as wide as its duration and labelled with its
    action string ``<stage><op><mb>`` (``.`` is idle). Time is scaled so the run fits
    ``width`` columns if it can; otherwise every label still fits and the grid is wider."""
    ends = [e for row in spans for _, _, e in row]
    if not ends:
        return "(empty plan)"
    makespan = max(ends)
    shortest = min(e - s for row in spans for _, s, e in row if e > s) or 1.0
    label_w = max(len(str(a)) for row in spans for a, _, _ in row)
    scale = max((width - 6) / makespan, (label_w + 1) / shortest)
    cols = round(makespan * scale)
    lines = []
    for rank, row in enumerate(spans):
        cells = ["."] * cols
        for action, start, end in row:
            a, b = (
                round(start * scale),
                max(round(end * scale), round(start * scale) + 1),
            )
            text = str(action)
            fill = {Op.F: "-", Op.W: "~"}.get(action.op, "=")
            chunk = (text + fill * (b - a))[: b - a - 1] + "|"
            cells[a:b] = list(chunk)
        lines.append(f"r{rank:<3}| " + "".join(cells))
    legend = f"     time 0 .. {makespan:g}; <stage>F<mb>--| forward, <stage>B<mb>==| backward"
    if any(action.op is Op.W for row in spans for action, _, _ in row):
        legend += " (split: <stage>I<mb>==| input-grad, <stage>W<mb>~~| weight-grad)"
    lines.append(legend + ", . idle")
    return "\n".join(lines)


def chrome_trace(
    spans: Sequence[Sequence[Span]], stage_to_chunk=None, unit_us: float = 1e3
) -> dict:
    """Chrome/Perfetto trace: one thread per rank; ``unit_us`` microseconds per time unit."""
    events: list[dict] = []
    for rank, row in enumerate(spans):
        events.append(
            {
                "ph": "M",
                "name": "thread_name",
                "pid": 0,
                "tid": rank,
                "args": {"name": f"rank {rank}"},
            }
        )
        for action, start, end in row:
            args = {"stage": action.stage, "mb": action.mb}
            if stage_to_chunk is not None:
                args["chunk"] = stage_to_chunk[action.stage]
            events.append(
                {
                    "name": str(action),
                    "cat": action.op.value,
                    "ph": "X",
                    "pid": 0,
                    "tid": rank,
                    "ts": start * unit_us,
                    "dur": (end - start) * unit_us,
                    "args": args,
                }
            )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(path: str, spans, stage_to_chunk=None, unit_us: float = 1e3) -> None:
    with open(path, "w") as f:
        json.dump(chrome_trace(spans, stage_to_chunk, unit_us), f)


def write_png(path: str, spans: Sequence[Sequence[Span]], title: str = "", chunks=None) -> None:
    """A timeline picture (needs matplotlib: ``pip install megatron-prt[plot]``).

    Forwards are blue, backwards (B or I) orange, weight-gradient work (W) green; darker
    shades are later chunks; labels are mb ids."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise RuntimeError("PNG output needs matplotlib: pip install 'megatron-prt[plot]'") from exc
    ranks = len(spans)
    makespan = max((e for row in spans for _, _, e in row), default=1.0)
    max_chunk = max(chunks or [0]) + 1 if chunks else 1
    fig, ax = plt.subplots(figsize=(min(24, 4 + makespan * 0.25 + 0.2 * ranks), 0.6 + 0.45 * ranks))
    colormaps = {Op.F: plt.get_cmap("Blues"), Op.W: plt.get_cmap("Greens")}
    oranges = plt.get_cmap("Oranges")
    for rank, row in enumerate(spans):
        for action, start, end in row:
            chunk = chunks[action.stage] if chunks else 0
            shade = 0.35 + 0.5 * (chunk / max(1, max_chunk - 1))
            color = colormaps.get(action.op, oranges)(shade)
            ax.barh(
                rank,
                end - start,
                left=start,
                height=0.8,
                color=color,
                edgecolor="black",
                linewidth=0.3,
            )
            if (end - start) / makespan > 0.012:
                ax.text(
                    (start + end) / 2, rank, str(action.mb), ha="center", va="center", fontsize=7
                )
    ax.set_yticks(range(ranks), [f"rank {r}" for r in range(ranks)])
    ax.invert_yaxis()
    ax.set_xlim(0, makespan)
    ax.set_xlabel("time")
    ax.set_title(title or "pipeline timeline (blue F, orange B; darker = later chunk)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
