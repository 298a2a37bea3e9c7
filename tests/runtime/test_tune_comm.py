"""Message costs measured, not assumed: a hop and the bi replica-gradient sum timed on two
local ranks over the runtime's transports land in the cost keys the simulator reads."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from megatron_prt.core.placement import Placement
from megatron_prt.core.schedules import build_plan
from megatron_prt.runtime.comm_timing import hop_seconds, measure_comm
from megatron_prt.runtime.local import all_ok, run_local
from megatron_prt.sim.cost import CostModel
from megatron_prt.sim.simulate import simulate

KEYS = ("p2p_latency", "p2p_bandwidth", "replica_latency", "replica_bandwidth")


@pytest.mark.parametrize("transport", ["shm", "torch"])
def test_measured_keys_load_and_cost_time(transport):
    measured = measure_comm(1 << 20, 4 << 20, transport, repeats=3)
    assert set(KEYS) <= set(measured)
    assert measured["p2p_latency"] > 0  # a step of a real pipeline is never free
    cost = CostModel.from_dict({"message_bytes": 1 << 20, "param_bytes": 1e7, **measured})
    assert cost.hop_time > 0
    assert cost.has_replica_cost
    plan = build_plan(Placement(2, 1, "loop", "bi"), 4)
    free = simulate(plan, CostModel(message_bytes=1 << 20, param_bytes=1e7))
    assert simulate(plan, cost).makespan > free.makespan


def test_message_cpu_fitted_in_place_only_when_asked():
    assert "p2p_cpu" not in measure_comm(1 << 16, 1 << 16, "shm", repeats=1)  # as before
    measured = measure_comm(1 << 16, 1 << 16, "shm", repeats=2, message_cpu=True)
    assert measured["p2p_cpu"] >= 0.0
    cost = CostModel.from_dict({"message_bytes": 1 << 16, **measured})
    assert cost.p2p_cpu == measured["p2p_cpu"]


def test_measure_comm_refuses_empty_sizes():
    with pytest.raises(ValueError, match="must be >= 1"):
        measure_comm(0, 1)


def test_profile_writes_measured_message_costs(tmp_path):
    pytest.importorskip("megatron.core")
    out = tmp_path / "costs.json"
    argv = ["profile", "--model", "bert", "--num-layers", "2", "--hidden-size", "16"]
    argv += ["--num-attention-heads", "4", "--seq-length", "8", "--micro-batch-size", "2"]
    argv += ["--vocab-size", "64", "--reps", "1", "--comm", "shm", "-o", str(out)]
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "megatron_prt", *argv], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert "hop: latency" in done.stdout and "message CPU while ranks compute" in done.stdout
    costs = CostModel.load(str(out))
    # the model's hop is never free unless the noise that made it so is said (--reps 1 on a
    # busy host timed the 15-hop chain no slower than the 1-hop one); with its CPU fitted,
    # what is left in flight may be nothing
    hop = hop_seconds(json.loads(out.read_text())) + 2 * costs.p2p_cpu
    said = "timed as free" in done.stderr or "timed faster than" in done.stderr
    assert costs.p2p_latency >= 0 and (hop > 0 or said)
    assert costs.has_replica_cost
    assert "p2p_cpu" in json.loads(out.read_text())  # fitted in place by default
    assert json.loads(out.read_text())["p2p_latency"] == costs.p2p_latency


def test_stand_in_falls_back_to_the_cpu_fit_when_no_scale_fits():
    # a model message of a few KiB leaves the stand-in's steps all overhead: the joint fit
    # finds no compute scale, and profile failed with it (before the fallback)
    from megatron_prt.core import Placement, build_plan
    from megatron_prt.runtime.comm_timing import _stand_in_cpu
    from megatron_prt.sim.cost import LayerCost
    from megatron_prt.sim.simulate import simulate
    from megatron_prt.tune.measured import message_cpu_in_place

    cost = CostModel(layers=(LayerCost(1.0, 2.0),) * 8, p2p_latency=0.5, p2p_cpu=0.5)
    few, many = build_plan(Placement(2, 1), 2, "1f1b"), build_plan(Placement(2, 4), 2, "prt")
    timed = [(few, 0.5 * simulate(few, cost.compute_scaled(0.0)).makespan)]
    timed.append((many, simulate(many, cost).makespan))
    assert _stand_in_cpu(cost, timed) == message_cpu_in_place(cost, timed) >= 0.5


def _rank_and_world(rank, world):
    return rank, world


def test_ranks_started_afresh_as_nccl_ranks_are():
    # NCCL ranks are spawned (a forked child cannot use CUDA once the parent has): the same
    # path over gloo, so the entry point and its arguments pickle
    assert all_ok(run_local(2, _rank_and_world, spawn=True, deadline_s=120)) == [(0, 2), (1, 2)]


def test_nccl_needs_two_gpus_and_no_host_cpu_fit():
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() >= 2:
        pytest.skip("this machine has two GPUs")
    with pytest.raises(ValueError, match="GPUs 0 and 1: this machine shows"):
        measure_comm(1 << 16, 1 << 16, "nccl")
    with pytest.raises(ValueError, match="--message-cpu none"):
        measure_comm(1 << 16, 1 << 16, "nccl", message_cpu=True)


def test_profile_refuses_nccl_without_gpus_before_profiling(tmp_path):
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() >= 2:
        pytest.skip("this machine has two GPUs")
    argv = ["profile", "--model", "bert", "--num-layers", "2", "--hidden-size", "16"]
    argv += ["--num-attention-heads", "4", "--seq-length", "8", "--micro-batch-size", "2"]
    argv += ["--vocab-size", "64", "--comm", "nccl"]
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "megatron_prt", *argv], env=env, capture_output=True, text=True
    )
    assert done.returncode == 2
    assert "--comm nccl times a hop between GPUs 0 and 1" in done.stderr
    assert "profiling" not in done.stderr.lower()  # refused before the model ran


def _hops_with_room_for_one_chain(rank, world):
    import warnings

    import megatron_prt.runtime.rings as rings
    from megatron_prt.runtime.comm_timing import _hops_seconds

    calls, free = iter(range(1 << 20)), rings.shm_free_bytes
    rings.shm_free_bytes = lambda: free() if next(calls) == 0 else 0  # room for one chain
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hop = _hops_seconds((4096,), "auto", 1)
    return hop, [str(w.message) for w in caught]


def test_hops_are_timed_on_one_transport():
    """Every timing chain is alive at once: where /dev/shm had room for some chains' rings
    only, the 1-hop chain ran on shared memory and the 15-hop one on gloo, and the hop was
    the slope across the two transports (5.56 ms against 1.78 ms for 8 MiB), without a word."""
    for hop, said in all_ok(run_local(2, _hops_with_room_for_one_chain, deadline_s=120)):
        assert len(hop) == 1
        assert any("every hop is timed over the torch transport" in text for text in said), said
