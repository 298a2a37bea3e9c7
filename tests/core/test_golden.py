"""Pinned plans, one per variant. Regenerate with `make golden` and review the diff."""

import pathlib
import shlex

import pytest

from megatron_prt.cli.main import build_parser
from megatron_prt.core import Placement, Plan, build_plan
from megatron_prt.core.lower import lower

HERE = pathlib.Path(__file__).parents[1] / "golden"
CASES = [
    line.split(maxsplit=1)
    for line in (HERE / "cases.txt").read_text().splitlines()
    if line.strip() and not line.startswith("#")
]


@pytest.mark.parametrize("name, flags", CASES)
def test_plan_matches_golden(name, flags):
    args = build_parser().parse_args(["plan", *shlex.split(flags)])
    placement = Placement(args.pp, args.reuse, args.placement, args.direction)
    plan = lower(build_plan(placement, args.microbatches, args.schedule))
    pinned = (HERE / f"{name}.csv").read_text()
    assert plan.to_csv() == pinned, f"{name} changed; run `make golden` and review the diff"
    assert Plan.from_csv(pinned) == plan
