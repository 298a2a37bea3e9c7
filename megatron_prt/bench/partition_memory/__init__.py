"""Memory-balanced stage assignment on a megatron-core BERT: predicted vs measured memory.

    python benchmarks/partition_memory.py           # writes out/bench/partition_memory.md
    python benchmarks/partition_memory.py --quick   # smaller model, main tables only, no file
    python benchmarks/partition_memory.py --out docs/benchmarks/partition_memory.md

Steps, all in one launch on CPU (forked gloo ranks, one thread each):

1. profile the model with :func:`megatron_prt.megatron.profile.profile_model` (BertModel,
   local spec, tied embeddings, binary head; fp32): per-layer time, activation and
   parameter bytes, plus the embedding and the head (the cost JSON);
2. choose the configurations (:func:`.cases.make_case`): uniform 1F1B (R=1 loop/uni);
   every uniform PRT configuration (R in {2,3,4}, loop/wave, uni/bi, even layers), the
   best by simulated makespan; wave + balanced partition
   (:func:`megatron_prt.tune.partition.partition`, default slack) for R in {2,3,4}, for
   uni and for bi one R picked by :func:`.cases.pick_wave`; per rank the simulator's
   peak activation bytes and the parameter bytes (weights + gradients + Adam moments, 16
   bytes per fp32 parameter), and the simulated makespan;
3. measure each chosen configuration on P real ranks with the megatron-core integration
   (``ReuseConfig`` with the stage layers, ``make_forward_backward_func(reuse,
   measure_memory=True)``, megatron's DDP and Adam, one training step:
   :func:`megatron_prt.megatron.bench.step_memory`): the activation
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
from dataclasses import replace
from functools import partial

import torch

from ...tune.partition import DEFAULT_SLACK
from ..report import md_table
from .cases import (
    DEFAULT_OUT,
    THROUGHPUT_TARGET,
    Bert,
    PartitionCase,
    make_case,
    measure,
    profile,
)
from .tables import (
    candidate_table,
    findings,
    inflight_reading,
    lever_findings,
    lever_rows,
    lever_table,
    measured_rows,
    mib,
    per_rank_table,
    regime_table,
    regimes,
    summary_table,
    targets_table,
)


# -- main ----------------------------------------------------------------------------------------
def costs_lines(costs: dict) -> list[str]:
    """The profiled parts, per micro-batch: ms and MiB."""
    header = ("part", "fwd ms", "bwd ms", "act MiB", "param MiB (16 B/param)")
    parts = [("embedding", costs["embedding"]), ("layer 0", costs["layers"][0])]
    parts += [("layers 1..L-1, mean", _mean_layer(costs["layers"][1:])), ("head", costs["head"])]
    cells = [
        (
            name,
            f"{part['fwd'] * 1e3:.2f}",
            f"{part['bwd'] * 1e3:.2f}",
            mib(part["act"]),
            mib(part["param"]),
        )
        for name, part in parts
    ]
    return md_table(header, "l" * len(header), cells)


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
    case = make_case(costs, args.ranks, args.microbatches)
    configs = list(dict(case.measured()))
    say(f"measuring {len(configs)} configurations on {args.ranks} ranks ...")
    measured = dict(zip(configs, measure(model, configs, args.microbatches), strict=True))
    lines = report(argv, args, model, costs, case, measured)
    if not args.quick:
        say("levers and regimes (simulated) ...")
        lines += investigation(args, model, costs, case)
    lines += ["", f"Wall time: {time.perf_counter() - started:.0f} s."]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text)
    return 0


def report(
    argv: list[str], args, model: Bert, costs: dict, case: PartitionCase, measured
) -> list[str]:
    """Steps 1-4 as markdown; ``argv`` the command's arguments."""
    rows = measured_rows(case, measured)
    picks = ", ".join(p.balanced[0].label for p in case.picks.values())
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
        f"even layers), per direction: {case.best['uni'][0].label} and "
        f"{case.best['bi'][0].label}; of any direction {case.best_uniform[0].label}. Each "
        "pick is held against the best uniform PRT of its own direction: bi keeps two weight "
        "replicas per rank, a different memory class from uni. Wave + balanced picks: "
        f"{picks} (per direction, among R in {{2,3,4}} partitioned at the default "
        f"{DEFAULT_SLACK:.0%} slack: the smallest max peak with throughput >= "
        f"{THROUGHPUT_TARGET} of the best uniform PRT of that direction, else the fastest). "
        "Candidates:",
        "",
        *candidate_table(case),
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
        *summary_table(rows, case),
        "",
        "## Targets",
        "",
        *targets_table(case, measured, rows),
        "",
        *findings(case, rows, costs),
    ]


def investigation(args, model: Bert, costs: dict, case: PartitionCase) -> list[str]:
    """The levers tried on the same profile, and other shapes and micro-batch counts."""
    best = {d: case.best_makespan(d) for d in case.best}
    f1b_max = case.f1b[1].max_total
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
