"""``megatron-prt compare``: 1F1B, megatron's interleaved order, the PRT variants (and with
``--split-backward`` the zero-bubble ones) and torch's pipelining orders where torch
imports, simulated under one cost model, side by side."""

from __future__ import annotations

import argparse
import json

from ..core.placement import ConfigError, Placement
from ..core.validate import validate
from ..megatron.args import positive_int
from ..sim.cost import CostModel
from ..sim.simulate import SimResult, simulate
from .layers import check_even_split, filled_rows
from .main import build, check_cost_stage_layers, cost_flags, cost_from_args, split_flags
from .peers import peer_results


def add_parser(subparsers) -> argparse.ArgumentParser:
    c = subparsers.add_parser("compare", help="1F1B, interleaved and PRT variants side by side")
    c.add_argument("--pp", type=positive_int, required=True, help="pipeline ranks P")
    c.add_argument("--microbatches", "-m", type=positive_int, required=True, help="micro-batches m")
    c.add_argument("--reuse", type=positive_int, default=2, help="R for the reuse variants")
    c.add_argument("--json", action="store_true")
    split_flags(c, cap=False)
    cost_flags(c)
    return c


def compare_variants(
    pp: int, reuse: int, split_backward: bool = False
) -> list[tuple[str, Placement, str]]:
    """(label, placement, schedule) rows of ``megatron-prt compare``; ``split_backward``
    adds the zero-bubble rows (under 1F1B's activation memory)."""
    rows = [("1F1B", Placement(pp, 1), "1f1b")]
    rows.append((f"interleaved R={reuse}", Placement(pp, reuse), "interleaved"))
    rows += [
        (f"PRT loop/uni R={reuse}", Placement(pp, reuse, "loop"), "prt"),
        (f"PRT wave/uni R={reuse}", Placement(pp, reuse, "wave"), "prt"),
        ("Chimera-style bi R=1", Placement(pp, 1, "loop", "bi"), "prt"),
        (f"PRT loop/bi R={reuse}", Placement(pp, reuse, "loop", "bi"), "prt"),
        (f"PRT wave/bi R={reuse}", Placement(pp, reuse, "wave", "bi"), "prt"),
    ]
    if split_backward:
        rows += [
            ("ZB R=1 (ZB-H1)", Placement(pp, 1), "zb"),
            ("ZB wave/uni R=2 (ZB-V)", Placement(pp, 2, "wave"), "zb"),
            (f"ZB loop/uni R={reuse}", Placement(pp, reuse, "loop"), "zb"),
        ]
        if reuse != 2:  # at R = 2 it is ZB-V's row
            rows.append((f"ZB wave/uni R={reuse}", Placement(pp, reuse, "wave"), "zb"))
        rows += [
            ("ZB bi R=1", Placement(pp, 1, "loop", "bi"), "zb"),
            (f"ZB wave/bi R={reuse}", Placement(pp, reuse, "wave", "bi"), "zb"),
        ]
    return rows


def run(args: argparse.Namespace) -> int:
    cost = cost_from_args(args)
    results = _results(args, cost)
    base = results[0][1].makespan
    if not base > 0:
        raise ConfigError(
            "the costs give every stage zero time, so there is nothing to compare; give "
            "--fwd-time > 0 or a --costs file with nonzero fwd/bwd times"
        )
    if args.json:
        out = [
            {"variant": label, "skipped": why}
            if res is None
            else {"variant": label, "speedup_vs_1f1b": base / res.makespan, **res.to_dict()}
            for label, res, why in results
        ]
        print(json.dumps(out, indent=1))
    else:
        _print_table(args, cost, results)
    return 0


def _results(args: argparse.Namespace, cost: CostModel) -> list[tuple[str, SimResult | None, str]]:
    """``(label, result, why)`` per row, 1F1B first; ``result`` None (and ``why``) for a
    layout the cost file's layers cannot fill. Refuses when 1F1B itself cannot run."""
    variants = compare_variants(args.pp, args.reuse, args.split_backward)
    check_cost_stage_layers(args, cost, {placement.depth for _, placement, _ in variants})
    check_even_split(cost, args.pp, args.costs)  # 1F1B, the baseline, must run
    results: list[tuple[str, SimResult | None, str]] = []
    for label, placement, schedule in variants:
        try:
            check_even_split(cost, placement.depth, args.costs)
            plan = build(args, cost, placement, schedule)
        except ConfigError as exc:
            results.append((label, None, str(exc)))
            continue
        validate(plan)
        results.append((label, simulate(plan, cost), ""))
    peers = peer_results(args.pp, args.microbatches, args.reuse, cost, args.split_backward)
    return results + filled_rows(peers, cost, args.costs)


def _model_costs(cost: CostModel) -> tuple[float, float, float, str]:
    """The whole model's forward and backward time per micro-batch, the activation unit
    (bytes) and its words: one micro-batch through the whole model, from a per-layer cost
    file's own sums (its ``fwd_time``, ``bwd_time`` and ``activation_bytes`` are unused
    defaults) or from the flags; MiB where the file keeps no activation bytes."""
    what = "in units of one micro-batch through the whole model"
    if not cost.layers:
        return cost.fwd_time, cost.bwd_time, cost.activation_bytes, what
    parts = [p for p in (*cost.layers, cost.embedding, cost.head, cost.stage) if p is not None]
    fwd, bwd = sum(p.fwd for p in parts), sum(p.bwd for p in parts)
    held = sum(p.act for p in parts)
    return (fwd, bwd, held, what) if held > 0 else (fwd, bwd, 2**20, "in MiB")


def _hops(cost: CostModel, results: list) -> str:
    """The hop every cut costs, or the range of the cuts' own over the variants shown
    (layers giving ``out_bytes``: :meth:`CostModel.cut_message_bytes`)."""
    placements = {result.plan.placement for _, result, _ in results if result is not None}
    hops: set[float] = set()
    for placement in placements:
        p2p = cost.stage_times(placement).p2p
        hops |= set(p2p) if isinstance(p2p, tuple) else {p2p}
    if len(hops) <= 1:
        return f"{cost.hop_time:g}" if not hops else f"{hops.pop():g}"
    return f"{min(hops):g}-{max(hops):g} (per cut)"


def _print_table(args: argparse.Namespace, cost: CostModel, results: list) -> None:
    base = results[0][1].makespan
    sync = cost.has_replica_cost  # a column only when the sums after the step cost time
    title = "sums after" if cost.tied_grad_bytes else "replica sync"  # + the tied sum
    fwd, bwd, unit, what = _model_costs(cost)
    print(
        f"P={args.pp} m={args.microbatches} fwd={fwd:g} bwd={bwd:g} hop={_hops(cost, results)}   "
        f"(activation memory {what})"
    )
    header = (
        f"{'variant':<22} {'makespan':>9} {'bubble':>7} {'vs 1F1B':>8} "
        + (f"{title:>12} " if sync else "")
        + f"{'peak act max':>12} {'max/min':>7}  peak act per rank"
    )
    print(header)
    print("-" * len(header))
    for label, res, why in results:
        if res is None:
            print(f"{label:<22} {'n/a':>9}  ({why.split(';')[0]})")
            continue
        peaks = [r.peak_activation_bytes / unit for r in res.per_rank]
        ratio = max(peaks) / min(peaks) if min(peaks) > 0 else float("inf")
        summed = res.plan.placement.direction == "bi" or res.tied_sync_time > 0
        after = res.replica_sync_time + res.tied_sync_time
        print(
            f"{label:<22} {res.makespan:>9.4g} {res.bubble_fraction:>7.1%} "
            f"{base / res.makespan:>7.3f}x "
            + ((f"{after:>12.4g} " if summed else f"{'-':>12} ") if sync else "")
            + f"{max(peaks):>12.3f} {ratio:>7.2f}  "
            + " ".join(f"{p:.2f}" for p in peaks)
        )
