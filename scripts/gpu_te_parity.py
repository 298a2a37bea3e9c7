"""megatron-core GPT / BERT with the Transformer Engine layer spec under PRT, against megatron's
own no-pipelining schedule on the same GPU with the same weights and micro-batches.

    torchrun --standalone --nproc-per-node N scripts/gpu_te_parity.py [--dtype bf16|fp32]
    torchrun --standalone --nproc-per-node 2 scripts/gpu_te_parity.py --backend gloo
    torchrun --standalone --nproc-per-node 2 scripts/gpu_te_parity.py --device cpu \
        --transformer-impl local --dtype fp32 --backend gloo      # dry run of this script

P = N pipeline ranks (rank i on GPU i mod the GPU count; NCCL needs one GPU per rank,
``--backend gloo`` lets ranks share one). For each of GPT (tied) and BERT under R = 2
loop/uni, wave/uni and loop/bi (m = 4), one iteration; rank 0 prints one line per case with
the worst relative loss error (last stage) and gradient error (norm of the difference over
the norm, per parameter, worst over parameters and ranks). Exit status 1 on any mismatch.

Tolerances. The forward of a micro-batch runs the same kernels on the same inputs in both
runs, so the losses should agree to the dtype's rounding; gradients are sums over
micro-batches (and, for ``bi``, over two replicas) whose order differs, accumulated in the
parameters' dtype without megatron's DDP:

* bf16 (unit roundoff 2**-8 = 3.9e-3): losses 1e-2 relative, gradients 3e-2;
* fp32 (TE's GEMMs may use TF32 unless NVTE / torch settings forbid it): losses 1e-4,
  gradients 1e-3.

A lost or doubled micro-batch moves the gradients by about 1/m = 25%, a missing replica sum
by 50% or more, so both tolerances still catch a wrong schedule.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
from functools import partial

import torch
import torch.distributed as dist

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "tests"))
import megatron_models as mm

from megatron_prt.core import Placement
from megatron_prt.megatron import (
    build_chunks,
    make_forward_backward_func,
    prepare_model,
)
from megatron_prt.megatron.config import ReuseConfig
from megatron_prt.megatron.model import transformer_config_kwargs
from megatron_prt.megatron.pretrain import build_model, transformer_config
from megatron_prt.megatron.weights import load_global

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
TOLERANCES = {"bf16": (1e-2, 3e-2), "fp32": (1e-4, 1e-3)}  # (losses, gradients), relative
KINDS = ("gpt", "bert")
CASES = (("loop", "uni"), ("wave", "uni"), ("loop", "bi"))
REUSE, M, LAYERS_PER_STAGE = 2, 4, 1
SIZES = dict(hidden_size=64, num_attention_heads=4)  # head dim 16: TE's fused attention
mm.VOCAB, mm.SEQ, mm.MBS = 128, 32, 2


def _config(dtype: str, **fields):
    """megatron's config without dropout or fused kernels outside TE; parameters made on
    the GPU (TE modules initialise there)."""
    on_cpu = mm.DEVICE.type == "cpu"
    return transformer_config(DTYPES[dtype], use_cpu_initialization=on_cpu, **SIZES, **fields)


def _model(kind, impl, config, pre_process=True, post_process=True, vp_stage=None):
    model = build_model(
        kind, config, mm.VOCAB, mm.SEQ, pre_process, post_process, vp_stage, transformer_impl=impl
    )
    return model.to(mm.DEVICE)


def reference(kind: str, layers: int, dtype: str, impl: str) -> dict:
    """megatron's no-pipelining schedule on this rank's GPU (tests/megatron_models.py)."""
    config = _config(dtype, num_layers=layers)
    build = lambda kind, config: _model(kind, impl, config)  # noqa: E731
    return mm.reference(0, 1, kind, layers, M, config=config, build=build)


def run_prt(kind: str, reuse: ReuseConfig, ref_state: dict, dtype: str, impl: str) -> dict:
    placement = reuse.placement
    mm.setup_megatron(placement.ranks, placement.chunks_per_rank)
    config = _config(dtype, **transformer_config_kwargs(reuse))
    model = build_chunks(partial(_model, kind, impl), reuse, config=config)
    load_global(model, ref_state, mm.is_tied(kind))
    prepare_model(model, reuse)
    store = make_forward_backward_func(reuse, timeout_s=120)(
        forward_step_func=partial(mm.forward_step, kind, False),
        data_iterator=[iter(mm.batches(M)) for _ in model],
        model=model,
        num_microbatches=M,
        seq_length=mm.SEQ,
        micro_batch_size=mm.MBS,
    )
    grads = mm.grads_by_name(model, mm.is_tied(kind))
    return {"losses": [s["lm loss"] for s in store], "grads": grads}


def worst_errors(result: dict, ref: dict) -> tuple[float, float]:
    """(worst relative loss error, worst relative gradient error) on this rank."""
    loss_err = 0.0
    for got, want in zip(result["losses"], ref["losses"], strict=False):
        loss_err = max(loss_err, float((got.float() - want.float()).abs() / want.float().abs()))
    if result["losses"] and len(result["losses"]) != len(ref["losses"]):
        loss_err = float("inf")
    grad_err = 0.0
    for name, grads in result["grads"].items():
        want = ref["grads"][name].float()
        for grad in grads:
            err = (grad.float() - want).norm() / want.norm().clamp_min(1e-30)
            grad_err = max(grad_err, float(err))
    return loss_err, grad_err


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="bf16")
    parser.add_argument("--backend", choices=("nccl", "gloo"), default="nccl")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: dry run")
    parser.add_argument(
        "--transformer-impl", choices=("transformer_engine", "local"), default="transformer_engine"
    )
    args = parser.parse_args()
    if args.device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count()
        mm.DEVICE = torch.device("cuda", local)
        torch.cuda.set_device(mm.DEVICE)
    else:
        torch.set_num_threads(1)
    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    wire = mm.DEVICE if args.backend == "nccl" else torch.device("cpu")
    loss_tol, grad_tol = TOLERANCES[args.dtype]
    layers = LAYERS_PER_STAGE * REUSE * world
    failures = 0
    for kind in KINDS:
        ref = reference(kind, layers, args.dtype, args.transformer_impl)
        for placement, direction in CASES:
            reuse = ReuseConfig(Placement(world, REUSE, placement, direction), layers)
            result = run_prt(kind, reuse, ref["state"], args.dtype, args.transformer_impl)
            errors = torch.tensor(worst_errors(result, ref), device=wire)
            dist.all_reduce(errors, op=dist.ReduceOp.MAX)
            loss_err, grad_err = errors.tolist()
            ok = loss_err <= loss_tol and grad_err <= grad_tol
            failures += not ok
            if rank == 0:
                print(
                    f"{'ok  ' if ok else 'FAIL'} {args.transformer_impl} {args.dtype} {kind} "
                    f"P={world} R={REUSE} {placement}/{direction} m={M}: loss error "
                    f"{loss_err:.1e} (tol {loss_tol:g}), gradient error {grad_err:.1e} "
                    f"(tol {grad_tol:g})",
                    flush=True,
                )
    dist.destroy_process_group()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
