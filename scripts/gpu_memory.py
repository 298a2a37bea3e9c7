"""Activation memory of megatron-core GPT under PRT on CUDA: predicted vs measured per rank.

    torchrun --standalone --nproc-per-node 2 scripts/gpu_memory.py [--backend gloo]

Each rank profiles the model on its GPU (:func:`megatron_prt.megatron.profile.profile_model`,
one rank), then the ranks run one PRT iteration (P=2, R=2, loop and wave, m=4) of megatron's
GPTModel through :class:`megatron_prt.megatron.schedule.MegatronPipeline` with
``measure_memory``, and rank 0 prints per rank: the simulator's peak activation bytes from
the profile, the saved-tensor meter's peak (what the CPU tests check exactly), and the CUDA
allocator's peak over the step (an upper bound: workspace, messages and gradients too).
Exit status 1 when a saved-tensor peak is off the prediction by more than 10%.
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

from megatron_prt.core import Placement, build_plan
from megatron_prt.megatron.config import ReuseConfig
from megatron_prt.sim.cost import CostModel
from megatron_prt.sim.simulate import simulate

LAYERS, MICROBATCHES, TOLERANCE = 8, 4, 0.10
SHAPE = dict(SEQ=256, HIDDEN=512, MBS=4, VOCAB=2048)  # tests' harness, scaled up
HEADS, DTYPE = 8, "float32"


def profile(device: torch.device) -> dict:
    from megatron_prt.megatron.profile import profile_model

    return profile_model(
        "gpt", LAYERS, SHAPE["HIDDEN"], HEADS, SHAPE["SEQ"], SHAPE["MBS"], SHAPE["VOCAB"],
        dtype=DTYPE, reps=1, device=device.type,
    )  # fmt: skip


def measure(reuse: ReuseConfig, device: torch.device) -> dict:
    """This rank's memory stats for one PRT iteration of megatron-core GPT."""
    from megatron_prt.megatron import prepare_model
    from megatron_prt.megatron.model import transformer_config_kwargs
    from megatron_prt.megatron.schedule import ChunkData, MegatronPipeline

    placement = reuse.placement
    mm.setup_megatron(placement.ranks, placement.chunks_per_rank)
    config = mm.transformer_config(
        dtype=torch.float32,
        num_attention_heads=HEADS,
        deallocate_pipeline_outputs=True,  # as Megatron-LM runs: sent outputs are freed
        **transformer_config_kwargs(reuse),
    )
    model = mm.model_chunks("gpt", config, reuse)
    prepare_model(model, reuse)
    plan = build_plan(placement, MICROBATCHES)
    pipeline = MegatronPipeline(plan, model, config, None, device, 120)
    pipeline.measure_memory = True
    data = [ChunkData(iter(mm.batches(MICROBATCHES)), c) for c in range(len(model))]
    pipeline.run(partial(mm.forward_step, "gpt", False), data, False, False, None)
    stats = pipeline.memory_stats()
    pipeline.close()
    return {k: v for k, v in stats.items() if k != "timeline"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=("nccl", "gloo"), default="gloo")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: dry run")
    args = parser.parse_args()
    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device(
            "cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count()
        )
        torch.cuda.set_device(device)
    for name, value in SHAPE.items():
        setattr(mm, name, value)
    mm.DTYPE, mm.DEVICE = torch.float32, device
    costs = profile(device)  # one rank each, before the pipeline's process group
    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    failures = 0
    for placement in ("loop", "wave"):
        reuse = ReuseConfig(Placement(world, 2, placement, "uni"), LAYERS)
        cost = CostModel.from_dict({**costs, "stage_layers": list(reuse.layers_per_stage())})
        predicted = simulate(build_plan(reuse.placement, MICROBATCHES), cost).per_rank
        stats = [None] * world
        dist.all_gather_object(stats, measure(reuse, device))
        for r, got in enumerate(stats):
            want = predicted[r].peak_activation_bytes
            off = got["peak_bytes"] / want - 1
            failures += abs(off) > TOLERANCE
            allocator = got.get("allocator_peak_bytes")
            if rank == 0:
                print(
                    f"{'ok  ' if abs(off) <= TOLERANCE else 'FAIL'} P={world} R=2 {placement} "
                    f"m={MICROBATCHES} rank {r}: predicted {want / 2**20:.1f} MiB, saved-tensor "
                    f"peak {got['peak_bytes'] / 2**20:.1f} MiB ({off:+.2%})"
                    + (f", allocator peak {allocator / 2**20:.1f} MiB" if allocator else ""),
                    flush=True,
                )
    dist.destroy_process_group()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
