"""Train an MLP with PRT on CPU ranks: the plain-PyTorch API of megatron-prt.

    torchrun --nproc-per-node 2 examples/mlp_pipeline.py --reuse 2 --placement wave
    torchrun --nproc-per-node 2 examples/mlp_pipeline.py --reuse 2 --split-backward

Every rank builds the same plan, builds only its own stages, and runs the plan; losses
come back on the ranks that hold last stages. Works the same on CUDA (pass --device cuda,
the backend becomes nccl).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from megatron_prt.core import ConfigError, Placement, Plan, build_plan
from megatron_prt.core.layers import check_layers_fill_stages
from megatron_prt.core.paths import check_trace_prefix
from megatron_prt.runtime import (
    PipelineRuntime,
    build_stages,
    sync_replicas,
)
from megatron_prt.runtime.cpu import keep_freed_memory
from megatron_prt.runtime.trace import gather_spans, write_measured


def parse_args() -> tuple[argparse.Namespace, Placement, Plan]:
    """The flags, and the placement and plan they give; a bad flag stops every rank with
    one line before any collective."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--reuse", type=int, default=2)
    parser.add_argument("--placement", choices=("loop", "wave"), default="loop")
    parser.add_argument("--direction", choices=("uni", "bi"), default="uni")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--trace", metavar="PREFIX", help="write PREFIX.json/.png of the last step")
    parser.add_argument(
        "--split-backward",
        action="store_true",
        help="zero-bubble plan: each backward split into I (input gradient) and W (weights)",
    )
    args = parser.parse_args()
    try:
        placement = Placement(
            int(os.environ.get("WORLD_SIZE", 1)), args.reuse, args.placement, args.direction
        )
        plan = build_plan(placement, args.microbatches, "zb" if args.split_backward else "prt")
        check_layers_fill_stages(args.layers, placement.depth, "--layers", "--reuse")
        if args.trace:
            check_trace_prefix(args.trace, "--trace")
    except ConfigError as exc:
        parser.error(str(exc))
    return args, placement, plan


def main() -> None:
    args, placement, plan = parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank = dist.get_rank()
    if device.type == "cpu":
        torch.set_num_threads(1)
        keep_freed_memory()  # no page-fault churn from re-allocating activations

    def make_layer(i: int) -> torch.nn.Module:
        torch.manual_seed(i)  # identical layer i on every rank
        return torch.nn.Sequential(torch.nn.Linear(args.hidden, args.hidden), torch.nn.Tanh())

    stages = build_stages(placement, rank, make_layer, args.layers)
    stages = {s: m.to(device) for s, m in stages.items()}
    sync_replicas(placement, stages)  # no-op for uni
    params = [p for m in stages.values() for p in m.parameters()]
    opt = torch.optim.SGD(params, lr=0.05)
    runtime = PipelineRuntime(
        plan, stages, torch.nn.functional.mse_loss, device=device, trace=bool(args.trace)
    )

    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(8, args.hidden, generator=g) for _ in range(args.microbatches)]
    ys = [torch.sin(x) for x in xs]
    for step in range(args.steps):
        opt.zero_grad()
        losses = runtime.step(xs, ys)
        runtime.reduce_replica_grads()  # bi: sum replica gradients
        opt.step()
        mine = [float(v) for v in losses if v is not None]
        total = torch.tensor([sum(mine), len(mine)], dtype=torch.float64)
        dist.all_reduce(total)  # losses live where the last stages are
        if rank == 0:
            print(f"step {step}: loss {float(total[0] / total[1]):.6f}", flush=True)
    if args.trace:
        spans = gather_spans(runtime)
        if rank == 0:
            print("wrote", *write_measured(args.trace, spans, runtime))
    runtime.close()
    dist.barrier()  # nobody tears the group down while a peer still writes its trace
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
