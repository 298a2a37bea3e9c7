"""Runtime parity on CUDA ranks: the tests' grid, one process per GPU over NCCL, or several
processes sharing GPUs over gloo.

    torchrun --standalone --nproc-per-node N scripts/gpu_parity.py [--full]
    torchrun --standalone --nproc-per-node 4 scripts/gpu_parity.py --backend gloo  # 1 GPU

Every rank runs each configuration of tests/runtime/test_runtime_parity.py's grid for P = N on its
GPU (rank i on GPU i mod the GPU count) and compares losses, gradients and parameters after
three SGD steps with the non-pipelined reference computed on the CPU (float64, 1e-10
relative). NCCL refuses two ranks on one GPU; with ``--backend gloo`` activations and
gradients cross through host shared memory (the runtime's ``auto`` transport). Exit status 1
on any mismatch; one line per configuration on rank 0.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "tests"))
sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "tests" / "runtime"))
from parity_models import reference
from test_runtime_parity import STEPS, TOL, _check_config, grid


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--full", action="store_true", help="the whole grid, not the CI subset")
    parser.add_argument(
        "--backend", choices=("nccl", "gloo"), default="nccl", help="gloo: ranks may share a GPU"
    )
    args = parser.parse_args()
    local = int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count()
    torch.cuda.set_device(local)
    dist.init_process_group(args.backend)
    transport = "torch" if args.backend == "nccl" else "auto"
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local)
    failures, refs = 0, {}
    for kind, p, r, placement, direction, m in grid(world, args.full):
        if (kind, m) not in refs:
            refs[(kind, m)] = reference(kind, m, STEPS)
        err, _ = _check_config(
            rank, kind, p, r, placement, direction, m, refs[(kind, m)], transport, device
        )
        wire = device if args.backend == "nccl" else "cpu"
        worst = torch.tensor([max(err.values())], dtype=torch.float64, device=wire)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        ok = float(worst) <= TOL
        failures += not ok
        if rank == 0:
            status = "ok  " if ok else "FAIL"
            print(f"{status} {kind} P={p} R={r} {placement}/{direction} m={m}: "
                  f"worst relative error {float(worst):.2e}", flush=True)  # fmt: skip
    dist.destroy_process_group()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
