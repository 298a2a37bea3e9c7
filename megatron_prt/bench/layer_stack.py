"""Layer-stack section of ``megatron-prt bench``: PRT side by side with 1F1B and
torch.distributed.pipelining (CPU, one thread per rank).

One launch of P gloo ranks runs every configuration on the same model (an MLP layer stack),
the same data and the same stage split: megatron-prt's PRT schedules (R=1 is 1F1B) over
gloo (``transport="torch"``) and over shared memory (``transport="auto"``, the CPU default),
and torch.distributed.pipelining's Schedule1F1B, ScheduleInterleaved1F1B (2 and 4 stages per
rank), ScheduleLoopedBFS and ScheduleZBVZeroBubble (gloo). Repetitions are interleaved
(A B C, B C A, ...) and reported as medians; torch's gradients are checked against
megatron-prt's for the same stage split. Next to each measurement: the simulator's
prediction for the plan that ran (torch's schedules converted to plans) from per-layer costs,
per-message costs and (bi) the replica-gradient sum's cost, all profiled in the same launch
(:func:`replica_calibration`), and each rank's peak activation bytes
held for backward, counted by megatron_prt.runtime.memory.ActivationMeter on a separate,
untimed step. :func:`run` writes ``vs_torch_pipelining.{md,png,json}`` under ``args.out``.
"""

from __future__ import annotations

import inspect
import statistics
import time
from dataclasses import asdict, dataclass
from functools import partial

import torch
import torch.distributed as dist
import torch.distributed.pipelining as pipelining
from torch.nn.functional import mse_loss

from ..core import Placement, build_plan
from ..core.actions import Action, Op
from ..core.placement import ConfigError
from ..core.plan import Plan
from ..core.schedules import one_f_one_b
from ..runtime import PipelineRuntime, build_stages, sync_replicas
from ..runtime.cpu import keep_freed_memory
from ..runtime.local import all_ok, run_local
from ..runtime.memory import ActivationMeter
from ..runtime.replica_timing import calibrate_replica_sync
from ..sim.cost import CostModel, LayerCost
from .common import (
    add_measured,
    add_ratios,
    agreed,
    launch,
    measure_runners,
    ms,
    plot_panels,
    ratio,
    replica_cal_md,
    replica_cost_fields,
    replica_repeats,
    report_head,
    say,
    shm_costs,
    sim_sum_md,
    time_wire,
    write_report,
)

NAME = "vs_torch_pipelining"
GLOO, SHM = "gloo", "shm"
PRT_TRANSPORT_ARG = {GLOO: "torch", SHM: "auto"}  # PipelineRuntime(transport=...)


# -- configurations ----------------------------------------------------------------------
@dataclass(frozen=True)
class Config:
    """One row of the table. ``schedule``: a torch.distributed.pipelining class name, or ""
    for megatron-prt; ``reuse``/``placement``/``direction`` give the stage split (for torch:
    stages per rank, ``loop`` for interleaved and looped BFS, ``wave`` = V-shape for ZBV)."""

    label: str
    transport: str  # GLOO or SHM: the wire between ranks
    reuse: int = 1
    placement: str = "loop"
    direction: str = "uni"
    schedule: str = ""

    @property
    def family(self) -> str:
        return "torch" if self.schedule else "prt"

    @property
    def key(self) -> str:
        return f"{self.label} [{self.transport}]"

    def placement_for(self, ranks: int) -> Placement:
        return Placement(ranks, self.reuse, self.placement, self.direction)


PRT_VARIANTS = (  # (label, reuse, placement, direction)
    ("PRT 1F1B (R=1)", 1, "loop", "uni"),
    ("PRT loop R=2", 2, "loop", "uni"),
    ("PRT loop R=4", 4, "loop", "uni"),
    ("PRT wave R=2", 2, "wave", "uni"),
    ("PRT wave R=4", 4, "wave", "uni"),
    ("PRT wave/bi R=2", 2, "wave", "bi"),
)
TORCH_SCHEDULES = (  # (class name, stages per rank, placement of those stages)
    ("Schedule1F1B", 1, "loop"),
    ("ScheduleInterleaved1F1B", 2, "loop"),
    ("ScheduleLoopedBFS", 2, "loop"),
    ("ScheduleZBVZeroBubble", 2, "wave"),
    ("ScheduleInterleaved1F1B", 4, "loop"),  # torch's answer to PRT loop R=4
)


def all_configs() -> list[Config]:
    prt = [
        Config(label, transport, reuse, placement, direction)
        for transport in (GLOO, SHM)
        for label, reuse, placement, direction in PRT_VARIANTS
    ]
    torch_side = [
        Config(f"torch {name} ({reuse}/rank)", GLOO, reuse, placement, schedule=name)
        for name, reuse, placement in TORCH_SCHEDULES
    ]
    return prt + torch_side


def baseline_key(cfg: Config) -> str:
    """Every row is compared with megatron-prt's 1F1B over the same wire."""
    return Config(PRT_VARIANTS[0][0], cfg.transport).key


# -- model and data ----------------------------------------------------------------------
def layer_maker(hidden: int):
    def make(i: int) -> torch.nn.Module:
        torch.manual_seed(i)  # layer i is the same on every rank and for every schedule
        return torch.nn.Sequential(torch.nn.Linear(hidden, hidden), torch.nn.ReLU())

    return make


def batch(args, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole batch of ``m`` micro-batches. Both sides get views of these two tensors
    (torch's schedules split the batch into views), so the input and the target count alike
    in the activation meter (one storage each, at full size, while any micro-batch saves it)."""
    gen = torch.Generator().manual_seed(1000 + m)
    x = torch.randn(m * args.mb_size, args.hidden, generator=gen)
    y = torch.randn(m * args.mb_size, args.hidden, generator=gen)
    return x, y


# -- runners: one configuration built on this rank ------------------------------------------
class PrtRunner:
    """megatron-prt's PipelineRuntime running its 1F1B plan (R=1) or a PRT plan generated
    from the profiled costs."""

    def __init__(self, cfg: Config, rank: int, world: int, args, m: int, cost: CostModel):
        self.placement = cfg.placement_for(world)
        # R=1 is the baseline: megatron-prt's 1F1B (PipeDream-Flush), not a PRT search
        schedule = "1f1b" if self.placement.chunks_per_rank == 1 else "prt"
        times = cost.stage_times(self.placement)
        self.plan = build_plan(self.placement, m, schedule, times=times)
        self.cfg = cfg
        self.modules = build_stages(self.placement, rank, layer_maker(args.hidden), args.layers)
        sync_replicas(self.placement, self.modules)
        self.runtime = PipelineRuntime(
            self.plan, self.modules, mse_loss, transport=PRT_TRANSPORT_ARG[cfg.transport]
        )
        self.wire = type(self.runtime.transport).__name__  # what "auto" really chose
        self.replica_sum_s: list[float] = []  # bi: time spent summing replica gradients
        x, y = batch(args, m)
        self.xs, self.ys = list(x.tensor_split(m)), list(y.tensor_split(m))

    def zero_grad(self) -> None:
        for module in self.modules.values():
            module.zero_grad(set_to_none=True)

    def step(self) -> None:
        self.runtime.step(self.xs, self.ys)
        if self.placement.direction == "bi":  # part of a bi training step: sum the replicas
            start = time.perf_counter()
            self.runtime.reduce_replica_grads()  # over the runtime's own transport
            self.replica_sum_s.append(time.perf_counter() - start)

    def peak_bytes(self) -> int:
        self.zero_grad()
        self.runtime.measure_memory = True
        try:
            self.step()
        finally:
            self.runtime.measure_memory = False
        return self.runtime.memory_peak()

    def close(self) -> None:
        self.runtime.close()


class TorchRunner:
    """A torch.distributed.pipelining schedule over PipelineStage objects holding the same
    stage modules megatron-prt builds for the same placement."""

    def __init__(self, cfg: Config, rank: int, world: int, args, m: int):
        placement = cfg.placement_for(world)
        self.cfg = cfg
        self.modules = build_stages(placement, rank, layer_maker(args.hidden), args.layers)
        self.stages = [
            pipelining.PipelineStage(module, index, placement.depth, torch.device("cpu"))
            for index, module in sorted(self.modules.items())
        ]
        schedule_cls = getattr(pipelining, cfg.schedule)
        held = self.stages[0] if len(self.stages) == 1 else self.stages
        self.schedule = schedule_cls(held, m, loss_fn=mse_loss)  # may refuse: ValueError
        self.plan = torch_plan(self.schedule, placement, m)
        self.wire = dist.get_backend()
        self.replica_sum_s: list[float] = []
        x, y = batch(args, m)
        self.inputs = (x,) if any(s.is_first for s in self.stages) else ()
        self.target = y if any(s.is_last for s in self.stages) else None

    def zero_grad(self) -> None:
        for module in self.modules.values():
            module.zero_grad(set_to_none=True)

    def step(self) -> None:
        self.schedule.step(*self.inputs, target=self.target, return_outputs=False)

    def peak_bytes(self) -> int:
        self.zero_grad()
        params = [p for module in self.modules.values() for p in module.parameters()]
        meter = ActivationMeter(params)
        owner: list = [None]  # the (stage, mb) whose forward ran last: the loss belongs to it
        for stage in self.stages:
            meter_stage(stage, meter, owner)
        try:
            with meter.saving_for(lambda: owner[0]):
                self.step()
        finally:
            for stage in self.stages:
                unmeter_stage(stage)
        return meter.peak_bytes

    def close(self) -> None:
        pass


_METERED = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")


def meter_stage(stage, meter: ActivationMeter, owner: list) -> None:
    """Count what one PipelineStage holds for backward as megatron-prt's executor counts its
    own: autograd's saved tensors of (stage, mb) plus the stage input and output it keeps
    (``fwd_cache``), released when the backward (or, split, the weight backward) has run."""
    forward, backward, weight = (getattr(stage, name) for name in _METERED)
    full_flag = inspect.signature(backward).parameters["full_backward"].default

    def metered_forward(mb, *args, **kwargs):
        owner[0] = (stage.stage_index, mb)
        out = forward(mb, *args, **kwargs)
        outputs, inputs = stage.fwd_cache[mb]
        for tensor in (*outputs, *inputs):
            if isinstance(tensor, torch.Tensor):
                meter.hold(owner[0], tensor)
        return out

    def metered_backward(mb, *args, **kwargs):
        backward(mb, *args, **kwargs)
        if kwargs.get("full_backward", full_flag):
            meter.release((stage.stage_index, mb))

    def metered_weight(mb, *args, **kwargs):
        weight(mb, *args, **kwargs)
        meter.release((stage.stage_index, mb))

    for name, fn in zip(_METERED, (metered_forward, metered_backward, metered_weight), strict=True):
        setattr(stage, name, fn)  # an instance attribute shadows the method


def unmeter_stage(stage) -> None:
    for name in _METERED:
        stage.__dict__.pop(name, None)


_TORCH_OPS = {"F": Op.F, "B": Op.B, "I": Op.I, "W": Op.W}


def torch_plan(schedule, placement: Placement, m: int) -> Plan:
    """The compute order a torch schedule runs, as a megatron-prt plan for the simulator.
    Schedule1F1B's reported order mislabels micro-batches (torch 2.13), but it executes
    PipeDream-Flush 1F1B, which is megatron-prt's ``one_f_one_b``."""
    if isinstance(schedule, pipelining.Schedule1F1B):
        return one_f_one_b(placement, m)
    ranks = []
    for rank in range(placement.ranks):
        acts = schedule.pipeline_order[rank]
        ranks.append(
            tuple(
                Action(a.stage_index, _TORCH_OPS[a.computation_type.value], a.microbatch_index)
                for a in acts
                if a is not None and a.computation_type.value in _TORCH_OPS
            )
        )
    return Plan(placement, m, tuple(ranks), schedule=type(schedule).__name__)


def build_runner(cfg: Config, rank: int, world: int, args, m: int, cost: CostModel):
    """The runner, or the reason this configuration cannot run (same on every rank)."""
    try:
        if cfg.family == "torch":
            return TorchRunner(cfg, rank, world, args, m)
        return PrtRunner(cfg, rank, world, args, m, cost)
    except (ValueError, ConfigError) as exc:
        return f"n/a: {str(exc).split(chr(10))[0].strip()}"


# -- profiling -----------------------------------------------------------------------------
def profile_layer(rank: int, world: int, args) -> LayerCost:
    """Per-layer forward/backward seconds from a traced 1F1B step on shared memory (as
    runtime_speed.py does; median over actions, then mean over ranks), and the layer's
    gradient bytes (float32 weight and bias)."""
    m = max(2, world)
    placement = Placement(world)
    stages = build_stages(placement, rank, layer_maker(args.hidden), args.layers)
    runtime = PipelineRuntime(build_plan(placement, m), stages, mse_loss, trace=True)
    x, y = batch(args, m)
    for _ in range(args.profile_steps):
        runtime.step(list(x.tensor_split(m)), list(y.tensor_split(m)))
    runtime.close()
    spans = runtime.trace()
    fwd = statistics.median(e - s for a, s, e in spans if a.op is Op.F)
    bwd = statistics.median(e - s for a, s, e in spans if a.op is Op.B)
    both = torch.tensor([fwd, bwd]) * world / args.layers
    dist.all_reduce(both)
    fwd, bwd = (both / world).tolist()
    return LayerCost(fwd=fwd, bwd=bwd, grad=float((args.hidden + 1) * args.hidden * 4))


def message_costs(rank: int, world: int, args) -> dict[str, tuple[float, float]]:
    """(latency, cpu) of one activation-sized message per wire between ranks 0 and 1:
    one-way time of a ping-pong, and the process CPU time per message in a burst."""
    shape = (args.mb_size, args.hidden)
    costs = {GLOO: _gloo_costs(rank, args), SHM: shm_costs(rank, shape, args.burst)}
    # identical on every rank: plans are built from them
    return {wire: agreed(pair) for wire, pair in costs.items()}


def _gloo_costs(rank: int, args) -> tuple[float, float]:
    tensor = torch.randn(args.mb_size, args.hidden)
    peer = 1 - rank

    def burst():
        recvs = [dist.irecv(torch.empty_like(tensor), peer) for _ in range(args.burst)]
        for work in recvs + [dist.isend(tensor, peer) for _ in range(args.burst)]:
            work.wait()

    def ping_pong():
        first, second = (dist.send, dist.recv) if rank == 0 else (dist.recv, dist.send)
        first(tensor, peer)
        second(tensor, peer)

    return time_wire(rank, burst, ping_pong, 2 * args.burst)


def replica_calibration(rank: int, world: int, args) -> dict[str, dict]:
    """Per wire: the bi replica-gradient sum timed on megatron-prt's runtime for the bi
    variant's placement, on this model and on one of width ``hidden // 8`` (about 64 times
    fewer gradient bytes), and fitted
    (:func:`megatron_prt.runtime.replica_timing.calibrate_replica_sync`). Collective."""
    _, reuse, place, direction = next(v for v in PRT_VARIANTS if v[3] == "bi")
    placement = Placement(world, reuse, place, direction)
    plan = build_plan(placement, 2)
    out = {}
    for wire, transport in PRT_TRANSPORT_ARG.items():
        runtimes = [
            PipelineRuntime(
                plan,
                build_stages(placement, rank, layer_maker(hidden), args.layers),
                mse_loss,
                transport=transport,
            )
            for hidden in (max(4, args.hidden // 8), args.hidden)
        ]
        out[wire] = calibrate_replica_sync(*runtimes, repeats=replica_repeats(args))
        for runtime in runtimes:
            runtime.close()
    return out


def cost_model(
    args, layer: LayerCost, wire: tuple[float, float], replica: dict | None = None
) -> CostModel:
    """The profiled layer and message costs of one wire, with its replica-sum fit."""
    latency, cpu = wire
    fields = replica_cost_fields(replica) if replica else {}
    return CostModel(layers=(layer,) * args.layers, p2p_latency=latency, p2p_cpu=cpu, **fields)


# -- measuring -----------------------------------------------------------------------------
def twin_key(cfg: Config) -> str | None:
    """The megatron-prt row (gloo) with the same stage split as a torch row."""
    for label, reuse, placement, direction in PRT_VARIANTS:
        if (reuse, placement, direction) == (cfg.reuse, cfg.placement, cfg.direction):
            return Config(label, GLOO).key
    return None


def grad_gaps(runners: dict) -> dict[str, float]:
    """Same model, same data, same split: each torch row's gradients (from its last step)
    against its megatron-prt twin's, as max |difference| / max |gradient| over all ranks."""
    gaps = {}
    for key, runner in runners.items():
        twin = runners.get(twin_key(runner.cfg)) if runner.cfg.family == "torch" else None
        if twin is None:
            continue
        ours, theirs = grad_vector(twin), grad_vector(runner)
        gap = torch.tensor([(ours - theirs).abs().max() / ours.abs().max()])
        dist.all_reduce(gap, op=dist.ReduceOp.MAX)
        gaps[key] = float(gap)
    return gaps


def grad_vector(runner) -> torch.Tensor:
    return torch.cat(
        [p.grad.reshape(-1) for _, mod in sorted(runner.modules.items()) for p in mod.parameters()]
    )


def measure_m(rank: int, world: int, args, m: int, costs: dict[str, CostModel]) -> dict:
    """Every configuration at ``m`` micro-batches (:func:`common.measure_runners`), with the
    torch rows' gradient gaps."""
    built = {
        cfg.key: build_runner(cfg, rank, world, args, m, costs[cfg.transport])
        for cfg in all_configs()
    }
    return measure_runners(
        built, args, f"layer stack, m={m}:", lambda runners: {"grad_gap": grad_gaps(runners)}
    )


def worker(rank: int, world: int, args) -> dict:
    """One rank: profile, then measure every configuration at every m."""
    if args.keep_freed_memory:
        keep_freed_memory()  # both sides: no page faults from reallocating activations
    say("layer stack: profiling layer and message costs")
    layer = profile_layer(rank, world, args)
    wires = message_costs(rank, world, args)
    say("layer stack: timing the bi replica-gradient sum")
    replica = replica_calibration(rank, world, args)
    costs = {wire: cost_model(args, layer, pair, replica[wire]) for wire, pair in wires.items()}
    by_m = {}
    for m in args.microbatches:
        say(f"layer stack, m={m}: building {len(all_configs())} configurations, warm-up")
        by_m[m] = measure_m(rank, world, args, m, costs)
    return {"layer": layer, "wires": wires, "replica": replica, "by_m": by_m}


# -- results -------------------------------------------------------------------------------
def summarize(args, ranks: list[dict]) -> dict:
    """Rows per m (medians, predictions, per-rank peaks) and the two targets."""
    first = ranks[0]
    costs = {
        wire: cost_model(args, first["layer"], pair, first["replica"][wire])
        for wire, pair in first["wires"].items()
    }
    rows = {m: m_rows(m, [r["by_m"][m] for r in ranks], costs) for m in args.microbatches}
    return {
        "layer": asdict(first["layer"]),
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
        row["family"] = cfg.family
        add_measured(row, cfg.key, per_rank, costs[cfg.transport])
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


def torch_target(rows: dict) -> list[dict]:
    """Target 2: PRT's best configuration >= 1.0x torch's best schedule (by time) at equal or
    lower peak activation memory (the larger of the per-rank peaks), per m; PRT over gloo
    only (same wire) and PRT over any wire."""
    out = []
    for m, m_rows_ in rows.items():
        ran = [row for row in m_rows_ if "na" not in row]
        torch_rows = [row for row in ran if row["family"] == "torch"]
        if not torch_rows:
            continue
        best_torch = min(torch_rows, key=lambda row: row["median_s"])
        budget = max(best_torch["peak_bytes"])
        for wires in ((GLOO,), (GLOO, SHM)):
            fits = [
                row
                for row in ran
                if row["family"] == "prt"
                and row["transport"] in wires
                and max(row["peak_bytes"]) <= budget
            ]
            best = min(fits, key=lambda row: row["median_s"]) if fits else None
            ratio = best_torch["median_s"] / best["median_s"] if best else None
            out.append(
                {
                    "m": m,
                    "prt_wires": "+".join(wires),
                    "torch_best": best_torch["key"],
                    "torch_ms": best_torch["median_s"] * 1e3,
                    "torch_peak": budget,
                    "prt_best": best["key"] if best else None,
                    "prt_ms": best["median_s"] * 1e3 if best else None,
                    "prt_peak": max(best["peak_bytes"]) if best else None,
                    "ratio": ratio,
                    "met": bool(ratio and ratio >= 1.0),
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


def table_md(rows: list[dict]) -> list[str]:
    lines = [
        "| configuration | wire | measured ms | IQR | vs PRT 1F1B | sim ms | sim vs 1F1B "
        "| meas/sim | speedup / sim speedup | peak act KiB r0 / r1 |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        if "na" in row:
            lines.append(f"| {row['label']} | {_wire_label(row)} | {row['na']} |" + " |" * 7)
            continue
        vs_1f1b, sim_vs, meas_sim, speedup = (
            ratio(row, name)
            for name in ("vs_1f1b", "sim_vs_1f1b", "meas_over_sim", "speedup_vs_sim")
        )
        lines.append(
            f"| {row['label']} | {_wire_label(row)} | {ms(row['median_s'])} "
            f"| {row['iqr_frac'] * 100:.0f}% | {vs_1f1b} | {ms(row['sim_s'])} "
            f"| {sim_vs} | {meas_sim} | {speedup} | {_kib(row['peak_bytes'])} |"
        )
    return lines


def targets_md(summary: dict) -> list[str]:
    lines = [
        "### Target 1: PRT's measured speedup over 1F1B >= 0.9 x the simulated speedup",
        "",
        "| m | configuration | measured speedup | simulated speedup | ratio | met |",
        "|---:|---|---:|---:|---:|---|",
    ]
    for t in summary["sim_target"]:
        if "na" in t:
            lines.append(f"| {t['m']} | {t['key']} | {t['na']} | | | |")
            continue
        lines.append(
            f"| {t['m']} | {t['key']} | {t['measured_speedup']:.3f} | {t['sim_speedup']:.3f} "
            f"| {t['ratio']:.3f} | {'yes' if t['met'] else 'no'} |"
        )
    lines += [
        "",
        "### Target 2: PRT's best >= 1.0 x torch.distributed.pipelining's best, at equal or "
        "lower per-rank peak activation memory",
        "",
        "| m | PRT wires | torch best | ms | peak KiB | PRT best within that peak | ms "
        "| peak KiB | torch ms / PRT ms | met |",
        "|---:|---|---|---:|---:|---|---:|---:|---:|---|",
    ]
    for t in summary["torch_target"]:
        prt = (
            f"{t['prt_best']} | {t['prt_ms']:.1f} | {t['prt_peak'] / 1024:.0f} | {t['ratio']:.3f}"
            if t["prt_best"]
            else "none fits | | |"
        )
        lines.append(
            f"| {t['m']} | {t['prt_wires']} | {t['torch_best']} | {t['torch_ms']:.1f} "
            f"| {t['torch_peak'] / 1024:.0f} | {prt} | {'yes' if t['met'] else 'no'} |"
        )
    return lines


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


def report_md(args, summary: dict, info: dict) -> str:
    layer, wires = summary["layer"], summary["wires"]
    title = "megatron-prt vs torch.distributed.pipelining, measured (CPU): layer stack"
    lines = [
        *report_head(title, "layer_stack", info),
        f"Setup: {args.ranks} gloo ranks (one thread each) on this machine; model "
        f"{args.layers} x (Linear {args.hidden}x{args.hidden} + ReLU), fp32, micro-batch "
        f"{args.mb_size}, MSE loss; the same data and stage split for every row; "
        f"{args.warmup} warm-up steps, then {args.reps} repetitions interleaved across all rows "
        "(A B C, B C A, ...), median shown; a step's time is the slowest rank's; gradients "
        "are zeroed outside the timed region.",
        "",
        f"Profiled in this launch: per layer forward {layer['fwd'] * 1e3:.3f} ms, backward "
        f"{layer['bwd'] * 1e3:.3f} ms; per message (latency, CPU): gloo "
        f"{wires[GLOO][0] * 1e3:.3f} ms, {wires[GLOO][1] * 1e3:.3f} ms; shared memory "
        f"{wires[SHM][0] * 1e3:.3f} ms, {wires[SHM][1] * 1e3:.3f} ms.",
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
        "compute order converted to a plan; ZBV's split backward as I and W of half a backward "
        "each) under the costs profiled above, messages included (latency and CPU of the row's "
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


# -- entry point ---------------------------------------------------------------------------
def run(args, command: str) -> list[str]:
    """Run the section on ``args.ranks`` local gloo ranks (flags:
    :mod:`megatron_prt.bench.flags`), write the report, chart and data under ``args.out``;
    returns their paths. ``command`` is the command line quoted in the report."""
    say(f"layer stack: {args.ranks} ranks, m in {args.microbatches}, {args.reps} repetitions")
    ranks, info = launch(
        command, lambda: all_ok(run_local(args.ranks, worker, args, deadline_s=3000))
    )
    return write_outputs(args, summarize(args, ranks), info)
