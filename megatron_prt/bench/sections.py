"""Run the sections ``--model`` selects and list what they wrote."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from .flags import add_flags, command_line, finish


def run_sections(args: argparse.Namespace, command: str) -> list[str]:
    """Run the layer-stack and/or BERT sections (``args`` after :func:`flags.finish`);
    returns the paths written."""
    paths: list[str] = []
    if args.model in ("all", "layers"):
        from . import layer_stack

        paths += layer_stack.run(args, command)
    if args.model in ("all", "bert"):
        from . import bert

        paths += bert.run(args, command)
    return paths


def main(argv: Sequence[str] | None = None, prog: str = "megatron-prt bench") -> int:
    """Parse ``argv``, run, print the paths written; 0, or 2 with one error line."""
    parser = argparse.ArgumentParser(prog=prog, description=__doc__)
    add_flags(parser)
    args = parser.parse_args(argv)
    command = command_line(prog, args)
    try:
        finish(args)
    except ValueError as exc:
        parser.exit(2, f"{prog}: error: {exc}\n")
    for path in run_sections(args, command):
        print(f"wrote {path}")
    return 0
