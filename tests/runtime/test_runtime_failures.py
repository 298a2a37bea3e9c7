"""Failure paths: a dying or silent peer and mismatched plans give clear errors, not hangs."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from parity_models import batch, loss_fn, make_layer

from megatron_prt.core import Placement, build_plan
from megatron_prt.runtime import PipelineError, PipelineRuntime, build_stages
from megatron_prt.runtime.local import run_local

TIMEOUT_S = 4.0


class _Boom(torch.nn.Module):
    """Raises (or stalls) on its ``at``-th call."""

    def __init__(self, inner, at, stall):
        super().__init__()
        self.inner, self.at, self.stall, self.calls = inner, at, stall, 0

    def forward(self, x):
        self.calls += 1
        if self.calls == self.at:
            if self.stall:
                time.sleep(600)  # the harness kills this rank
            raise RuntimeError("injected failure in stage forward")
        return self.inner(x)


def _failing_worker(rank, world, stall, transport):
    plan = build_plan(Placement(world, 2), 4)
    stages = build_stages(plan.placement, rank, lambda i: make_layer("mlp", i), 8)
    if rank == 1:
        stages[1] = _Boom(stages[1], at=2, stall=stall)
    runtime = PipelineRuntime(  # shm: rings from the start, so the failure hits them
        plan,
        stages,
        loss_fn,
        dtype=torch.float64,
        timeout_s=TIMEOUT_S,
        transport=transport,
        shm_capacity=1 << 20,
    )
    xs, ys = batch("mlp", 4)
    start = time.monotonic()
    try:
        runtime.step(xs, ys)
    except PipelineError as exc:
        return {"error": str(exc), "elapsed": time.monotonic() - start}
    return {"error": None}


def _check_failure(stall: bool, transport: str):
    results = run_local(
        3,
        _failing_worker,
        stall,
        transport,
        deadline_s=8 * TIMEOUT_S,
        wait_for={0, 2} if stall else None,
    )
    statuses = [s for s, _ in results]
    if stall:
        assert statuses[1] == "killed"  # the stuck rank never answers
    else:
        text = results[1][1]["error"]
        assert "rank 1, step" in text and "1F1" in text and "injected failure" in text
    for rank in (0, 2):
        status, payload = results[rank]
        assert status == "ok", payload
        text = payload["error"]
        assert text is not None, f"rank {rank} finished although rank 1 failed"
        assert text.startswith(f"rank {rank}, step ")
        assert "rank |" in text  # the plan grid around the failure
        if stall:
            # its own wait times out, or (first) a peer that timed out and exited closes the
            # connection: either way the error says whom it was waiting on or that it waited
            lowered = text.lower()
            assert "timed out" in lowered or "timeout" in lowered or "waiting on rank" in text, text


@pytest.mark.parametrize("transport", ["shm", "torch"])
def test_peer_that_raises_fails_every_rank(transport):
    _check_failure(stall=False, transport=transport)


@pytest.mark.parametrize("transport", ["shm", "torch"])
def test_peer_that_never_answers_times_out(transport):
    _check_failure(stall=True, transport=transport)


def _late_failure_worker(rank, world, earlier_runtime):
    """Rank 1 raises before its plan check (building its model); rank 0 waits in its own.
    ``earlier_runtime``: both ran a runtime first, so rank 0 is a generation ahead."""
    plan = build_plan(Placement(world, 2), 4)
    stages = build_stages(plan.placement, rank, lambda i: make_layer("mlp", i), 8)
    make = lambda: PipelineRuntime(plan, stages, loss_fn, dtype=torch.float64, timeout_s=20)  # noqa: E731
    if earlier_runtime:
        make().close()
    if rank == 1:
        time.sleep(2.0)
        raise ValueError("rank 1 could not build its model")
    start = time.monotonic()
    try:
        make()
    except PipelineError as exc:
        return str(exc), time.monotonic() - start
    return None, time.monotonic() - start


@pytest.mark.parametrize("earlier_runtime", [False, True], ids=["first", "second"])
def test_a_peer_failing_before_its_plan_check_is_named_at_once(earlier_runtime):
    """Rank 1's report was of the generation before rank 0's: rank 0 ignored it, waited its
    whole timeout_s (20 s) and said rank 1 stopped without reporting an error."""
    results = run_local(2, _late_failure_worker, earlier_runtime, deadline_s=60)
    assert results[1][0] == "error" and "could not build its model" in results[1][1]
    status, (text, _) = results[0]
    assert status == "ok" and text is not None
    assert "rank 1 could not build its model" in text, text


def _mismatch_worker(rank, world):
    reuse = 2 if rank == 1 else 1
    plan = build_plan(Placement(world, reuse), 4)
    stages = build_stages(plan.placement, rank, lambda i: make_layer("mlp", i), 8)
    try:
        PipelineRuntime(plan, stages, loss_fn, dtype=torch.float64, timeout_s=TIMEOUT_S)
    except PipelineError as exc:
        return str(exc)
    return None


def test_mismatched_plans_are_refused_at_setup():
    results = run_local(2, _mismatch_worker, deadline_s=60)
    for rank, (status, text) in enumerate(results):
        assert status == "ok" and text is not None
        assert f"rank {rank}: ranks disagree on the plan" in text
        assert "ranks [0]" in text and "ranks [1]" in text


def test_wrong_stages_for_rank_is_refused():
    plan = build_plan(Placement(1, 2), 2)
    stages = {0: torch.nn.Identity()}
    try:
        if not dist.is_initialized():
            store = dist.HashStore()
            dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        PipelineRuntime(plan, stages, loss_fn)
    except ValueError as exc:
        assert "stages [0] given, the plan places [0, 1] here" in str(exc)
    else:
        raise AssertionError("expected a ValueError")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
