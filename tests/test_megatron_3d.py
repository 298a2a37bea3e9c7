"""Tensor x pipeline x data parallelism: PRT under megatron-core equals megatron's own
no-pipelining schedule with the same tensor- and data-parallel sizes.

Each case trains three steps of megatron's DDP + Adam in float64 on TP x PP x DP forked gloo
ranks (megatron_prt.megatron.cpu runs the tensor-parallel layers on CPU) and compares, per
(TP rank, DP rank), with the reference on TP x DP ranks: same weights (the reference's
initial shards), same micro-batches per DP rank. Only the order of micro-batch gradient sums
differs, so losses must match to 1e-12 and reduced gradients and updated parameters to
1e-10 relative at every step (a dropped or doubled micro-batch, DP average or TP shard is off
by order 1). The same runs count the collectives on every DDP gradient bucket: exactly one
reduction per bucket and iteration.
"""

from __future__ import annotations

import functools
import os
import pathlib
import re
import subprocess
import sys

import pytest

pytest.importorskip("megatron.core")

import torch
from megatron_models import LAYERS_3D, STEPS, parallel_train

from megatron_prt.core import Placement
from megatron_prt.megatron.config import ReuseConfig
from megatron_prt.runtime.local import all_ok, run_local

M = 4


@functools.cache
def _reference(kind: str, tp: int, dp: int, m: int = M) -> dict:
    """(TP rank, DP rank) -> the reference run's result on that rank."""
    results = all_ok(run_local(tp * dp, parallel_train, kind, tp, m, deadline_s=300))
    return {(r["tp"], r["dp"]): r for r in results}


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm().clamp_min(1e-300)).item()


def _check(kind, tp, dp, p, r, placement, direction, ddp=None, m=M):
    refs = _reference(kind, tp, dp, m)
    states = {t: refs[(t, 0)]["state"] for t in range(tp)}
    reuse = ReuseConfig(Placement(p, r, placement, direction), LAYERS_3D)
    world = tp * p * dp
    results = all_ok(
        run_local(world, parallel_train, kind, tp, m, reuse, states, ddp, deadline_s=600)
    )
    with_losses = set()
    for rank, result in enumerate(results):
        ref = refs[(result["tp"], result["dp"])]
        if result["losses"][0]:
            with_losses.add((result["tp"], result["dp"]))
            torch.testing.assert_close(
                torch.tensor(result["losses"]), torch.tensor(ref["losses"]), rtol=1e-12, atol=0
            )
        for step in range(STEPS):
            assert result["counts"][step] and all(c == 1 for c in result["counts"][step]), (
                f"rank {rank} step {step}: reductions per gradient bucket "
                f"{result['counts'][step]}, want one each"
            )
            if ddp and ddp.get("use_distributed_optimizer"):
                continue  # main_grad holds only this rank's reduced shard: parameters decide
            for name, grads in result["grads"][step].items():
                for grad in grads:
                    err = _relative(grad, ref["grads"][step][name][0])
                    assert err < 1e-10, f"rank {rank} step {step}: grad of {name} off by {err:.3g}"
        for name, values in result["params"].items():
            for value in values:
                start = ref["state"][name]
                err = _relative(value - start, ref["params"][name][0] - start)
                assert err < 1e-10, f"rank {rank}: update of {name} off by {err:.3g} relative"
    assert with_losses == set(refs), f"losses on {sorted(with_losses)}, want every (TP, DP)"


# `make test`: 4-rank cases crossing TP and DP with both directions and placements.
FAST = [
    ("gpt", 2, 1, 2, 2, "wave", "uni"),
    ("gpt-untied", 1, 2, 2, 3, "loop", "uni"),
    ("bert", 1, 2, 2, 2, "wave", "bi"),
    ("bert", 2, 1, 2, 3, "loop", "bi"),
]


@pytest.mark.parametrize("kind,tp,dp,p,r,placement,direction", FAST)
def test_tp_pp_dp_training_matches_megatron(kind, tp, dp, p, r, placement, direction):
    _check(kind, tp, dp, p, r, placement, direction)


# Every model with every TP x DP size, each under two layouts that together cross R 2 / 3,
# loop / wave and uni / bi (the other pairing for alternate sizes): 24 runs on 4 or 8 ranks.
LAYOUTS = (((2, "wave", "uni"), (3, "loop", "bi")), ((2, "loop", "bi"), (3, "wave", "uni")))
GRID = [
    (kind, tp, dp, 2, r, placement, direction)
    for i, (kind, tp, dp) in enumerate(
        (kind, tp, dp) for kind in ("gpt", "gpt-untied", "bert") for tp in (1, 2) for dp in (1, 2)
    )
    for r, placement, direction in LAYOUTS[(i + i // 4) % 2]
]


@pytest.mark.slow
@pytest.mark.parametrize("kind,tp,dp,p,r,placement,direction", GRID)
def test_tp_pp_dp_grid_matches_megatron(kind, tp, dp, p, r, placement, direction):
    _check(kind, tp, dp, p, r, placement, direction)


def _torchrun(ranks: int, example: str, *flags: str) -> str:
    """stdout and stderr of ``examples/<example>`` under torchrun on ``ranks`` CPU ranks."""
    path = pathlib.Path(__file__).parents[1] / "examples" / example
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", str(ranks), str(path), *flags]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    return output


@pytest.mark.slow
def test_gpt_example_trains_with_tensor_pipeline_and_data_parallelism():
    output = _torchrun(
        8, "megatron_gpt.py", "--tensor-model-parallel-size", "2",
        "--pipeline-model-parallel-size", "2", "--pipeline-reuse", "2",
        "--pipeline-reuse-direction", "bi", "--train-iters", "4",
    )  # fmt: skip
    losses = [float(line.split()[4]) for line in output.splitlines() if "lm loss" in line]
    assert len(losses) == 4 and losses[-1] < losses[0], output[-2000:]


@pytest.mark.slow
def test_bert_example_trains_with_tensor_parallelism(tmp_path):
    output = _torchrun(
        4, "pretrain_bert.py", "--tensor-model-parallel-size", "2",
        "--pipeline-model-parallel-size", "2", "--pipeline-reuse", "2",
        "--pipeline-reuse-placement", "wave", "--num-layers", "4", "--hidden-size", "32",
        "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "2",
        "--global-batch-size", "8", "--lr", "3e-3", "--log-interval", "1", "--eval-iters", "1",
        "--train-iters", "6", "--eval-interval", "3", "--data-cache-path", str(tmp_path),
    )  # fmt: skip
    losses = [float(m) for m in re.findall(r"iteration +\d+/\d+ \| lm loss (\S+) \|", output)]
    assert len(losses) == 6 and losses[-1] < losses[0], output[-2000:]
