"""The tuned grid's picture: per stack, every grid row's predicted time (fitted before the
grid) against its measured median, with the band the prediction target allows (10%), the
line the pick target allows (5% over the grid's best) and the tuned pick marked, so both
targets read at a glance (the report's tables give the numbers)."""

from __future__ import annotations

PICK_TARGET, PREDICTION_TARGET = 0.05, 0.10


def plot_grid(path: str, summary: dict) -> bool:
    """Write ``path`` (PNG): one panel per stack of ``summary`` (as
    :func:`megatron_prt.bench.tuned_grid.summarize` returns it). Returns False, writing
    nothing, where matplotlib is not installed (``pip install megatron-prt[plot]``)."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stacks = list(summary)
    fig, axes = plt.subplots(1, len(stacks), figsize=(4.3 * len(stacks), 4.6), squeeze=False)
    for ax, stack in zip(axes[0], stacks, strict=True):
        _panel(ax, stack, summary[stack])
    axes[0][0].legend(fontsize=7, loc="upper left")
    fig.suptitle(
        "Tuned pick against the measured grid (predicted: fitted before the grid)", fontsize=10
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _panel(ax, stack: str, s: dict) -> None:
    """One stack: rows as points (plain and split backward apart), x = measured ms,
    y = predicted ms."""
    rows, best, tuned = s["rows"], s["grid_best"], s["tuned"]
    times = [1e3 * r[key] for r in (*rows, tuned) for key in ("measured_s", "predicted_s")]
    low, high = 0.93 * min(times), 1.07 * max(times)
    edge = [low, high]
    ax.fill_between(
        edge,
        [(1 - PREDICTION_TARGET) * x for x in edge],
        [(1 + PREDICTION_TARGET) * x for x in edge],
        color="0.9",
        label="predicted within 10%",
    )
    ax.plot(edge, edge, color="0.6", linewidth=0.8)
    for split, color in ((False, "tab:blue"), (True, "tab:orange")):
        mine = [r for r in rows if (" split" in r["label"]) == split]
        ax.scatter(
            [1e3 * r["measured_s"] for r in mine],
            [1e3 * r["predicted_s"] for r in mine],
            s=12,
            color=color,
            label="grid rows, split backward" if split else "grid rows",
        )
    ax.axvline(
        1e3 * (1 + PICK_TARGET) * best["measured_s"],
        color="tab:green",
        linestyle="--",
        linewidth=0.8,
        label="grid's best + 5%",
    )
    marks = (
        (best, {"s": 90, "facecolors": "none", "edgecolors": "tab:green", "label": "grid's best"}),
        (tuned, {"s": 140, "marker": "*", "color": "tab:red", "label": "tuned pick"}),
    )
    for row, style in marks:
        ax.scatter(1e3 * row["measured_s"], 1e3 * row["predicted_s"], **style)
    ax.set_xlim(low, high)
    ax.set_ylim(low, high)
    ax.set_title(
        f"{stack}: pick {s['tuned_vs_grid_best']:+.1%} of the best, "
        f"predicted {s['tuned_predicted_vs_measured']:+.1%}",
        fontsize=9,
    )
    ax.set_xlabel("measured ms per step (median)", fontsize=8)
    ax.set_ylabel("predicted ms per step", fontsize=8)
    ax.tick_params(labelsize=7)
