"""How long planning takes: build_plan + the full validation, lower + the full validation.

    python benchmarks/planner_speed.py                  # P=64 R=8 m=512, 4 variants; P=8 m=64
    python benchmarks/planner_speed.py 64,8,wave,bi,512 16,4,loop,uni,128

Times are CPU seconds of this process (``time.process_time``), so other work on a shared
machine inflates them less than wall time; every case starts from empty planner caches.
Every validation is ``validate(replace(plan), full=True)``: a fresh copy of the plan, with no
mark or compiled replay its producer left, checked from its actions alone (what a plan read
from a file costs; :mod:`megatron_prt.core.validate`). ``--trusted`` adds the seconds of a
plain ``validate`` of the plans as built, which returns at once for plans their producer
vouches for.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from dataclasses import replace

from ..core import Placement, build_plan
from ..core.greedy import compile_graph
from ..core.lower import lower
from ..core.schedules import _prt_portfolio
from ..core.validate import validate

DEFAULT_CASES = (
    "64,8,loop,uni,512",
    "64,8,wave,uni,512",
    "64,8,loop,bi,512",
    "64,8,wave,bi,512",
    "8,1,loop,uni,64",
    "8,4,wave,bi,64",
)


def parse_case(text: str) -> tuple[Placement, int]:
    """``P,R,placement,direction,m`` -> (placement, m); ValueError names the bad case."""
    try:
        ranks, reuse, placement, direction, m = text.split(",")
        return Placement(int(ranks), int(reuse), placement, direction), int(m)
    except ValueError as exc:
        raise ValueError(f"case {text!r}: expected P,R,loop|wave,uni|bi,m ({exc})") from None


def time_case(
    placement: Placement, num_microbatches: int, lowering: bool = True, trusted: bool = False
) -> dict:
    """CPU seconds of each planning step for one configuration, from empty caches."""
    _prt_portfolio.cache_clear()
    compile_graph.cache_clear()
    clock = time.process_time
    t0 = clock()
    plan = build_plan(placement, num_microbatches)
    t1 = clock()
    validate(replace(plan), full=True)
    t2 = clock()
    row = {"actions": sum(map(len, plan.ranks)), "build": t1 - t0, "validate": t2 - t1}
    row["build+validate"] = t2 - t0
    if lowering:
        lowered = lower(plan)
        t3 = clock()
        validate(replace(lowered), full=True)
        t4 = clock()
        row |= {"lower": t3 - t2, "validate lowered": t4 - t3, "lower+validate": t4 - t2}
        row["all"] = t4 - t0
    if trusted:
        t5 = clock()
        validate(plan)
        if lowering:
            validate(lowered)
        row["trusted validates"] = clock() - t5
    return row


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="planner_speed", description=__doc__)
    parser.add_argument("cases", nargs="*", default=DEFAULT_CASES, help="P,R,placement,dir,m")
    parser.add_argument("--no-lower", action="store_true", help="time build and validate only")
    parser.add_argument(
        "--trusted", action="store_true", help="also time validate() of the vouched plans"
    )
    args = parser.parse_args(argv)
    try:
        cases = [(text, *parse_case(text)) for text in args.cases]
    except ValueError as exc:
        parser.exit(2, f"planner_speed: error: {exc}\n")
    columns = ["build", "validate", "build+validate"]
    if not args.no_lower:
        columns += ["lower", "validate lowered", "lower+validate", "all"]
    if args.trusted:
        columns.append("trusted validates")
    print(f"{'case':<20} {'actions':>8} " + " ".join(f"{c:>{max(len(c) + 2, 8)}}" for c in columns))
    for text, placement, m in cases:
        row = time_case(placement, m, lowering=not args.no_lower, trusted=args.trusted)
        cells = " ".join(f"{row[c]:>{max(len(c) + 2, 8) - 1}.2f}s" for c in columns)
        print(f"{text:<20} {row['actions']:>8} {cells}", flush=True)
    return 0
