"""What both benchmark sections share: timing of interleaved repetitions, a measured row
with its simulated prediction, per-message costs of a wire, the calibration of the bi
replica-gradient sum, the machine description, progress lines, the report's head and the
chart of measured vs simulated time, and writing the three outputs. Runs inside gloo ranks started
by :func:`megatron_prt.runtime.local.run_local`."""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
import torch.distributed as dist

from ..runtime.p2p import ShmTransport
from ..sim.cost import CostModel
from ..sim.simulate import simulate

T = TypeVar("T")


# -- progress ------------------------------------------------------------------------------
def say(message: str) -> None:
    """One progress line on stderr (rank 0 only inside a process group)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"bench: {message}", file=sys.stderr, flush=True)


# -- measuring -----------------------------------------------------------------------------
def timed_step(runner) -> float:
    """One step's wall time: it ends when the slowest rank is done. Gradients are zeroed
    before the clock starts."""
    runner.zero_grad()
    dist.barrier()
    start = time.perf_counter()
    runner.step()
    elapsed = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed)


def interleaved_times(runners: dict, reps: int, label: str = "") -> dict[str, list[float]]:
    """``reps`` rounds over all runners; each round starts one runner later (A B C, B C A,
    ...), so no configuration always runs right after the same other one. A progress line
    every few rounds (``label`` names the section and m)."""
    keys = list(runners)
    times: dict[str, list[float]] = {key: [] for key in keys}
    every = max(1, reps // 4)
    for rep in range(reps):
        shift = rep % len(keys) if keys else 0
        for key in keys[shift:] + keys[:shift]:
            times[key].append(timed_step(runners[key]))
        if (rep + 1) % every == 0 or rep + 1 == reps:
            say(f"{label} repetition {rep + 1}/{reps}")
    return times


def quartiles(samples: Sequence[float]) -> tuple[float, float]:
    """First and third quartile (min and max for fewer than 4 samples)."""
    if len(samples) < 4:
        return min(samples), max(samples)
    q = statistics.quantiles(samples, n=4)
    return q[0], q[2]


def time_summary(samples: list[float]) -> dict:
    """``median_s``, ``quartiles_s``, ``iqr_frac`` (IQR / median) and the samples."""
    median = statistics.median(samples)
    q1, q3 = quartiles(samples)
    return {
        "median_s": median,
        "quartiles_s": (q1, q3),
        "iqr_frac": (q3 - q1) / median,
        "samples_s": samples,
    }


def measure_runners(
    built: dict, args, label: str, check: Callable[[dict], dict] | None = None
) -> dict:
    """Every runner of ``built`` (key -> runner, or the reason it cannot run): ``args.warmup``
    warm-up steps, one metered step, ``args.reps`` interleaved timed repetitions, then
    ``check(runners)`` (more fields of the result) before they close. Per key: ``refused``
    (the reasons), ``times``, ``peak_bytes``, ``plans``, ``wire`` and ``replica_sum_s`` (bi:
    median of the timed steps' sums). A runner has ``step``, ``zero_grad``, ``peak_bytes``,
    ``close``, ``plan``, ``wire`` and ``replica_sum_s``."""
    runners = {key: r for key, r in built.items() if not isinstance(r, str)}
    for runner in runners.values():
        for _ in range(args.warmup):  # shapes exchanged, buffers and allocator primed
            runner.step()
    peaks = {key: runner.peak_bytes() for key, runner in runners.items()}
    times = interleaved_times(runners, args.reps, label)
    checked = check(runners) if check else {}
    for runner in runners.values():
        runner.close()
    return {
        "refused": {key: r for key, r in built.items() if isinstance(r, str)},
        "times": times,
        "peak_bytes": peaks,
        "plans": {key: r.plan for key, r in runners.items()},
        "wire": {key: r.wire for key, r in runners.items()},
        "replica_sum_s": {
            key: statistics.median(r.replica_sum_s[-args.reps :])
            for key, r in runners.items()
            if r.replica_sum_s
        },
        **checked,
    }


def add_measured(row: dict, key: str, per_rank: list[dict], model: CostModel):
    """Fill ``row`` with what the ranks measured for ``key`` (their
    :func:`measure_runners` results) and the simulator's prediction for the plan that ran
    under ``model``; returns the simulation, or ``None`` for a refused configuration (then
    ``row["na"]`` holds the reason)."""
    res = per_rank[0]
    if key in res["refused"]:
        row["na"] = res["refused"][key]
        return None
    row.update(time_summary(res["times"][key]))
    plan = res["plans"][key]
    sim = simulate(plan, model)
    row["sim_s"] = sim.makespan
    if plan.placement.direction == "bi":
        row["sim_replica_s"] = sim.replica_sync_time
        row["sim_replica_bytes"] = [r.replica_bytes for r in sim.per_rank]
        row["sim_no_sum_s"] = simulate(plan, model.without_replica_sync()).makespan
    row["peak_bytes"] = [r["peak_bytes"][key] for r in per_rank]
    row["wire_class"] = res["wire"][key]
    if key in res["replica_sum_s"]:
        row["replica_sum_s"] = max(r["replica_sum_s"][key] for r in per_rank)
    return sim


# -- per-message costs -----------------------------------------------------------------------
def time_wire(rank: int, burst, ping_pong, burst_messages: int) -> tuple[float, float]:
    """Ranks 0 and 1 run ``burst`` (``burst_messages`` sent and received: CPU per message)
    then ``ping_pong`` (latency); others only join the barriers. ``(latency_s, cpu_s)``."""
    dist.barrier()
    if rank > 1:
        dist.barrier()
        return 0.0, 0.0
    cpu0 = time.process_time()
    burst()
    cpu = (time.process_time() - cpu0) / burst_messages
    samples = []
    for _ in range(50):
        start = time.perf_counter()
        ping_pong()
        samples.append((time.perf_counter() - start) / 2)
    dist.barrier()
    return statistics.median(samples), cpu


def shm_costs(rank: int, shape: Sequence[int], burst_size: int) -> tuple[float, float]:
    """(latency, cpu) of one ``shape`` float32 message between ranks 0 and 1 over
    megatron-prt's shared-memory transport (collective over the default group)."""
    peers = {1 - rank} if rank < 2 else set()
    transport = ShmTransport(None, lambda stage: stage, (peers, peers), timeout_s=60)
    tensor = torch.randn(*shape)
    peer = 1 - rank
    counter = iter(range(1 << 30))

    def burst():
        for i in range(burst_size):
            transport.send(("act", rank, peer, i), tensor)
        for i in range(burst_size):
            transport.wait(transport.recv(("act", peer, rank, i)))

    def ping_pong():
        i = next(counter)
        if rank == 0:
            transport.send(("act", 0, 1, i), tensor)
            transport.wait(transport.recv(("act", 1, 0, i)))
        else:
            transport.wait(transport.recv(("act", 0, 1, i)))
            transport.send(("act", 1, 0, i), tensor)

    try:
        return time_wire(rank, burst, ping_pong, 2 * burst_size)
    finally:
        dist.barrier()  # the peer has read everything before the rings go
        transport.close()


def agreed(pair: tuple[float, float]) -> tuple[float, float]:
    """The larger of every rank's values, so every rank builds plans from the same costs."""
    shared = torch.tensor(pair)
    dist.all_reduce(shared, op=dist.ReduceOp.MAX)
    return tuple(shared.tolist())


# -- replica-gradient sum (bi): calibrated by runtime.replica_timing.calibrate_replica_sync ---
def replica_repeats(args) -> int:
    """Timed sums per calibration point: ``--reps``, between 3 and 11."""
    return max(3, min(args.reps, 11))


def replica_cost_fields(cal: dict) -> dict:
    """The ``CostModel`` fields of a calibration
    (:func:`megatron_prt.runtime.replica_timing.calibrate_replica_sync`)."""
    return {
        "replica_latency": cal["latency_s"],
        "replica_bandwidth": 1 / cal["wire_s_per_byte"] if cal["wire_s_per_byte"] else math.inf,
        "replica_add_bandwidth": 1 / cal["add_s_per_byte"] if cal["add_s_per_byte"] else math.inf,
    }


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
    """Per bi row: the sum's simulated share and what the prediction was without it."""
    return (
        f"{row['label']}: the replica-gradient sum is {ms(row['sim_replica_s'])} ms of the "
        f"simulated {ms(row['sim_s'])} ms, meas/sim {row['median_s'] / row['sim_s']:.3f} "
        f"(leaving the sum out: sim {ms(row['sim_no_sum_s'])} ms, meas/sim "
        f"{row['median_s'] / row['sim_no_sum_s']:.3f})"
    )


# -- report --------------------------------------------------------------------------------
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
    args, name: str, markdown: str, summary: dict, info: dict, plot: Callable[[str, dict], None]
) -> list[str]:
    """``name``.md (``markdown``), .png (``plot(path, summary["rows"])``) and .json (the
    machine, the flags and ``summary``) under ``args.out``; returns their paths."""
    os.makedirs(args.out, exist_ok=True)
    paths = [os.path.join(args.out, f"{name}.{ext}") for ext in ("md", "png", "json")]
    with open(paths[0], "w") as f:
        f.write(markdown)
    plot(paths[1], summary["rows"])
    with open(paths[2], "w") as f:
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
        "torch": torch.__version__,
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


def add_ratios(rows: list[dict], baseline_of: Callable[[dict], dict | None]) -> None:
    """Measured and simulated time relative to each row's baseline row (1F1B), and
    measured over simulated; rows without a measurement or baseline get none."""
    for row in rows:
        base = baseline_of(row)
        if "na" in row or base is None or "na" in base:
            continue
        row["vs_1f1b"] = row["median_s"] / base["median_s"]
        row["sim_vs_1f1b"] = row["sim_s"] / base["sim_s"]
        row["meas_over_sim"] = row["median_s"] / row["sim_s"]
        # measured speedup over 1F1B as a fraction of the simulated one
        row["speedup_vs_sim"] = row["sim_vs_1f1b"] / row["vs_1f1b"]


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
