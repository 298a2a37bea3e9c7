"""The executor's own cost per compute action, for comparing two versions of megatron_prt.

One rank, R = 8 stages of a 1x1 Linear + ReLU, m = 32: 512 compute actions a step and no
messages, so a step is the executor's bookkeeping around tiny forward/backward calls. Prints
the thread CPU time per action (median of ``--reps`` steps) of the runtime and of the same
calls made directly, and their difference. Which megatron_prt it measures is the one on
``PYTHONPATH``; under load, count instructions instead (repeatable): the difference of two
callgrind runs that differ only in ``--steps`` is the cost of those extra steps::

    git worktree add /tmp/old-exec 6669982
    for src in /tmp/old-exec $PWD; do for k in 1 9; do
      PYTHONPATH=$src PYTHONHASHSEED=0 OMP_NUM_THREADS=1 valgrind --tool=callgrind \\
        --callgrind-out-file=/tmp/cg.$(basename $src).$k python benchmarks/executor_overhead.py \\
        --steps $k --reps 0 2>&1 | grep Collected; done; done
    # instructions per action = (Collected(9) - Collected(1)) / 8 / 512
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

from megatron_prt.core import Placement, build_plan
from megatron_prt.runtime import PipelineRuntime, build_stages

MICROBATCHES, REUSE = 32, 8
ACTIONS = 2 * REUSE * MICROBATCHES  # an F and a B per stage and micro-batch


def _layer(index: int) -> torch.nn.Module:
    torch.manual_seed(index)
    return torch.nn.Sequential(torch.nn.Linear(1, 1), torch.nn.ReLU())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="steps after 3 warm-up steps")
    parser.add_argument("--reps", type=int, default=201, help="timed steps (0: none)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    store = tempfile.NamedTemporaryFile(delete=False).name
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    plan = build_plan(Placement(1, REUSE), MICROBATCHES)
    stages = build_stages(plan.placement, 0, _layer, REUSE)
    xs = [torch.randn(1, 1) for _ in range(MICROBATCHES)]
    runtime = PipelineRuntime(plan, stages, torch.nn.functional.mse_loss)
    direct = torch.nn.Sequential(*stages.values())

    def by_hand() -> None:
        for x in xs:
            (torch.nn.functional.mse_loss(direct(x), x) / MICROBATCHES).backward()

    for _ in range(3 + args.steps):
        runtime.step(xs, xs)
    spans: dict[str, list[float]] = {"runtime": [], "direct": []}
    for _ in range(args.reps):  # interleaved: load drifts hit both alike
        for name, run in (("runtime", lambda: runtime.step(xs, xs)), ("direct", by_hand)):
            start = time.thread_time()
            run()
            spans[name].append(time.thread_time() - start)
    if args.reps:
        per = {name: statistics.median(v) / ACTIONS * 1e6 for name, v in spans.items()}
        print(
            f"thread CPU per compute action (median of {args.reps}): runtime "
            f"{per['runtime']:.2f} us, direct calls {per['direct']:.2f} us, executor "
            f"{per['runtime'] - per['direct']:.2f} us"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
