"""Memory-balanced stage assignment on a megatron-core BERT: predicted vs measured memory.

    python benchmarks/partition_memory.py           # writes docs/benchmarks/partition_memory.md
    python benchmarks/partition_memory.py --quick   # smaller model, main tables only, no file
    python benchmarks/partition_memory.py --out FILE

Steps, all in one launch on CPU (forked gloo ranks, one thread each):

1. profile the model with :func:`megatron_prt.megatron.profile.profile_model` (BertModel,
   local spec, tied embeddings, binary head; fp32): per-layer time, activation and
   parameter bytes, plus the embedding and the head (the cost JSON);
2. plan: uniform 1F1B (R=1 loop/uni); every uniform PRT configuration (R in {2,3,4},
   loop/wave, uni/bi, even layers), the best by simulated makespan; wave + balanced
   partition (:func:`megatron_prt.tune.partition.partition`, default slack) for R in
   {2,3,4}, for uni and for bi one R picked by :func:`pick_wave`; per rank the simulator's
   peak activation bytes and the parameter bytes (weights + gradients + Adam moments, 16
   bytes per fp32 parameter), and the simulated makespan;
3. measure each chosen configuration on P real ranks with the megatron-core integration
   (``ReuseConfig`` with the stage layers, ``make_forward_backward_func(reuse,
   measure_memory=True)``, megatron's DDP and Adam, one training step): the activation
   peak the runtime counts, and the bytes of the distinct storages of parameters, DDP
   gradient buffers and Adam state after the step;
4. report per rank predicted vs measured, per configuration the max/min ratio and the
   simulated throughput relative to the best uniform PRT configuration, the issue's
   targets, and (full run) the levers tried: slack, R, placement, direction, a memory
   budget, micro-batch size and number of micro-batches.

Memory measured here is what the model keeps (activations held for backward, as
:mod:`megatron_prt.runtime.memory` defines them, and training state), not the process's
resident size: allocator caching, transient workspace and messages in flight are not in it.
Simulated times use the profiled per-part seconds and free communication.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import partial

import torch

from megatron_prt.core import Placement, build_plan
from megatron_prt.core.placement import ConfigError
from megatron_prt.megatron.config import ReuseConfig
from megatron_prt.runtime.local import all_ok, run_local
from megatron_prt.sim.cost import CostModel
from megatron_prt.sim.simulate import simulate
from megatron_prt.tune.partition import DEFAULT_SLACK, partition, uniform_layers

MIB = 2**20
THROUGHPUT_TARGET = (
    0.95  # wave + balanced: >= this fraction of the best uniform PRT (same direction)
)
BALANCE_TARGET = 1.15  # wave + balanced: per-rank peak max/min at most this
AGREEMENT_TARGET = 0.10  # measured activation peak within this fraction of the prediction
REUSES = (2, 3, 4)
LEAST_MEMORY_SLACK = 1e6  # "any speed": the partitioner's least-memory answer
DEFAULT_OUT = "docs/benchmarks/partition_memory.md"


# -- what runs ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Bert:
    """Model and micro-batch sizes: ``layers`` transformer layers, ``hidden`` width,
    ``heads`` attention heads, ``seq`` tokens per sequence, ``mbs`` sequences per
    micro-batch, ``vocab`` tokens in the vocabulary."""

    layers: int = 24
    hidden: int = 128
    heads: int = 4
    seq: int = 128
    mbs: int = 2
    vocab: int = 4096


@dataclass(frozen=True)
class Config:
    """One way to run the model: a placement and the transformer layers of each model stage."""

    label: str
    placement: Placement
    stage_layers: tuple[int, ...]

    def reuse(self) -> ReuseConfig:
        return ReuseConfig(self.placement, sum(self.stage_layers), self.stage_layers)


def placement_label(placement: Placement) -> str:
    return f"R={placement.reuse} {placement.placement}/{placement.direction}"


def uniform_config(placement: Placement, num_layers: int) -> Config:
    label = "1F1B" if placement.reuse == 1 else f"{placement_label(placement)} uniform"
    return Config(label, placement, uniform_layers(num_layers, placement.depth))


# -- step 1: profile -----------------------------------------------------------------------------
def profile(model: Bert, reps: int = 3, profile_layers: int | None = None) -> dict:
    """The cost JSON of ``model`` (seconds and bytes per micro-batch), profiled on one
    forked rank with one thread, as a pipeline rank runs."""
    return all_ok(run_local(1, _profile_worker, model, reps, profile_layers))[0]


def _profile_worker(rank: int, world: int, model: Bert, reps: int, profile_layers) -> dict:
    from megatron_prt.megatron.profile import profile_model

    return profile_model(
        "bert",
        model.layers,
        model.hidden,
        model.heads,
        model.seq,
        model.mbs,
        model.vocab,
        reps=reps,
        profile_layers=profile_layers,
    )


# -- step 2: predict -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Prediction:
    """The simulator on the runtime's plan: ``makespan`` in seconds (profiled costs, free
    communication); per rank ``act`` (peak activation bytes) and ``state`` (parameter bytes
    of its stages and replicas: weights, gradients, Adam moments)."""

    makespan: float
    act: tuple[float, ...]
    state: tuple[float, ...]

    @property
    def totals(self) -> tuple[float, ...]:
        """Per rank: peak activation + state bytes."""
        return tuple(a + s for a, s in zip(self.act, self.state, strict=True))

    @property
    def max_total(self) -> float:
        return max(self.totals)

    @property
    def balance(self) -> float:
        """Largest over smallest per-rank total."""
        return max(self.totals) / min(self.totals)


def cost_model(costs: dict, stage_layers: Sequence[int] = ()) -> CostModel:
    return CostModel.from_dict({**costs, "stage_layers": list(stage_layers)})


def predict(costs: dict, config: Config, microbatches: int) -> Prediction:
    result = simulate(
        build_plan(config.placement, microbatches), cost_model(costs, config.stage_layers)
    )
    return Prediction(
        result.makespan,
        tuple(r.peak_activation_bytes for r in result.per_rank),
        tuple(r.param_bytes for r in result.per_rank),
    )


def uniform_prt_configs(ranks: int, num_layers: int) -> list[Config]:
    return [
        uniform_config(Placement(ranks, reuse, placement, direction), num_layers)
        for reuse in REUSES
        for placement in ("loop", "wave")
        for direction in ("uni", "bi")
    ]


def best_uniform(
    costs: dict, ranks: int, microbatches: int, direction: str | None = None
) -> tuple[Config, Prediction]:
    """The uniform PRT configuration with the smallest simulated makespan (of ``direction``
    only, when given)."""
    scored = [
        (c, predict(costs, c, microbatches))
        for c in uniform_prt_configs(ranks, len(costs["layers"]))
        if direction in (None, c.placement.direction)
    ]
    return min(scored, key=lambda cp: cp[1].makespan)


def best_by_direction(costs: dict, ranks: int, microbatches: int) -> dict:
    """``{"uni": best uniform uni, "bi": best uniform bi}``: the throughput yardsticks. A
    wave + balanced pick is held against the best uniform PRT of its own direction: bi keeps
    two weight replicas per rank (a different memory class), so the fastest bi plan is not
    what a uni partition trades against."""
    return {d: best_uniform(costs, ranks, microbatches, d) for d in ("uni", "bi")}


def balanced_config(
    costs: dict,
    placement: Placement,
    microbatches: int,
    *,
    slack: float = DEFAULT_SLACK,
    budget_bytes: float | None = None,
    tag: str = "balanced",
) -> Config:
    """The partitioner's answer for ``placement`` (raises ConfigError if ``budget_bytes``
    cannot be met)."""
    result = partition(
        cost_model(costs), placement, microbatches, slack=slack, budget_bytes=budget_bytes
    )
    return Config(f"{placement_label(placement)} {tag}", placement, result.stage_layers)


def target_slack(costs: dict, placement: Placement, microbatches: int, cap: float) -> float:
    """The slack that lets the partitioner trade time for memory up to makespan ``cap``
    (seconds): measured against the fastest partition it finds; < 0 if even that is slower."""
    fastest = partition(cost_model(costs), placement, microbatches).fastest_makespan
    return cap / fastest - 1.0


def wave_placements(ranks: int) -> list[Placement]:
    return [Placement(ranks, r, "wave", d) for r in REUSES for d in ("uni", "bi")]


def pick_wave(
    candidates: Sequence[tuple[Config, Prediction]], best_makespan: float
) -> tuple[Config, Prediction]:
    """The rule for "the R we pick": among the candidates whose simulated throughput is at
    least :data:`THROUGHPUT_TARGET` of ``best_makespan`` (the best uniform PRT of the
    candidates' direction), the smallest largest per-rank
    peak; if none is, the fastest (the throughput target is then missed whatever we pick)."""
    fast = [cp for cp in candidates if best_makespan / cp[1].makespan >= THROUGHPUT_TARGET]
    if fast:
        return min(fast, key=lambda cp: (cp[1].max_total, cp[1].makespan))
    return min(candidates, key=lambda cp: cp[1].makespan)


@dataclass(frozen=True)
class Pick:
    """Wave + balanced for one direction: the picked R, and the same placement with
    uniform layers (the like-for-like baseline)."""

    uniform: tuple[Config, Prediction]
    balanced: tuple[Config, Prediction]


@dataclass(frozen=True)
class Plan:
    """Step 2's answer: every configuration measured, with its prediction."""

    f1b: tuple[Config, Prediction]
    best_uniform: tuple[Config, Prediction]  # any direction
    best: dict[str, tuple[Config, Prediction]]  # by direction: each pick's yardstick
    picks: dict[str, Pick]  # by direction, "uni" and "bi"
    wave_candidates: tuple[tuple[Config, Prediction], ...]

    def best_makespan(self, direction: str) -> float:
        return self.best[direction][1].makespan

    def measured(self) -> list[tuple[Config, Prediction]]:
        out = [self.f1b, self.best_uniform, *self.best.values()]
        for pick in self.picks.values():
            out += [pick.uniform, pick.balanced]
        return out


def make_plan(costs: dict, ranks: int, microbatches: int) -> Plan:
    num_layers = len(costs["layers"])
    f1b = uniform_config(Placement(ranks, 1, "loop", "uni"), num_layers)
    best = best_by_direction(costs, ranks, microbatches)
    candidates = []
    for placement in wave_placements(ranks):
        config = balanced_config(costs, placement, microbatches)
        candidates.append((config, predict(costs, config, microbatches)))
    picks = {}
    for direction in ("uni", "bi"):
        mine = [cp for cp in candidates if cp[0].placement.direction == direction]
        picked = pick_wave(mine, best[direction][1].makespan)
        same = uniform_config(picked[0].placement, num_layers)
        picks[direction] = Pick((same, predict(costs, same, microbatches)), picked)
    return Plan(
        f1b=(f1b, predict(costs, f1b, microbatches)),
        best_uniform=min(best.values(), key=lambda cp: cp[1].makespan),
        best=best,
        picks=picks,
        wave_candidates=tuple(candidates),
    )


# -- step 3: measure on real ranks ----------------------------------------------------------------
@dataclass(frozen=True)
class Measured:
    """One rank, one configuration, one training step: ``act_peak`` / ``act_held_after``
    activation bytes held for backward (peak; left at the end, 0 when every backward ran);
    ``params`` / ``grads`` / ``optimizer`` bytes of distinct storages after the optimizer
    step (weights; DDP gradient buffers; Adam moments and step counters)."""

    act_peak: int
    act_held_after: int
    params: int
    grads: int
    optimizer: int

    @property
    def state(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> int:
        return self.act_peak + self.state


def measure(model: Bert, configs: Sequence[Config], microbatches: int) -> list[list[Measured]]:
    """``[config][rank]``: each configuration run for one step on P forked gloo ranks."""
    ranks = configs[0].placement.ranks
    per_rank = all_ok(
        run_local(ranks, _measure_worker, model, list(configs), microbatches, deadline_s=900)
    )
    return [[per_rank[r][i] for r in range(ranks)] for i in range(len(configs))]


def _measure_worker(rank, world, model: Bert, configs: list[Config], microbatches: int):
    from megatron_prt.megatron import cpu

    cpu.enable()
    return [_measure_one(model, c.reuse(), microbatches) for c in configs]


def _measure_one(model: Bert, reuse: ReuseConfig, microbatches: int) -> Measured:
    """One training step, as Megatron-LM's drives it; activations measured by the runtime
    during the step, training state after it."""
    from megatron_prt.megatron import make_forward_backward_func
    from megatron_prt.megatron.pretrain import bert_forward_step, random_batches

    chunks, optimizer = _training_setup(model, reuse)
    forward_backward = make_forward_backward_func(reuse, timeout_s=300, measure_memory=True)
    batches = random_batches(microbatches, model.vocab, model.mbs, model.seq, seed=0)
    for chunk in chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    forward_backward(
        forward_step_func=bert_forward_step,
        data_iterator=[iter(batches) for _ in chunks],
        model=chunks,
        num_microbatches=microbatches,
        seq_length=model.seq,
        micro_batch_size=model.mbs,
    )
    stats = forward_backward.memory_stats()
    optimizer.step()  # Adam allocates its moments on the first step
    forward_backward.pipeline().close()
    params, grads, moments = _state_bytes(chunks, optimizer)
    return Measured(stats["peak_bytes"], stats["held_bytes"], params, grads, moments)


def _training_setup(model: Bert, reuse: ReuseConfig) -> tuple[list, object]:
    """This rank's chunks in megatron's DDP (no overlap, as on CPU) and megatron's Adam."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_prt.megatron import connect_model_hooks, prepare_model

    _init_parallel_state(reuse)
    config, chunks = _build_chunks(model, reuse)
    ddp_config = DistributedDataParallelConfig(overlap_grad_reduce=False)
    chunks = [DistributedDataParallel(config, ddp_config, chunk) for chunk in chunks]
    prepare_model(chunks, reuse)
    connect_model_hooks(config, chunks)
    return chunks, get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-4), chunks)


def _init_parallel_state(reuse: ReuseConfig) -> None:
    from megatron_prt.megatron.pretrain import init_parallel_state

    chunks = reuse.placement.chunks_per_rank
    init_parallel_state(reuse.placement.ranks, chunks if chunks > 1 else None)
    torch.manual_seed(1234)


def _build_chunks(model: Bert, reuse: ReuseConfig):
    """This rank's BertModel chunks, configured as the profiler configures its model."""
    from megatron_prt.megatron import build_chunks, transformer_config_kwargs
    from megatron_prt.megatron.pretrain import build_model, transformer_config

    config = transformer_config(
        hidden_size=model.hidden,
        num_attention_heads=model.heads,
        deallocate_pipeline_outputs=True,  # as Megatron-LM runs: sent outputs are freed
        **transformer_config_kwargs(reuse),
    )
    provider = partial(build_model, "bert", vocab_size=model.vocab, seq_length=model.seq)
    return config, build_chunks(provider, reuse, config=config)


def _state_bytes(chunks: list, optimizer) -> tuple[int, int, int]:
    """(parameter, gradient, optimizer-state) bytes of distinct storages: a storage shared
    by several tensors (DDP's gradient buffer, ``param.grad`` aliasing ``main_grad``)
    counts once, in the first category that holds it."""
    params = [p for chunk in chunks for p in chunk.parameters()]
    grads = [g for p in params for g in (getattr(p, "main_grad", None), p.grad) if g is not None]
    moments = [
        value
        for torch_optimizer in _torch_optimizers(optimizer)
        for state in torch_optimizer.state.values()
        for value in state.values()
        if torch.is_tensor(value)
    ]
    seen: set = set()
    return tuple(_distinct_bytes(group, seen) for group in (params, grads, moments))


def _distinct_bytes(tensors: list[torch.Tensor], seen: set) -> int:
    total = 0
    for tensor in tensors:
        storage = tensor.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        if key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total


def _torch_optimizers(optimizer) -> list:
    """The torch optimizers inside megatron's (chained or single) optimizer."""
    inner = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return [o.optimizer for o in inner]


# -- step 4: report ------------------------------------------------------------------------------
Rows = list[tuple[Config, Prediction, list[Measured]]]


def mib(value: float) -> str:
    return f"{value / MIB:.2f}"


def spread(values: Sequence[float]) -> float:
    """Largest over smallest."""
    return max(values) / min(values)


def layers_text(config: Config) -> str:
    return ",".join(map(str, config.stage_layers))


def measured_rows(plan: Plan, measured: dict[Config, list[Measured]]) -> Rows:
    """Each measured configuration once, in plan order."""
    seen: dict[Config, Prediction] = dict(plan.measured())
    return [(c, p, measured[c]) for c, p in seen.items()]


def per_rank_table(rows: Rows, model_act: float) -> list[str]:
    """One row per (configuration, rank), MiB; *mbs* counts activation peaks in micro-batches
    through the whole model (1F1B's rank 0 holds about 1)."""
    lines = [
        "| configuration | rank | act pred | act meas | meas/pred | act pred, mbs "
        "| state pred | state meas | total pred | total meas |",
        "|" + "---|" * 10,
    ]
    for config, pred, ranks in rows:
        for rank, m in enumerate(ranks):
            lines.append(
                f"| {config.label} | {rank} | {mib(pred.act[rank])} | {mib(m.act_peak)} "
                f"| {m.act_peak / pred.act[rank]:.3f} | {pred.act[rank] / model_act:.2f} "
                f"| {mib(pred.state[rank])} | {mib(m.state)} | {mib(pred.totals[rank])} "
                f"| {mib(m.total)} |"
            )
    return lines


def summary_table(rows: Rows, plan: Plan) -> list[str]:
    """One row per configuration: stage layers, time (against the best uniform PRT of its
    direction and of any), largest peaks and balance."""
    f1b_max = plan.f1b[1].max_total
    lines = [
        "| configuration | stage layers | sim makespan s | throughput vs best uniform PRT, "
        "same direction | vs best uniform, any direction | max total pred MiB | max/min pred "
        "| max total meas MiB | max/min meas | max pred vs 1F1B |",
        "|" + "---|" * 10,
    ]
    for config, pred, ranks in rows:
        totals = [m.total for m in ranks]
        same = plan.best_makespan(config.placement.direction)
        lines.append(
            f"| {config.label} | {layers_text(config)} | {pred.makespan:.3f} "
            f"| {same / pred.makespan:.3f} "
            f"| {plan.best_uniform[1].makespan / pred.makespan:.3f} | {mib(pred.max_total)} "
            f"| {pred.balance:.3f} | {mib(max(totals))} | {spread(totals):.3f} "
            f"| {pred.max_total / f1b_max:.3f} |"
        )
    return lines


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


def targets_table(plan: Plan, measured: dict[Config, list[Measured]], rows: Rows) -> list[str]:
    names = [
        f"per-rank peak (act + state) max/min <= {BALANCE_TARGET} (pred / meas)",
        "max peak below uniform 1F1B's max, MiB (pred / meas)",
        f"simulated throughput >= {THROUGHPUT_TARGET} x best uniform PRT of the same direction "
        f"({'; '.join(plan.best[d][0].label for d in plan.picks)})",
    ]
    f1b_config, f1b_pred = plan.f1b
    columns = [
        target_cells(
            pick, measured, measured[f1b_config], plan.best_makespan(d), f1b_pred.max_total
        )
        for d, pick in plan.picks.items()
    ]
    labels = [pick.balanced[0].label for pick in plan.picks.values()]
    lines = [f"| target | {' | '.join(labels)} |", "|" + "---|" * (1 + len(labels))]
    for i, name in enumerate(names):
        cells = [f"{col[i][0]}: {'met' if col[i][1] else 'MISSED'}" for col in columns]
        lines.append(f"| {name} | {' | '.join(cells)} |")
    worst = worst_deviation(rows)
    verdict = "met" if worst <= AGREEMENT_TARGET else "MISSED"
    name = (
        f"measured activation peaks within {AGREEMENT_TARGET:.0%} of predicted (worst rank "
        f"of all {len(rows)} configurations)"
    )
    cells = [f"{worst:.2%}: {verdict}"] + [""] * (len(labels) - 1)
    lines.append(f"| {name} | {' | '.join(cells)} |")
    best_any = plan.best_uniform
    cells = [f"{best_any[1].makespan / p.balanced[1].makespan:.3f}" for p in plan.picks.values()]
    lines.append(
        f"| for comparison: simulated throughput vs the best uniform PRT of any direction "
        f"({best_any[0].label}) | {' | '.join(cells)} |"
    )
    return lines


def findings(plan: Plan, rows: Rows, costs: dict) -> list[str]:
    """Where the memory goes, in numbers from this run (activation peaks in micro-batches
    through the whole model)."""
    model_act = costs["activation_bytes"]
    _, f1b = plan.f1b
    top = max(range(len(f1b.totals)), key=lambda r: f1b.totals[r])
    lines = [
        f"- 1F1B's largest rank ({top}) holds {f1b.act[top] / model_act:.2f} micro-batches of "
        f"activations and {mib(f1b.state[top])} MiB of state."
    ]
    for direction, pick in plan.picks.items():
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
            f"- {', '.join(empty)}: a stage with no layer, embedding or head costs 0 activation "
            "bytes in the cost model, but the runtime keeps its input (one message, "
            f"{costs['message_bytes']} bytes) per micro-batch in flight: measured is higher."
        )
    return lines


def _has_pass_through_stage(config: Config) -> bool:
    return any(n == 0 for n in config.stage_layers[1:-1])


def candidate_table(plan: Plan) -> list[str]:
    """Every wave + balanced candidate of the picks, simulated."""
    f1b_max = plan.f1b[1].max_total
    lines = [
        "| candidate | stage layers | throughput vs best uniform, same direction | max MiB "
        "| max/min | max vs 1F1B |",
        "|" + "---|" * 6,
    ]
    for config, pred in plan.wave_candidates:
        best = plan.best_makespan(config.placement.direction)
        lines.append(
            f"| {config.label} | {layers_text(config)} | {best / pred.makespan:.3f} "
            f"| {mib(pred.max_total)} | {pred.balance:.3f} | {pred.max_total / f1b_max:.3f} |"
        )
    return lines


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
    lines = [
        "| placement | partition | stage layers | throughput vs best uniform, same direction "
        "| max MiB "
        "| max/min | max vs 1F1B |",
        "|" + "---|" * 7,
    ]
    for row in rows:
        where = placement_label(row.placement)
        if row.config is None:
            lines.append(f"| {where} | {row.variant} | {row.note} | | | | |")
            continue
        pred = row.pred
        lines.append(
            f"| {where} | {row.variant} | {layers_text(row.config)} "
            f"| {best[row.placement.direction] / pred.makespan:.3f} | {mib(pred.max_total)} "
            f"| {pred.balance:.3f} | {pred.max_total / f1b_max:.3f} |"
        )
    return lines


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
    lines = [
        "| seq | mbs | m | layer act/param | 1F1B max MiB | wave pick (slack 3%) | throughput "
        "| max/min | max vs 1F1B | least memory at the throughput target | throughput "
        "| max/min | max vs 1F1B |",
        "|" + "---|" * 13,
    ]
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
            lines.append("| " + " | ".join(cells) + " |")
    return lines


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
    rows = [
        "| m | 1F1B total | 1F1B rank 0 | R=2 total | R=2 per rank (mean) | R=4 per rank (mean) |"
    ]
    rows.append("|" + "---|" * 6)
    for m in sorted({microbatches, ranks, 2 * ranks, 4 * ranks}):
        f1b, r2, r4 = (inflight(r * ranks, m) for r in (1, 2, 4))
        rows.append(
            f"| {m} | {f1b:.2f} | {min(m, ranks) / ranks:.2f} | {r2:.2f} | {r2 / ranks:.2f} "
            f"| {r4 / ranks:.2f} |"
        )
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


# -- main ----------------------------------------------------------------------------------------
def costs_lines(costs: dict) -> list[str]:
    """The profiled parts, per micro-batch: ms and MiB."""
    lines = ["| part | fwd ms | bwd ms | act MiB | param MiB (16 B/param) |", "|---" * 5 + "|"]
    parts = [("embedding", costs["embedding"]), ("layer 0", costs["layers"][0])]
    parts += [("layers 1..L-1, mean", _mean_layer(costs["layers"][1:])), ("head", costs["head"])]
    for name, part in parts:
        lines.append(
            f"| {name} | {part['fwd'] * 1e3:.2f} | {part['bwd'] * 1e3:.2f} "
            f"| {mib(part['act'])} | {mib(part['param'])} |"
        )
    return lines


def _mean_layer(layers: list[dict]) -> dict:
    return {k: sum(layer[k] for layer in layers) / len(layers) for k in layers[0]}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smaller model, main tables only")
    p.add_argument("--out", help=f"markdown results file (default {DEFAULT_OUT}; none if --quick)")
    p.add_argument("--ranks", type=int, default=4, help="pipeline ranks P")
    p.add_argument(
        "--microbatches", "-m", type=int, help="micro-batches per iteration (default: P)"
    )
    p.add_argument("--layers", type=int)
    p.add_argument("--hidden", type=int)
    p.add_argument("--seq", type=int)
    p.add_argument("--mbs", type=int, help="sequences per micro-batch")
    p.add_argument("--vocab", type=int)
    p.add_argument("--save-costs", metavar="FILE", help="also write the profiled cost JSON")
    args = p.parse_args(argv)
    if args.out is None and not args.quick:
        args.out = DEFAULT_OUT
    if args.microbatches is None:
        args.microbatches = args.ranks
    return args


def model_of(args: argparse.Namespace) -> Bert:
    base = Bert(layers=12, hidden=64, seq=64, mbs=2, vocab=2048) if args.quick else Bert()
    given = {k: getattr(args, k) for k in ("layers", "hidden", "seq", "mbs", "vocab")}
    return replace(base, **{k: v for k, v in given.items() if v is not None})


def warm_imports() -> None:
    """Import megatron once here: forked ranks inherit it instead of each importing it."""
    for name in ("megatron.core.models.bert.bert_model", "megatron.core.optimizer"):
        importlib.import_module(name)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    model = model_of(args)
    started = time.perf_counter()
    warm_imports()
    say = partial(print, file=sys.stderr, flush=True)
    say(f"profiling {model} ...")
    costs = profile(model, reps=5)
    if args.save_costs:
        with open(args.save_costs, "w") as f:
            json.dump(costs, f, indent=1)
    say("planning ...")
    plan = make_plan(costs, args.ranks, args.microbatches)
    configs = list(dict(plan.measured()))
    say(f"measuring {len(configs)} configurations on {args.ranks} ranks ...")
    measured = dict(zip(configs, measure(model, configs, args.microbatches), strict=True))
    lines = report(argv, args, model, costs, plan, measured)
    if not args.quick:
        say("levers and regimes (simulated) ...")
        lines += investigation(args, model, costs, plan)
    lines += ["", f"Wall time: {time.perf_counter() - started:.0f} s."]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text)
    return 0


def report(argv: list[str], args, model: Bert, costs: dict, plan: Plan, measured) -> list[str]:
    """Steps 1-4 as markdown; ``argv`` the command's arguments."""
    rows = measured_rows(plan, measured)
    picks = ", ".join(p.balanced[0].label for p in plan.picks.values())
    return [
        "# Memory-balanced stage assignment: predicted vs measured",
        "",
        f"Command: `{' '.join(['python benchmarks/partition_memory.py', *argv])}`  ",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}; "
        f"{args.ranks} forked gloo ranks, one thread each.",
        "",
        f"Model: megatron-core BertModel (local spec, tied embeddings, binary head, fp32, "
        f"Adam), {model.layers} layers, hidden {model.hidden}, {model.heads} heads, seq "
        f"{model.seq}, micro-batch {model.mbs}, vocab {model.vocab}; P={args.ranks}, "
        f"m={args.microbatches} micro-batches.",
        "",
        "Profiled costs per micro-batch (`profile_model`, one rank, one thread):",
        "",
        *costs_lines(costs),
        "",
        f"Best uniform PRT (smallest simulated makespan over R in {{2,3,4}}, loop/wave, "
        f"even layers), per direction: {plan.best['uni'][0].label} and "
        f"{plan.best['bi'][0].label}; of any direction {plan.best_uniform[0].label}. Each "
        "pick is held against the best uniform PRT of its own direction: bi keeps two weight "
        "replicas per rank, a different memory class from uni. Wave + balanced picks: "
        f"{picks} (per direction, among R in {{2,3,4}} partitioned at the default "
        f"{DEFAULT_SLACK:.0%} slack: the smallest max peak with throughput >= "
        f"{THROUGHPUT_TARGET} of the best uniform PRT of that direction, else the fastest). "
        "Candidates:",
        "",
        *candidate_table(plan),
        "",
        "Per rank, MiB. *act*: peak activation bytes held for backward (pred: simulator on "
        "the profiled per-layer bytes; meas: the runtime's saved-tensor meter during a real "
        "training step). *act pred, mbs*: that peak in micro-batches through the whole model "
        "(embedding, layers, head). *state*: weights + gradients + Adam moments (pred: "
        "profiled parameter count x 16 bytes; meas: distinct storages of the parameters, "
        "DDP gradient buffers and Adam state after one real optimizer step). "
        "*total* = act + state.",
        "",
        *per_rank_table(rows, costs["activation_bytes"]),
        "",
        *summary_table(rows, plan),
        "",
        "## Targets",
        "",
        *targets_table(plan, measured, rows),
        "",
        *findings(plan, rows, costs),
    ]


def investigation(args, model: Bert, costs: dict, plan: Plan) -> list[str]:
    """The levers tried on the same profile, and other shapes and micro-batch counts."""
    best = {d: plan.best_makespan(d) for d in plan.best}
    f1b_max = plan.f1b[1].max_total
    rows = lever_rows(costs, args.ranks, args.microbatches, best, f1b_max)
    m = args.microbatches
    shapes = [(64, 1, m), (model.seq, 1, m), (model.seq, model.mbs, m), (model.seq, 4, m)]
    shapes += [(model.seq, model.mbs, k * m) for k in (2, 4, 8)]
    return [
        "",
        "## Levers (simulated, same profile)",
        "",
        "The partitioner per placement: at slack 3% (the default), 10%, 30%, at any speed "
        "(least memory), at the slack that just keeps throughput at the target (measured "
        "from the fastest partition it finds), and with 1F1B's max "
        f"({mib(f1b_max)} MiB) as the budget (fastest within it). loop/bi and wave/bi put "
        "the same model stages on each rank, so their rows coincide.",
        "",
        *lever_table(rows, best, f1b_max),
        "",
        *lever_findings(rows, best, f1b_max),
        "",
        "Reading: in 1F1B rank 0 holds P micro-batches of its 1/P of the model, about one "
        "micro-batch through the whole model, and later ranks less (*act pred, mbs* above). "
        "PRT ranks each hold about one or more with even stages, and bi ranks keep two "
        "weight replicas. The partitioner lowers a rank's peak by moving layers to stages "
        "with fewer micro-batches in flight (the late ones), which unbalances stage times: "
        "the slack, any-speed and budget rows show what that costs in throughput. Times "
        "are profiled on this machine: reruns move the throughput ratios by a few percent "
        "and with them the partitions a slack admits; the memory of a given partition is "
        "exact accounting and does not move.",
        "",
        *inflight_reading(args.ranks, m),
        "",
        "## Regimes (simulated; other shapes profiled with 2 layers, the rest repeated)",
        "",
        "Layer act/param: one micro-batch's activation bytes in one layer over that layer's "
        "parameter bytes (16 per parameter); small means weights dominate. Throughput is "
        "against the best uniform PRT of the same regime and direction.",
        "",
        *regime_table(regimes(model, args.ranks, shapes, costs)),
    ]


if __name__ == "__main__":
    sys.exit(main())
