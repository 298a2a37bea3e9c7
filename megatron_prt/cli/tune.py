"""``megatron-prt tune``: the fastest plan that fits the memory budget, from measured costs.

Searches schedule family, reuse, placement, direction, layer partition and the plan built
for the real costs (:mod:`megatron_prt.tune.search_plans`), prints the top candidates and
writes the winner as a plan file (``-o``) that ``--pipeline-reuse-plan``, the plain-PyTorch
runtime (:func:`megatron_prt.tune.plan_file.load_plan`) and ``simulate --plan`` run as it is.
Errors: one line on stderr, exit status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from ..core.layers import check_layers_fill_stages
from ..core.placement import ConfigError
from ..sim.cost import CostModel
from ..sim.model_shape import describe_shape
from ..tune.memory import format_bytes
from ..tune.plan_file import PlanFile, recompute_of
from ..tune.search_plans import Candidate, TuneResult, tune
from .main import check_output, load_costs, positive_int, recompute_flags, recompute_label
from .partition import parse_bytes

PROGRESS_AFTER_S = 2.0  # searches shorter than this print no progress line


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``tune`` on an ``add_subparsers()`` object; returns its parser."""
    p = subparsers.add_parser(
        "tune",
        help="choose the fastest plan within a memory budget from measured costs",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument(
        "--costs",
        metavar="FILE",
        required=True,
        help='cost model JSON with a per-layer "layers" list (`megatron-prt profile` writes one)',
    )
    p.add_argument("--pp", type=positive_int, required=True, help="pipeline ranks P")
    p.add_argument("--microbatches", "-m", type=positive_int, required=True, help="micro-batches m")
    p.add_argument(
        "--memory-budget",
        type=parse_bytes,
        metavar="BYTES",
        help="per-rank limit on peak activations + parameters (40GiB, 40GB, 4e10); "
        "default: no limit",
    )
    p.add_argument(
        "--max-reuse",
        type=positive_int,
        metavar="R",
        help="try reuse factors up to R (default: up to layers // P, every stage a layer)",
    )
    p.add_argument(
        "--no-split-backward",
        dest="split_backward",
        action="store_false",
        help="leave the split-backward (zero-bubble) schedules out of the search",
    )
    p.add_argument(
        "--jobs",
        type=positive_int,
        default=min(2, os.cpu_count() or 1),
        help="processes scoring schedule families at once (default: 2, or 1 on one core)",
    )
    recompute_flags(p)
    p.add_argument(
        "--top",
        type=positive_int,
        default=10,
        help="candidates in the table (default 10; --json lists every one)",
    )
    p.add_argument("-o", "--output", metavar="FILE", help="write the winner as a plan file")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    try:
        if args.pp < 2:
            raise ConfigError(
                f"--pp {args.pp}: a pipeline needs 2 ranks or more (one rank runs the model "
                "whole, with nothing to schedule); give --pp 2 or more"
            )
        check_output(args.output, "plan.json")
        cost = load_costs(args.costs, args=args)
        if not cost.layers:
            raise ConfigError(
                f'--costs {args.costs}: no per-layer "layers" list, which tuning needs '
                "(`megatron-prt profile` writes one)"
            )
        # the training flags' rule: every plan tuned here is one they run (R = 1 at least)
        check_layers_fill_stages(
            len(cost.layers), args.pp, f"--costs {args.costs}: layer count", "--pp"
        )
        result = tune(
            cost,
            args.pp,
            args.microbatches,
            budget_bytes=args.memory_budget,
            reuse_limit=args.max_reuse,
            split_backward=args.split_backward,
            jobs=args.jobs,
            progress=_Progress(),
        )
        if args.memory_budget is not None and not any(c.peak_bytes for c in result.ranked):
            raise ConfigError(  # priced after recomputation, whose bytes may be its own
                f"--memory-budget: --costs {args.costs} prices no plan's memory (no act or "
                "param bytes), so every plan would fit; profile them (`megatron-prt profile` "
                "writes both) or drop --memory-budget"
            )
        if args.output:
            plan_file(result.winner, args, cost).write(args.output)
    except ConfigError as exc:
        print(f"megatron-prt: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(_as_json(result, args, cost), indent=1))
    else:
        print(format_result(result, args, cost))
    return 0


def plan_file(winner: Candidate, args: argparse.Namespace, cost: CostModel) -> PlanFile:
    """The winner with its partition, what was predicted for it and the activation
    recomputation it was priced under (``recompute``: megatron's granularity, method and
    layers; ``simulate --plan`` prices with it, ``--pipeline-reuse-plan`` compares it with
    the training flags; ``model``: the shape the costs were profiled on, when the cost file
    says)."""
    tuned = {"costs": args.costs, "memory_budget": args.memory_budget, **winner.to_dict()}
    tuned["recompute"] = recompute_of(cost)
    if cost.model is not None:  # the shape the costs were measured on: sim/model_shape.py
        tuned["model"] = cost.model
    return PlanFile(winner.plan, winner.stage_layers, tuned)


class _Progress:
    """Once the search has run :data:`PROGRESS_AFTER_S`: a line on stderr per scored family,
    rewritten in place on a terminal."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.shown = False
        self.in_place = sys.stderr.isatty()

    def __call__(self, done: int, total: int, label: str) -> None:
        elapsed = time.perf_counter() - self.start
        if elapsed < PROGRESS_AFTER_S and not self.shown:
            return
        self.shown = True
        line = f"tune: {done}/{total} schedule families scored, {elapsed:.0f} s (last: {label})"
        if self.in_place:
            end = "\n" if done == total else ""
            print(f"\r{line:<78}", end=end, file=sys.stderr, flush=True)
        else:
            print(line, file=sys.stderr, flush=True)


def _as_json(result: TuneResult, args: argparse.Namespace, cost: CostModel) -> dict:
    config = {"pp": args.pp, "microbatches": args.microbatches, "costs": args.costs}
    return {
        "config": config | {"model": cost.model, "recompute": recompute_of(cost)},
        "memory_budget": result.budget_bytes,
        "seconds": result.seconds,
        "winner": result.winner.to_dict(),
        "candidates": [c.to_dict() | {"fits": c.fits(result.budget_bytes)} for c in result.ranked],
        "skipped": [{"family": label, "why": why} for label, why in result.skipped],
        "plan_file": args.output,
    }


def format_result(result: TuneResult, args: argparse.Namespace, cost: CostModel) -> str:
    """The ranked table and the winner; the costs' shape (``cost.model``), a line when given
    (a profiled file: its times are seconds, said in the header); the recomputation priced
    in the header when there is one."""
    model = cost.model
    budget = "none" if result.budget_bytes is None else format_bytes(result.budget_bytes)
    priced = recompute_label(cost)
    fitting = result.fitting()
    lines = [
        f"tune: P={args.pp} m={args.microbatches} costs {args.costs}, memory budget {budget}"
        + ("" if priced == "none" else f", recompute {priced}"),
        *([f"model: {describe_shape(model)}"] if model else []),
        f"{len(result.ranked)} candidates scored in {result.seconds:.1f} s, "
        f"{len(fitting)} fit; top {min(args.top, len(fitting))}:",
        "",
        f"{'#':>3}  {'schedule':<26}{'partition':<10}{'planned for':<18}"
        f"{'time s' if model else 'time':>10}{'vs 1F1B':>9}{'bubble':>8}{'peak/rank':>11}"
        f"{'msgs':>7}",
    ]
    base = _one_f_one_b(result)
    for i, c in enumerate(fitting[: args.top], 1):
        speed = f"{base / c.makespan:.3f}x" if base else "-"
        lines.append(
            f"{i:>3}  {c.label:<26}{c.partition:<10}{c.planned_for:<18}{c.makespan:>10.5g}"
            f"{speed:>9}{c.result.bubble_fraction:>8.1%}{format_bytes(c.peak_bytes):>11}"
            f"{c.result.p2p_messages:>7}"
        )
    w = result.winner
    lines += [
        "",
        f"winner: {w.label}, {w.partition} partition, plan for {w.planned_for}",
        f"  stage layers {','.join(map(str, w.stage_layers))}",
    ]
    if args.output:
        lines.append(f"  wrote {args.output}")
    for label, why in result.skipped:
        lines.append(f"skipped {label}: {why}")
    return "\n".join(lines)


def _one_f_one_b(result: TuneResult) -> float:
    times = [c.makespan for c in result.ranked if c.family.schedule == "1f1b"]
    return min(times) if times else 0.0
