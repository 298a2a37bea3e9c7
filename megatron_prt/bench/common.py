"""What the measured benchmark sections share: timing of interleaved repetitions, a measured
row with its simulated prediction, per-message costs of a wire, the cost fields of the bi
replica-gradient sum's calibration, progress lines. Runs inside gloo ranks started by
:func:`megatron_prt.runtime.local.run_local`; the report side is :mod:`.report`."""

from __future__ import annotations

import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
import torch.distributed as dist

from ..runtime.measured_pick import slowest_step_seconds
from ..runtime.p2p import ShmTransport
from ..sim.cost import CostModel
from ..sim.simulate import simulate
from ..tune.measured import hop_in_flight, interleaved_rounds

T = TypeVar("T")


# -- progress ------------------------------------------------------------------------------
def say(message: str) -> None:
    """One progress line on stderr (rank 0 only inside a process group)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"bench: {message}", file=sys.stderr, flush=True)


# -- measuring -----------------------------------------------------------------------------
def timed_step(runner, warm_steps: int = 0) -> float:
    """One step's wall time: it ends when the slowest rank is done (gradients zeroed before
    the clock starts; ``warm_steps`` untimed steps of ``runner`` first;
    :func:`~megatron_prt.runtime.measured_pick.slowest_step_seconds`)."""
    return slowest_step_seconds(runner, warm_steps=warm_steps)


def interleaved_times(
    runners: dict, reps: int, label: str = "", warm_steps: int = 0
) -> dict[str, list[float]]:
    """``reps`` rounds over all runners, each in its own seeded shuffled order
    (:func:`~megatron_prt.tune.measured.interleaved_rounds`: the same on every rank), so no
    configuration always runs right after the same other one; each timed step after
    ``warm_steps`` untimed ones of its runner ([Note: warm timed steps] in
    :mod:`megatron_prt.runtime.measured_pick`). A progress line every few rounds (``label``
    names the section and m)."""
    keys = list(runners)
    times: dict[str, list[float]] = {key: [] for key in keys}
    every = max(1, reps // 4)
    for rep, order in enumerate(interleaved_rounds(len(keys), reps)):
        for i in order:
            times[keys[i]].append(timed_step(runners[keys[i]], warm_steps))
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
    built: dict,
    args,
    label: str,
    check: Callable[[dict, dict], dict] | None = None,
    warm_steps: int = 0,
) -> dict:
    """Every runner of ``built`` (key -> runner, or the reason it cannot run): ``args.warmup``
    warm-up steps, one metered step, ``args.reps`` interleaved timed repetitions (each after
    ``warm_steps`` untimed steps of its runner: :func:`interleaved_times`), then
    ``check(runners, times)`` (more fields of the result) before they close. Per key:
    ``refused`` (the reasons), ``times``, ``peak_bytes``, ``plans``, ``wire`` and
    ``replica_sum_s`` (bi: median of the sums of the timed rounds' steps, warm steps
    included; not ``check``'s). A runner has ``step``, ``zero_grad``, ``peak_bytes``,
    ``close``, ``plan``, ``wire`` and ``replica_sum_s``."""
    runners = {key: r for key, r in built.items() if not isinstance(r, str)}
    for runner in runners.values():
        for _ in range(args.warmup):  # shapes exchanged, buffers and allocator primed
            runner.step()
    peaks = {key: runner.peak_bytes() for key, runner in runners.items()}
    times = interleaved_times(runners, args.reps, label, warm_steps)
    sums = {  # before check, whose steps (a rematch) would enter the last rounds' slice
        key: statistics.median(r.replica_sum_s[-args.reps * (1 + warm_steps) :])
        for key, r in runners.items()
        if r.replica_sum_s
    }
    checked = check(runners, times) if check else {}
    for runner in runners.values():
        runner.close()
    return {
        "refused": {key: r for key, r in built.items() if isinstance(r, str)},
        "times": times,
        "peak_bytes": peaks,
        "plans": {key: r.plan for key, r in runners.items()},
        "wire": {key: r.wire for key, r in runners.items()},
        "replica_sum_s": sums,
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
    row["sim_tied_s"] = sim.tied_sync_time  # the tied embedding sum (tied models), every row
    row["split_backward"] = plan.split_backward  # the plan that ran has I and W actions
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
    then ``ping_pong`` (one-way time); others only join the barriers. ``(one_way_s, cpu_s)``:
    the one-way time holds both ends' CPU, :func:`wire_fields` takes it out."""
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
    """(one_way_s, cpu_s) of one ``shape`` float32 message between ranks 0 and 1 over
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


def wire_fields(wire: tuple[float, float]) -> dict[str, float]:
    """The cost model's message fields of a wire timed by :func:`time_wire`, ``(one_way_s,
    cpu_s)``: the CPU per end, and as latency what is left of the one-way time once both
    ends' CPU is out ([Note: a hop's time less its CPU] in :mod:`megatron_prt.tune.measured`)."""
    one_way, cpu = wire
    return {"p2p_latency": hop_in_flight(one_way, cpu), "p2p_cpu": cpu}


def wire_md(wire: tuple[float, float]) -> str:
    """A wire's timing in words, for the reports: one way, CPU per end, in flight."""
    fields = wire_fields(wire)
    return (
        f"one way {wire[0] * 1e3:.3f} ms, CPU {wire[1] * 1e3:.3f} ms per end, so "
        f"{fields['p2p_latency'] * 1e3:.3f} ms in flight"
    )


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
