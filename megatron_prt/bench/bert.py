"""megatron-core BERT section of ``megatron-prt bench`` (CPU, one thread per rank).

megatron-core's ``BertModel`` (local spec, tied embeddings, binary head, float32) trained
through :func:`megatron_prt.megatron.make_forward_backward_func` under megatron-prt's 1F1B
plan (R=1) and its PRT variants, on P local gloo ranks, with the same weights and data for
every variant. Repetitions are interleaved (a seeded shuffle per round: A C B, B A C, ...)
and reported as medians with ratios against 1F1B; next to each, the simulator's prediction
for the plan that ran, from costs profiled before the launch
(:func:`megatron_prt.megatron.profile.profile_model`: per
layer, embedding and head), per-message costs of the transport the runs use and (bi) the
cost of the replica-gradient sum in megatron's finalize path, both measured in the launch;
and each rank's peak activation bytes (``ActivationMeter`` through the
runtime's ``measure_memory``), measured and simulated. :func:`run` writes
``megatron_bert.{md,png,json}`` under ``args.out``.

The rank-side code (model building, megatron's parallel state) is
:mod:`megatron_prt.megatron.bench` and :mod:`megatron_prt.megatron.pretrain`, imported
inside the ranks only.
"""

from __future__ import annotations

import statistics
from functools import partial

from ..core.placement import ConfigError, Placement
from ..runtime.cpu import keep_freed_memory
from ..runtime.local import all_ok, run_local
from ..sim.cost import CostModel
from .common import (
    add_measured,
    add_ratios,
    agreed,
    measure_runners,
    replica_cost_fields,
    replica_repeats,
    say,
    shm_costs,
    wire_fields,
    wire_md,
)
from .report import (
    launch,
    md_table,
    ms,
    plot_panels,
    ratio,
    replica_cal_md,
    report_head,
    sim_sum_md,
    write_report,
)

NAME = "megatron_bert"
VARIANTS = (  # (label, reuse, placement, direction); the first is the baseline
    ("PRT 1F1B (R=1)", 1, "loop", "uni"),
    ("PRT loop R=2", 2, "loop", "uni"),
    ("PRT loop R=4", 4, "loop", "uni"),
    ("PRT wave R=2", 2, "wave", "uni"),
    ("PRT wave/bi R=2", 2, "wave", "bi"),
)
BASELINE = VARIANTS[0][0]


def labels() -> list[str]:
    """Every configuration row of the report, in order."""
    return [label for label, *_ in VARIANTS]


def shape_of(args):
    """The :class:`~megatron_prt.megatron.bench.BertShape` of the ``--bert-*`` flags."""
    from ..megatron.bench import BertShape

    return BertShape(
        args.bert_layers,
        args.bert_hidden,
        args.bert_heads,
        args.bert_seq,
        args.bert_mbs,
        args.bert_vocab,
    )


# -- ranks ---------------------------------------------------------------------------------
def profile_worker(rank: int, world: int, args) -> dict:
    """One rank, one thread: the cost JSON of one micro-batch."""
    from ..megatron.bench import profile_costs

    return profile_costs(shape_of(args), args.bert_profile_reps)


def build_runner(args, variant: tuple, world: int, m: int, state: dict):
    """The runner of ``variant`` holding the weights ``state``, or why it cannot run (the
    same on every rank)."""
    from ..megatron.bench import BertRunner

    _, reuse, placement, direction = variant
    schedule = "1f1b" if (reuse, direction) == (1, "uni") else "prt"
    try:
        return BertRunner(
            shape_of(args), Placement(world, reuse, placement, direction), schedule, m, state
        )
    except ConfigError as exc:
        return f"n/a: {str(exc).splitlines()[0].strip()}"


def measure_m(args, world: int, m: int, state: dict) -> dict:
    """Every variant at ``m`` micro-batches (:func:`common.measure_runners`), with the
    losses of its last step."""
    say(f"bert, m={m}: building {len(VARIANTS)} configurations, warm-up")
    built = {variant[0]: build_runner(args, variant, world, m, state) for variant in VARIANTS}
    return measure_runners(
        built,
        args,
        f"bert, m={m}:",
        lambda runners, _times: {"losses": {label: r.losses for label, r in runners.items()}},
    )


def bi_placement(world: int) -> Placement:
    """The placement of the (first) bi variant."""
    _, reuse, placement, direction = next(v for v in VARIANTS if v[3] == "bi")
    return Placement(world, reuse, placement, direction)


def worker(rank: int, world: int, args) -> dict:
    """One rank: message costs, the reference weights, the replica-sum calibration, then
    every variant at every m."""
    from ..megatron.bench import calibrate_replica_sum, reference_state
    from ..megatron.pretrain import init_parallel_state

    if args.keep_freed_memory:
        keep_freed_memory()
    say("bert: profiling message costs")
    message = (args.bert_seq, args.bert_mbs, args.bert_hidden)
    wire = agreed(shm_costs(rank, message, args.burst))
    init_parallel_state(world)
    state = reference_state(shape_of(args), world)
    say("bert: timing the bi replica-gradient sum")
    replica = calibrate_replica_sum(shape_of(args), bi_placement(world), replica_repeats(args))
    by_m = {m: measure_m(args, world, m, state) for m in args.microbatches}
    return {"wire": wire, "replica": replica, "by_m": by_m}


# -- results -------------------------------------------------------------------------------
def cost_model(costs: dict, wire: tuple[float, float], replica: dict) -> CostModel:
    """The profiled costs with the measured message's fields (:func:`.common.wire_fields`)
    and the fitted replica-sum cost."""
    return CostModel.from_dict({**costs, **wire_fields(wire), **replica_cost_fields(replica)})


def summarize(args, costs: dict, ranks: list[dict]) -> dict:
    """Rows per m: medians, ratios, predictions, per-rank peaks (measured and simulated)."""
    wire, replica = ranks[0]["wire"], ranks[0]["replica"]
    model = cost_model(costs, wire, replica)
    rows = {m: m_rows(m, [r["by_m"][m] for r in ranks], model) for m in args.microbatches}
    return {"costs": costs, "wire": wire, "replica": replica, "rows": rows}


def m_rows(m: int, per_rank: list[dict], model: CostModel) -> list[dict]:
    rows = []
    for label in labels():
        row: dict = {"key": label, "label": label, "m": m}
        sim = add_measured(row, label, per_rank, model)
        if sim is not None:
            row["sim_peak_bytes"] = [r.peak_activation_bytes for r in sim.per_rank]
            losses = [loss for r in per_rank for loss in r["losses"][label]]
            row["mean_loss"] = statistics.mean(losses) if losses else None
        rows.append(row)
    by_label = {row["label"]: row for row in rows}
    add_ratios(rows, lambda row: by_label.get(BASELINE))
    return rows


# -- report --------------------------------------------------------------------------------
def _mib(values) -> str:
    return " / ".join(f"{v / 2**20:.2f}" for v in values)


TABLE_HEADER = (
    "configuration",
    "measured ms",
    "IQR",
    "vs 1F1B",
    "sim ms",
    "sim vs 1F1B",
    "meas/sim",
    "speedup / sim speedup",
    "peak act MiB per rank",
    "sim peak act MiB per rank",
    "mean loss",
)


def table_md(rows: list[dict]) -> list[str]:
    return md_table(TABLE_HEADER, "l" + "r" * 10, (_row_cells(row) for row in rows))


def _row_cells(row: dict) -> tuple:
    if "na" in row:
        return (row["label"], row["na"], *[""] * 9)
    vs_1f1b, sim_vs, meas_sim = (
        ratio(row, name) for name in ("vs_1f1b", "sim_vs_1f1b", "meas_over_sim")
    )
    loss = f"{row['mean_loss']:.6f}" if row["mean_loss"] is not None else "-"
    return (
        row["label"],
        ms(row["median_s"]),
        f"{row['iqr_frac'] * 100:.0f}%",
        vs_1f1b,
        ms(row["sim_s"]),
        sim_vs,
        meas_sim,
        ratio(row, "speedup_vs_sim"),
        _mib(row["peak_bytes"]),
        _mib(row["sim_peak_bytes"]),
        loss,
    )


def _stage_md(costs: dict) -> str:
    """The work each stage's step adds, where the costs give it ([Note: every stage pays
    its step's work] in sim/cost.py)."""
    stage = costs.get("stage")
    if stage is None:
        return ""
    return f"each stage's step {stage['fwd'] * 1e3:.3f} / {stage['bwd'] * 1e3:.3f} ms; "


def costs_md(args, summary: dict) -> str:
    costs = summary["costs"]
    layers = costs["layers"]
    fwd = statistics.mean(layer["fwd"] for layer in layers)
    bwd = statistics.mean(layer["bwd"] for layer in layers)
    return (
        f"Profiled (`profile_model`, one rank, one thread, before the launch): per layer "
        f"forward {fwd * 1e3:.3f} ms, backward {bwd * 1e3:.3f} ms (mean of {len(layers)}); "
        f"embedding {costs['embedding']['fwd'] * 1e3:.3f} / {costs['embedding']['bwd'] * 1e3:.3f}"
        f" ms; head (LM head, binary head, losses) {costs['head']['fwd'] * 1e3:.3f} / "
        f"{costs['head']['bwd'] * 1e3:.3f} ms; {_stage_md(costs)}whole model "
        f"{costs['fwd_time'] * 1e3:.2f} / "
        f"{costs['bwd_time'] * 1e3:.2f} ms. Per message ({costs['message_bytes'] / 1024:.0f} "
        f"KiB, shared memory, measured in the launch): {wire_md(summary['wire'])}. "
        "Replica-gradient sum (bi), timed in the launch on the "
        "forward-backward function's runtime (`time_replica_sync` of "
        "`reduce_replica_grads`, what megatron's finalize path calls; barrier first, "
        "median; of the rank that waited least) "
        f"for this model and one of hidden size {2 * args.bert_heads} with a "
        f"{min(args.bert_vocab, 64)}-token vocabulary, fitted as latency + bytes / "
        "transfer rate + bytes / add rate (the add rate from a timed `a + b`): "
        f"{replica_cal_md(summary['replica'])}. The bi row's prediction includes it; every "
        "row's includes the tied embedding sum between the first and last stages "
        "(`tied_grad_bytes`), priced at the same figures, though megatron-prt runs it over "
        "the gloo group (the replica sum: over shared memory)."
    )


def replica_sum_md(rows: list[dict]) -> list[str]:
    """Per bi row: the sum as simulated and as measured inside the timed steps."""
    lines = [
        f"* {sim_sum_md(row)}; measured inside the timed steps (the finalize path's "
        "`reduce_replica_grads`, waiting for the mirrored rank included): median "
        f"{ms(row['replica_sum_s'])} ms."
        for row in rows
        if "sim_replica_s" in row
    ]
    return [*lines, ""] if lines else []


def report_md(args, summary: dict, info: dict) -> str:
    lines = [
        *report_head("megatron-prt on megatron-core BERT, measured (CPU)", "bert", info),
        f"Setup: {args.ranks} gloo ranks (one thread each) on this machine; megatron-core "
        f"BertModel (local spec, tied embeddings, binary head), {args.bert_layers} layers, "
        f"hidden {args.bert_hidden}, {args.bert_heads} heads, sequence {args.bert_seq}, "
        f"micro-batch {args.bert_mbs}, vocabulary {args.bert_vocab}, float32; trained through "
        "`megatron_prt.megatron.make_forward_backward_func` (megatron's forward_step, loss "
        "and finalize path; the CPU shim `megatron_prt.megatron.cpu`); the same data for "
        f"every row; {args.warmup} warm-up steps, then {args.reps} repetitions interleaved "
        "across all rows (a seeded shuffle per round: A C B, B A C, ...), median shown; "
        "a step's time is the slowest rank's; gradients are zeroed outside the timed region.",
        "",
        costs_md(args, summary),
        "",
    ]
    for m, rows in summary["rows"].items():
        lines += [f"## m = {m} micro-batches (P = {args.ranks})", "", *table_md(rows), ""]
        lines += replica_sum_md(rows)
    lines += notes_md()
    return "\n".join(lines) + "\n"


def notes_md() -> list[str]:
    return [
        "## How to read this",
        "",
        "* vs 1F1B: measured time / the time of megatron-prt's 1F1B plan (R=1) on the same "
        "model and data. Below 1 is faster.",
        "* sim ms: `megatron_prt.sim.simulate` of the plan that ran, under the profiled costs "
        "above (messages included). meas/sim: measured / simulated time. speedup / sim "
        "speedup: (measured speedup over 1F1B) / (simulated speedup).",
        "* peak act: the most activation bytes each rank held for backward during one "
        "untimed step (`ActivationMeter`, switched on through the runtime's "
        "`measure_memory`); sim peak act: the simulator's figure from the profiled "
        "per-part activation bytes.",
        "* The wave/bi row holds two weight replicas per rank; its measured time includes "
        "summing the replica gradients (inside the forward-backward function, before "
        "megatron's finalize) and so does its simulated time (`megatron_prt.sim."
        "replica_sync`: each rank pair starts once both have finished their backward "
        "passes, at the calibrated cost).",
        "* Every row holds the same weights: the 1F1B split's, initialised from one seed and "
        "loaded into each split by global parameter name (`megatron_prt.megatron.weights`), "
        "replicas and the tied output weight included.",
        "* mean loss: per micro-batch, over the step's micro-batches; with the same weights "
        "and data it agrees across the rows of one m up to float32 rounding (a check that "
        "every row trains the same model).",
        "* torch.distributed.pipelining's schedules are compared on the layer stack only "
        "(`vs_torch_pipelining.md`), not here: its `PipelineStage` runs a module on tensors "
        "with a loss function on the last stage, while megatron-core's BertModel chunks "
        "take their stage input through `set_input_tensor`, compute the loss inside the "
        "model through megatron's `forward_step` protocol and share the tied word embedding "
        "between first and last stage; running them under torch's schedules needs an "
        "adapter that would be timed along with the schedule.",
        "* n/a: megatron-prt refused the configuration; its message is shown.",
        "",
    ]


def write_outputs(args, summary: dict, info: dict) -> list[str]:
    plot = partial(
        plot_panels,
        color_of=lambda row: "tab:blue" if row["label"] == BASELINE else "tab:green",
        legend=(("tab:blue", "megatron-prt 1F1B (R=1)"), ("tab:green", "megatron-prt PRT")),
        title="megatron-core BERT: time per training step on CPU (lower is better)",
    )
    return write_report(args, NAME, report_md(args, summary, info), summary, info, plot)


# -- entry point ---------------------------------------------------------------------------
def run(args, command: str) -> list[str]:
    """Profile on one rank, measure on ``args.ranks`` local gloo ranks, write the report,
    chart and data under ``args.out``; returns their paths."""
    say(f"bert: {args.ranks} ranks, m in {args.microbatches}, {args.reps} repetitions")

    def measure():
        say("bert: profiling the model on one rank")
        costs = all_ok(run_local(1, profile_worker, args, deadline_s=600))[0]
        return costs, all_ok(run_local(args.ranks, worker, args, deadline_s=3000))

    (costs, ranks), info = launch(command, measure)
    return write_outputs(args, summarize(args, costs, ranks), info)
