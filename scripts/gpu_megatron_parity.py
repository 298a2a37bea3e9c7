"""megatron-core models under PRT on CUDA ranks: the tests' parity grid on GPUs.

    torchrun --standalone --nproc-per-node N scripts/gpu_megatron_parity.py [--full]
    torchrun --standalone --nproc-per-node 2 scripts/gpu_megatron_parity.py --backend gloo

For every configuration of tests/megatron/test_megatron_parity.py with P = N (the CI subset, or with
``--full`` the whole grid), each rank builds megatron's GPTModel / BertModel chunks for its
stages on its GPU (rank i on GPU i mod the GPU count), runs one PRT iteration through
megatron_prt.megatron's forward-backward function and compares its losses (rank P-1) and
gradients with megatron's own no-pipelining schedule run on the same GPU with the same
weights (float64; losses 1e-12, gradients 1e-10 relative, as the tests). NCCL refuses two
ranks on one GPU; ``--backend gloo`` lets ranks share one (activations cross through host
shared memory). One line per configuration on rank 0; exit status 1 on any mismatch.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "tests"))
sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "tests" / "megatron"))
import megatron_models
from megatron_models import reference, run_prt
from test_megatron_parity import GRID, LAYERS, SUBSET, M, _reuse

LOSS_TOL, GRAD_TOL = 1e-12, 1e-10


def worst_errors(result: dict, ref: dict, last_rank: bool) -> tuple[float, float]:
    """(worst relative loss error, worst relative gradient error) on this rank."""
    loss_err = 0.0
    if last_rank:
        if len(result["losses"]) != len(ref["losses"]):
            return float("inf"), float("inf")
        for got, want in zip(result["losses"], ref["losses"], strict=True):
            loss_err = max(loss_err, float((got - want).abs() / want.abs()))
    grad_err = 0.0
    for name, grads in result["grads"].items():
        want = ref["grads"][name]
        for grad in grads:
            err = (grad - want).norm() / want.norm().clamp_min(1e-300)
            grad_err = max(grad_err, float(err))
    return loss_err, grad_err


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--full", action="store_true", help="the whole grid, not the CI subset")
    parser.add_argument(
        "--backend", choices=("nccl", "gloo"), default="nccl", help="gloo: ranks may share a GPU"
    )
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: dry run")
    args = parser.parse_args()
    device = torch.device("cpu")
    if args.device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count()
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    dist.init_process_group(args.backend)
    megatron_models.DEVICE = device
    rank, world = dist.get_rank(), dist.get_world_size()
    wire = device if args.backend == "nccl" else torch.device("cpu")
    configs = [c for c in (GRID if args.full else SUBSET) if c[1] == world]
    failures = 0
    for kind, p, r, placement, direction, uneven in configs:
        ref = reference(rank, world, kind, LAYERS, M)
        reuse = _reuse(p, r, placement, direction, uneven)
        result = run_prt(rank, world, kind, M, reuse, ref["state"])
        errors = torch.tensor(worst_errors(result, ref, rank == world - 1), device=wire)
        dist.all_reduce(errors, op=dist.ReduceOp.MAX)
        loss_err, grad_err = errors.tolist()
        ok = loss_err <= LOSS_TOL and grad_err <= GRAD_TOL
        failures += not ok
        if rank == 0:
            print(
                f"{'ok  ' if ok else 'FAIL'} {kind} P={p} R={r} {placement}/{direction}"
                f"{' uneven' if uneven else ''} m={M}: loss error {loss_err:.1e}, "
                f"gradient error {grad_err:.1e}",
                flush=True,
            )
    if rank == 0 and not configs:
        print(f"no configuration of the grid has P={world}", flush=True)
    dist.destroy_process_group()
    return 1 if failures or not configs else 0


if __name__ == "__main__":
    sys.exit(main())
