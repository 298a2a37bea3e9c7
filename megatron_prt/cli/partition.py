"""``megatron-prt partition``: choose per-stage layer counts from a cost model.

Prints the chosen (``balanced``) partition next to the uniform one: layers per model stage,
and per rank the predicted busy time, peak activation bytes, parameter bytes and their sum.
``--json`` prints the same as data. Errors: one line on stderr, exit status 2.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from ..core.layers import check_layers_fill_stages
from ..core.placement import DIRECTIONS, PLACEMENTS, ConfigError, Placement
from ..core.schedules import SCHEDULES
from ..megatron.args import byte_count as parse_bytes
from ..sim.cost import CostModel
from ..sim.simulate import RankStats
from ..tune.partition import (
    DEFAULT_SLACK,
    PartitionResult,
    PartitionStats,
    format_bytes,
    partition,
)
from .main import load_costs, positive_int, recompute_flags, recompute_label


def parse_fraction(text: str) -> float:
    """``0.03`` or ``3%``."""
    try:
        value = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(
            f"expected a fraction >= 0 such as 0.03 or 3%, got {text!r}"
        )
    return value


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``partition`` on an ``add_subparsers()`` object; returns its parser."""
    p = subparsers.add_parser(
        "partition",
        help="choose layers per stage from per-layer costs (memory-balanced)",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("--pp", type=positive_int, required=True, help="pipeline ranks P")
    p.add_argument("--reuse", type=positive_int, default=1, help="virtual stages per rank R")
    p.add_argument("--placement", choices=PLACEMENTS, default="loop")
    p.add_argument("--direction", choices=DIRECTIONS, default="uni")
    p.add_argument("--microbatches", "-m", type=positive_int, required=True, help="micro-batches m")
    p.add_argument("--schedule", choices=SCHEDULES, default="prt")
    p.add_argument(
        "--costs",
        metavar="FILE",
        required=True,
        help='cost model JSON with a per-layer "layers" list (+ "embedding", "head")',
    )
    p.add_argument(
        "--budget",
        type=parse_bytes,
        metavar="BYTES",
        help="per-rank limit on peak activations + parameters (24GiB, 24GB, 2.5e10): "
        "the fastest partition within it. Without it: the least peak memory within "
        "--slack of the fastest",
    )
    p.add_argument(
        "--slack",
        type=parse_fraction,
        default=None,
        help=f"time given up for memory without --budget (default {DEFAULT_SLACK:g} = "
        f"{DEFAULT_SLACK:.0%})".replace("%", "%%"),  # argparse formats help with %
    )
    recompute_flags(p)
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    return p


def run(args: argparse.Namespace) -> int:
    """Run the subcommand; returns the exit status (2: bad configuration, one line)."""
    try:
        cost = load_costs(args.costs, args=args)
        placement = Placement(args.pp, args.reuse, args.placement, args.direction)
        if cost.layers:  # the training flags' rule: every split printed here is one they run
            depth, costs = placement.depth, f"--costs {args.costs}: layer count"
            check_layers_fill_stages(len(cost.layers), depth, costs, "--reuse or --pp")
        if args.budget is not None and args.slack is not None:
            raise ConfigError(
                "--slack trades time for memory without --budget; with --budget the fastest "
                "partition within it is chosen: drop one of them"
            )
        result = partition(
            cost,
            placement,
            args.microbatches,
            budget_bytes=args.budget,
            slack=DEFAULT_SLACK if args.slack is None else args.slack,
            schedule=args.schedule,
        )
        if args.budget is not None and not (
            result.balanced.peak_bytes or result.uniform.peak_bytes
        ):
            raise ConfigError(  # as tune refuses --memory-budget
                f"--budget: --costs {args.costs} prices no partition's memory (no act or param "
                "bytes), so every one would fit; profile them (`megatron-prt profile` writes "
                "both) or drop --budget"
            )
    except ConfigError as exc:
        print(f"megatron-prt: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"config": _config(args, cost), **result.to_dict()}, indent=1))
    else:
        text = format_result(result, placement, args.microbatches, len(cost.layers))
        if cost.recompute_granularity is not None:  # say what the numbers priced
            text = text.replace("\n", f", recompute {recompute_label(cost)}\n", 1)
        print(text)
    return 0


def _config(args: argparse.Namespace, cost: CostModel) -> dict:
    return {
        "pp": args.pp,
        "reuse": args.reuse,
        "placement": args.placement,
        "direction": args.direction,
        "microbatches": args.microbatches,
        "schedule": args.schedule,
        "layers": len(cost.layers),
        "recompute_granularity": cost.recompute_granularity,
        "recompute_method": cost.recompute_method,
        "recompute_num_layers": cost.recompute_num_layers,
    }


# -- text --------------------------------------------------------------------------------------
def format_result(
    result: PartitionResult, placement: Placement, num_microbatches: int, num_layers: int
) -> str:
    """The text report: header, totals, layers per stage, per-rank table."""
    uni, bal = result.uniform, result.balanced
    lines = [
        f"partition: P={placement.ranks} R={placement.reuse} {placement.placement}/"
        f"{placement.direction} m={num_microbatches}, {num_layers} layers over "
        f"D={placement.depth} stages",
        *_objective(result),
        "",
        f"{'':<16}{'uniform':>12}{'balanced':>12}",
        f"{'makespan':<16}{uni.makespan:>12.6g}{bal.makespan:>12.6g}"
        f"  ({_change(bal.makespan, uni.makespan)})",
        f"{'peak memory':<16}{format_bytes(uni.peak_bytes):>12}"
        f"{format_bytes(bal.peak_bytes):>12}"
        f"  ({_change(bal.peak_bytes, uni.peak_bytes)}, max over ranks)",
        "",
        f"layers per model stage 0..{placement.depth - 1}:",
        f"  uniform   {' '.join(map(str, uni.stage_layers))}",
        f"  balanced  {' '.join(map(str, bal.stage_layers))}",
        "",
        *_rank_table(uni, bal),
    ]
    return "\n".join(lines)


def _objective(result: PartitionResult) -> list[str]:
    if result.objective == "time":
        goal = f"fastest within the budget of {format_bytes(result.budget_bytes)} per rank"
    else:
        goal = (
            f"least peak memory within {result.slack:.1%} of the fastest found "
            f"(makespan {result.fastest_makespan:.6g})"
        )
    how = "exact, every partition" if result.exact else "heuristic"
    return [f"objective: {goal}", f"search:    {how}, {result.simulated} simulated"]


def _rank_table(uni: PartitionStats, bal: PartitionStats) -> list[str]:
    cols = f"{'busy':>10}{'act':>11}{'params':>11}{'peak':>11}"
    width = len(cols)
    out = [
        f"{'':<4} | {' uniform '.center(width, '-')} | {' balanced '.center(width, '-')}",
        f"{'rank':<4} | {cols} | {cols}",
    ]
    for u, b in zip(uni.per_rank, bal.per_rank, strict=True):
        out.append(f"{u.rank:<4} | {_rank_cells(u)} | {_rank_cells(b)}")
    return out


def _rank_cells(stats: RankStats) -> str:
    act, params = stats.peak_activation_bytes, stats.param_bytes
    sizes = "".join(f"{format_bytes(b):>11}" for b in (act, params, act + params))
    return f"{stats.busy:>10.5g}{sizes}"


def _change(new: float, old: float) -> str:
    return f"{new / old - 1:+.1%}" if old else "n/a"
