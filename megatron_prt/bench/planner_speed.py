"""How long planning takes: build_plan + the full validation, lower + the full validation.

    python benchmarks/planner_speed.py                  # P=64 R=8 m=512, 4 variants; P=8 m=64
    python benchmarks/planner_speed.py 64,8,wave,bi,512 16,4,loop,uni,128

Times are CPU seconds of this process (``time.process_time``), so other work on a shared
machine inflates them less than wall time; every case starts from empty planner caches.
Every validation is ``validate(replace(plan), full=True)``: a fresh copy of the plan, with no
mark or compiled replay its producer left, checked from its actions alone (what a plan read
from a file costs; :mod:`megatron_prt.core.validate`). ``--trusted`` adds the seconds of a
plain ``validate`` of the plans as built, which returns at once for plans their producer
vouches for; ``--close`` the seconds of :func:`~megatron_prt.core.validate.check_closely`, the
action-by-action checks (what the full validation cost before the flat check).

The lowered plan's column, ``validate both``, is
:func:`~megatron_prt.core.validate.validate_lowering` of fresh copies of both plans: the full
validation of the plan and of its lowering, where the check of the lowering covers the plan's
(:mod:`megatron_prt.core.flatcheck`, [Note: a lowering's check covers its plan]). ``all`` is
the whole path with both plans fully validated: build + lower + validate both.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

from ..core import Placement, build_plan
from ..core.greedy import compile_graph
from ..core.lower import lower
from ..core.plan import Plan
from ..core.schedules import _prt_portfolio
from ..core.validate import check_closely, validate, validate_lowering

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
    placement: Placement,
    num_microbatches: int,
    lowering: bool = True,
    trusted: bool = False,
    close: bool = False,
) -> dict:
    """CPU seconds of each planning step for one configuration, from empty caches."""
    _prt_portfolio.cache_clear()
    compile_graph.cache_clear()
    clock = time.process_time
    t0 = clock()
    plan = build_plan(placement, num_microbatches)
    row = {"actions": sum(map(len, plan.ranks)), "build": clock() - t0}
    row["validate"] = _seconds(validate, _fresh(plan), full=True)
    row["build+validate"] = row["build"] + row["validate"]
    if lowering:
        t1 = clock()
        lowered = lower(plan)
        row["lower"] = clock() - t1
        row["validate both"] = _seconds(validate_lowering, _fresh(plan), _fresh(lowered))
        row["lower+validate"] = row["lower"] + row["validate both"]
        row["all"] = row["build"] + row["lower+validate"]
    if trusted:
        row["trusted validates"] = _seconds(validate, plan)
        if lowering:
            row["trusted validates"] += _seconds(validate, lowered)
    if close:
        row["close checks"] = _seconds(check_closely, _fresh(plan))
        if lowering:
            row["close checks lowered"] = _seconds(check_closely, _fresh(lowered))
    return row


def _fresh(plan: Plan) -> Plan:
    """A copy of ``plan`` without its producer's mark or kept replay, as if read from a file.
    Made off the clock: the first allocations after building a plan may run the cyclic
    collector over its half a million actions (0.1 s at P=64, m=512), a cost of holding the
    plan that would land on whatever step came first."""
    return replace(plan)


def _seconds(step: Callable, *args, **kwargs) -> float:
    clock = time.process_time
    start = clock()
    step(*args, **kwargs)
    return clock() - start


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="planner_speed",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("cases", nargs="*", default=DEFAULT_CASES, help="P,R,placement,dir,m")
    parser.add_argument("--no-lower", action="store_true", help="time build and validate only")
    parser.add_argument(
        "--trusted", action="store_true", help="also time validate() of the vouched plans"
    )
    parser.add_argument(
        "--close",
        action="store_true",
        help="also time check_closely (the action-by-action checks: the full check before "
        "the flat check)",
    )
    args = parser.parse_args(argv)
    try:
        cases = [(text, *parse_case(text)) for text in args.cases]
    except ValueError as exc:
        parser.exit(2, f"planner_speed: error: {exc}\n")
    columns = ["build", "validate", "build+validate"]
    if not args.no_lower:
        columns += ["lower", "validate both", "lower+validate", "all"]
    if args.trusted:
        columns.append("trusted validates")
    if args.close:
        columns += ["close checks"] + ([] if args.no_lower else ["close checks lowered"])
    print(f"{'case':<20} {'actions':>8} " + " ".join(f"{c:>{max(len(c) + 2, 8)}}" for c in columns))
    for text, placement, m in cases:
        row = time_case(
            placement, m, lowering=not args.no_lower, trusted=args.trusted, close=args.close
        )
        cells = " ".join(f"{row[c]:>{max(len(c) + 2, 8) - 1}.2f}s" for c in columns)
        print(f"{text:<20} {row['actions']:>8} {cells}", flush=True)
    return 0
