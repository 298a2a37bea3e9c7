"""Measured timelines and the README's runnable example."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
from parity_models import batch, loss_fn, make_layer

from megatron_prt.core import Placement, build_plan
from megatron_prt.runtime import PipelineRuntime, build_stages
from megatron_prt.runtime.local import all_ok, run_local
from megatron_prt.runtime.trace import gather_spans, write_measured

ROOT = pathlib.Path(__file__).parents[2]


def _traced(rank, world, prefix):
    plan = build_plan(Placement(world, 2, "wave"), 3)
    stages = build_stages(plan.placement, rank, lambda i: make_layer("mlp", i), 8)
    runtime = PipelineRuntime(plan, stages, loss_fn, dtype=torch.float64, trace=True)
    xs, ys = batch("mlp", 3)
    runtime.step(xs, ys)
    spans = gather_spans(runtime)
    if rank == 0:
        write_measured(prefix, spans, runtime)
    return [str(a) for a, _, _ in runtime.trace()], [list(map(str, r)) for r in plan.ranks]


def test_trace_covers_every_compute_action_in_plan_order(tmp_path):
    prefix = str(tmp_path / "measured")
    results = all_ok(run_local(2, _traced, prefix))
    for rank, (traced, planned) in enumerate(results):
        assert traced == planned[rank]
    trace = json.loads(pathlib.Path(prefix + ".json").read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == 2 * 4 * 3 and all(e["dur"] >= 0 for e in spans)
    assert pathlib.Path(prefix + ".png").read_bytes()[:4] == b"\x89PNG"


def _span_clocks(rank, world, synchronized):
    """The clock a traced step's spans end on, untraced and traced, with the device taken
    for CUDA (CUDA's synchronize stubbed: this machine may have none)."""
    import functools

    import megatron_prt.runtime.messages as messages

    plan = build_plan(Placement(world, 1), 2)
    stages = build_stages(plan.placement, rank, lambda i: make_layer("mlp", i), 4)
    runtime = PipelineRuntime(plan, stages, loss_fn, dtype=torch.float64, trace=True)
    runtime.device = torch.device("cuda", 0)  # what _begin reads

    class Stream:  # the compute stream's wait, not torch.cuda.synchronize's (every stream)
        def __init__(self, device):
            self.device = device

        def synchronize(self):
            synchronized.append(self.device)

    torch.cuda.current_stream = Stream
    torch.cuda.synchronize = lambda device=None: synchronized.append("every stream")
    clocks = []
    for traced in (False, True):
        runtime.trace_enabled = traced
        runtime._begin(forward_only=False)
        clocks.append(runtime._clock)
    runtime.close()
    assert isinstance(clocks[1], functools.partial) and clocks[1].func is messages.synced_clock
    clocks[1]()
    return clocks[0] is time.perf_counter, synchronized


def test_traced_spans_on_cuda_wait_for_the_device():
    """A traced span ended at time.perf_counter() with CUDA kernels still queued: auto's
    stage times were launch times (a large GEMM priced at a launch or two). Traced steps on
    CUDA now wait for the compute stream at each span end (not for every stream: the
    communication streams' open receives could hold two ranks waiting for each other)."""
    for plain, synchronized in all_ok(run_local(2, _span_clocks, [])):
        assert plain and synchronized == [torch.device("cuda", 0)]


def _mlp_example_losses(*flags: str) -> list[float]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--standalone", str(ROOT / "examples" / "mlp_pipeline.py"), *flags]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [
        float(line.split()[-1]) for line in proc.stdout.splitlines() if line.startswith("step ")
    ]


def test_readme_example_runs_under_torchrun(tmp_path):
    flags = ["--reuse", "2", "--placement", "wave", "--direction", "bi", "--steps", "3"]
    losses = _mlp_example_losses(*flags, "--trace", str(tmp_path / "t"))
    assert len(losses) == 3 and losses[-1] < losses[0]
    assert (tmp_path / "t.json").exists()
    # README's split-backward example: gradients equal to rounding, so the printed losses
    assert _mlp_example_losses(*flags, "--split-backward") == losses


def _group_kept_alive(rank, world):
    """References to the default group the runtime's life left behind, and whether gloo's
    threads outlived destroy_process_group."""
    import gc

    group = dist.group.WORLD
    gc.collect()
    before = sys.getrefcount(group)
    plan = build_plan(Placement(world, 2, "wave", "bi"), 2)
    stages = build_stages(plan.placement, rank, lambda i: make_layer("mlp", i), 8)
    runtime = PipelineRuntime(plan, stages, loss_fn, dtype=torch.float64)
    xs, ys = batch("mlp", 2)
    runtime.step(xs, ys)
    runtime.reduce_replica_grads()
    torch.optim.SGD([p for m in stages.values() for p in m.parameters()], lr=0.1).step()
    runtime.close()
    del runtime, stages
    gc.collect()
    left = sys.getrefcount(group) - before
    threads = len(os.listdir("/proc/self/task"))
    dist.barrier()
    del group
    dist.destroy_process_group()
    gc.collect()
    return left, len(os.listdir("/proc/self/task")) < threads


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_runtime_leaves_the_process_group_free_to_end():
    # [Note: the default group must end with destroy_process_group]: torch.distributed.nn's
    # functions, imported after init_process_group, kept the gloo group alive past
    # destroy_process_group, which aborted the README example at exit now and then. In a
    # fresh interpreter (spawn), as a user's script; the optimizer imports torch._dynamo.
    for left, threads_ended in all_ok(run_local(2, _group_kept_alive, spawn=True)):
        assert left == 0 and threads_ended


def test_keep_freed_memory_takes_effect_on_glibc():
    import platform

    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        pytest.skip("mallopt is glibc's")
    code = "from megatron_prt.runtime.cpu import keep_freed_memory as k; assert k()"
    subprocess.run([sys.executable, "-c", code], check=True)  # process-wide: not in pytest
