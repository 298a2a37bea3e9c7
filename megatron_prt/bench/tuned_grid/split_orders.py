"""Two zero-bubble orders of one configuration, measured side by side: R = 1 uni in split
backward as built for equal unit stages (``build_plan(..., "zb")``) and as the tuner and the
grid build it for the stack's traced costs (:func:`.stacks.split_reference`, the tuned
grid's split fit step), with 1F1B beside them, on the tuned grid's stacks (2 gloo ranks,
one thread each, shared memory), the three timed in interleaved seeded shuffled rounds in
one launch; each also simulated under the traced costs. What [Note: the split form in
place] rests on: the two orders priced alike, measured apart.

Every timed step is traced: each rank's compute time per operation (the sum of its actions'
spans, from inputs ready to compute done, so waits for messages are left out) shows whether
an order's time goes to waiting or to the compute itself taking longer in that order.

    python benchmarks/split_orders.py --reps 41   # out/bench/split_orders.{md,json}
    python benchmarks/split_orders.py --smoke     # tiny stacks, seconds

Flags are the tuned grid's (``--stacks``, ``-m``, ``--reps``, ``--warmup``, the stacks'
sizes, ``--out``); the others are ignored.
"""

from __future__ import annotations

import statistics
import sys
from collections import defaultdict
from collections.abc import Sequence

from ...core import Placement, build_plan
from ...core.layers import even_layers
from ...runtime.cpu import keep_freed_memory
from ...runtime.local import all_ok, run_local
from ...sim.cost import CostModel
from ...sim.simulate import simulate
from ..common import interleaved_times, say
from ..report import launch, md_table, ms, write_report
from . import parse_args
from .grid import Entry, GridRunner
from .stacks import profile_layers, split_reference

NAME = "split_orders"
ORDERS = ("1F1B", "zb, order for unit stages", "zb, order for the traced costs")


def _plans(cost: CostModel, world: int, m: int) -> dict:
    placement = Placement(world, 1)
    return dict(
        zip(
            ORDERS,
            (
                build_plan(placement, m, "1f1b"),
                build_plan(placement, m, "zb"),
                split_reference(cost, world, m),
            ),
            strict=True,
        )
    )


class _TracedRunner(GridRunner):
    """A grid runner that keeps, per timed step, this rank's compute seconds per operation
    (``F``, ``B``, ``I``, ``W``: the sum of the step's action spans)."""

    def __init__(self, *args) -> None:
        super().__init__(*args, trace=True)
        self.busy: list[dict[str, float]] = []

    def step(self) -> None:
        super().step()
        per_op: dict[str, float] = defaultdict(float)
        for action, start, end in self.runtime.trace():
            per_op[action.op.name] += end - start
        self.busy.append(dict(per_op))


def _median_busy(steps: list[dict[str, float]]) -> dict[str, float]:
    """Per operation, and in all (``all``), the median over steps of the compute seconds."""
    ops = sorted({op for step in steps for op in step})
    busy = {op: statistics.median(step.get(op, 0.0) for step in steps) for op in ops}
    busy["all"] = statistics.median(sum(step.values()) for step in steps)
    return busy


def _stack(rank: int, world: int, stack: str, args) -> dict:
    """One stack: its traced costs, the three plans timed interleaved and simulated, and
    this rank's compute seconds per operation in each."""
    say(f"split orders, {stack}: tracing the layers")
    cost = CostModel(layers=tuple(profile_layers(rank, world, stack, args)))
    m = args.microbatches
    plans = _plans(cost, world, m)
    even = even_layers(args.layers, world)
    runners = {
        key: _TracedRunner(Entry(key, plan.compute_only(), even), stack, rank, args, m)
        for key, plan in plans.items()
    }
    for runner in runners.values():
        for _ in range(args.warmup):
            runner.zero_grad()
            runner.step()
        runner.busy.clear()
    times = interleaved_times(runners, args.reps, f"split orders, {stack}:")
    for runner in runners.values():
        runner.close()
    return {
        key: {
            "measured_s": statistics.median(times[key]),
            "simulated_s": simulate(
                plan, cost.split_form() if plan.split_backward else cost
            ).makespan,
            "plan": [" ".join(map(str, actions)) for actions in plan.compute_only().ranks],
            "busy_s": _median_busy(runners[key].busy),
        }
        for key, plan in plans.items()
    }


def worker(rank: int, world: int, args) -> dict:
    keep_freed_memory()  # as the tuned grid ([Note: freed memory kept])
    return {stack: _stack(rank, world, stack, args) for stack in args.stacks}


def _busy_cell(busy: dict[str, float]) -> str:
    ops = " / ".join(f"{op} {1e3 * busy[op]:.1f}" for op in "FBIW" if op in busy)
    return f"{1e3 * busy['all']:.1f} ({ops})"


def _busy_rows(summary: dict) -> list[tuple]:
    """Per stack and order: each rank's compute ms, and the busiest rank's compute over the
    same rank's in the order for the traced costs."""
    rows = []
    for stack, orders in summary.items():
        for key, record in orders.items():
            per_rank = record["busy_s"]
            rank = max(range(len(per_rank)), key=lambda r: per_rank[r]["all"])
            ratio = per_rank[rank]["all"] / orders[ORDERS[2]]["busy_s"][rank]["all"]
            rows.append((stack, key, *map(_busy_cell, per_rank), f"{ratio:.3f} (rank {rank})"))
    return rows


def markdown(summary: dict, info: dict, args) -> str:
    """The report: both orders' medians and predictions, each rank's compute per order,
    and the orders themselves (``summary[stack][order]["busy_s"]`` holds every rank's)."""
    unit, costs = ORDERS[1], ORDERS[2]
    rows = [
        (
            stack,
            *(ms(r[key]["measured_s"]) for key in ORDERS),
            f"{r[unit]['measured_s'] / r[costs]['measured_s']:.3f}",
            f"{r[unit]['simulated_s'] / r[costs]['simulated_s']:.3f}",
        )
        for stack, r in summary.items()
    ]
    header = (
        "stack",
        *(f"{key} ms" for key in ORDERS),
        "unit / costs, measured",
        "unit / costs, simulated",
    )
    lines = [
        "# Two zero-bubble orders of one configuration (CPU, 2 ranks, one thread each)",
        "",
        f"Command: `{info['command']}`; wall time {info['wall_s']:.0f} s; load average "
        f"{info['load_start']:.1f} at start, {info['load_end']:.1f} at end.",
        "",
        f"R = 1, P = 2, m = {args.microbatches}; medians of {args.reps} interleaved steps each "
        "(the slowest rank's wall time) after "
        f"{args.warmup} untimed; simulated under the stack's traced costs (split plans in "
        "the split form, as the tuner prices them).",
        "",
        *md_table(header, "lrrrrr", rows),
        "",
        "Compute per rank (medians over the timed steps of the summed action spans, from "
        "inputs ready to compute done: waits for messages left out), ms, in all and per "
        "operation; the last column is the busiest rank's compute over the same rank's in "
        "the order for the traced costs (the simulator prices an action the same in any "
        "order):",
        "",
        *md_table(
            ("stack", "order", "rank 0 compute ms", "rank 1 compute ms", "busiest vs costs order"),
            "llrrr",
            _busy_rows(summary),
        ),
        "",
        *(
            f"* {stack}, {key}: `{' | '.join(r[key]['plan'])}`"
            for stack, r in summary.items()
            for key in ORDERS[1:]
        ),
    ]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    command = " ".join(["python benchmarks/split_orders.py", *argv])
    per_rank, info = launch(command, lambda: all_ok(run_local(2, worker, args, deadline_s=900)))
    summary = per_rank[0]
    for stack, orders in summary.items():  # every rank's compute, rank 0's first
        for key, record in orders.items():
            record["busy_s"] = [ranks[stack][key]["busy_s"] for ranks in per_rank]
    md, _ = write_report(args, NAME, markdown(summary, info, args), {"stacks": summary}, info)
    print(f"wrote {md} ({info['wall_s']:.0f} s)")
    return 0
