"""``megatron-prt bench``: measured PRT vs 1F1B (and torch.distributed.pipelining) on local
CPU ranks, with the simulator's predictions; report, chart and data under ``--out``.

Sections (``--model``): an MLP layer stack against torch.distributed.pipelining's schedules
(``vs_torch_pipelining.{md,png,json}``) and megatron-core's BERT
(``megatron_bert.{md,png,json}``). It starts its own gloo ranks (forked, one thread each);
progress goes to stderr. torch and megatron-core load only when the command runs.
"""

from __future__ import annotations

import argparse
import sys

from ..bench.flags import add_flags, command_line, finish


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``bench`` on an ``add_subparsers()`` object; returns its parser."""
    p = subparsers.add_parser(
        "bench",
        help="measure PRT vs 1F1B and torch.distributed.pipelining on local CPU ranks",
        description=__doc__.split("\n\n")[0],
    )
    add_flags(p)
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Run the selected sections; 0, or 2 with one error line for bad flags."""
    command = command_line("megatron-prt bench", args)
    try:
        finish(args)
    except ValueError as exc:
        print(f"megatron-prt bench: error: {exc}", file=sys.stderr)
        return 2
    from ..bench.sections import run_sections

    for path in run_sections(args, command):
        print(f"wrote {path}")
    return 0
