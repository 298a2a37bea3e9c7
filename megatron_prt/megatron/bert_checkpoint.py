"""Checkpoints of ``examples/pretrain_bert.py``: one file per rank with its model chunks,
optimizer (with its state), scheduler, iteration, data position and RNG states, in
``DIR/iter_XXXXXXX/rank_YY.pt``, and the iteration in ``DIR/latest``; a resumed run continues
with the numbers an uninterrupted run gives.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from .bert_args import refuse
from .bert_setup import log, params_dtype
from .bert_step import TrainState

CHECKPOINT_FORMAT = 1


def rng_state() -> dict:
    """Every RNG training reads (dropout draws from torch's and megatron's tracker)."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": {k: v.clone() for k, v in get_cuda_rng_tracker().get_states().items()},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    get_cuda_rng_tracker().set_states({k: v.clone() for k, v in state["tracker"].items()})
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])


def layout_signature(args: argparse.Namespace) -> dict:
    """What must match for a rank's checkpoint file to fit this launch."""
    reuse = args.reuse
    return {
        "format": CHECKPOINT_FORMAT,
        "world_size": args.world_size,
        "pipeline_model_parallel_size": args.pipeline_model_parallel_size,
        "placement": None if reuse is None else str(reuse.placement),
        "stage_layers": None if reuse is None else list(reuse.layers_per_stage()),
        "num_layers": args.num_layers,
        "hidden_size": args.hidden_size,
        "binary_head": args.bert_binary_head,
        "dtype": str(params_dtype(args)),
    }


def checkpoint_path(root: str, iteration: int, rank: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}" / f"rank_{rank:02d}.pt"


def save_checkpoint(args: argparse.Namespace, state: TrainState) -> None:
    """Every rank writes its file (atomically); rank 0 then points ``latest`` at it.
    Collective (a barrier between the files and ``latest``)."""
    path = checkpoint_path(args.save, state.iteration, dist.get_rank())
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "layout": layout_signature(args),
        "iteration": state.iteration,
        "consumed_samples": state.sampler.consumed,
        "model": [chunk.state_dict() for chunk in state.chunks],
        "optimizer": state.optimizer.state_dict(),
        "scheduler": state.scheduler.state_dict(),
        "rng": rng_state(),
    }
    tmp = path.with_suffix(".tmp")
    torch.save(payload, tmp)
    tmp.replace(path)
    dist.barrier()
    if dist.get_rank() == 0:
        latest = Path(args.save) / "latest"
        latest.with_suffix(".tmp").write_text(f"{state.iteration}\n")
        latest.with_suffix(".tmp").replace(latest)
    dist.barrier()
    log(f"saved checkpoint of iteration {state.iteration} to {path.parent}")


def load_checkpoint(args: argparse.Namespace, state: TrainState) -> None:
    """Resume from ``--load DIR/latest``; without ``latest`` start fresh (Megatron-LM's
    behaviour, so ``--save D --load D`` restarts a preempted job). Refuses (exit 2) a
    checkpoint written by another launch layout or model."""
    latest = Path(args.load) / "latest"
    if not latest.is_file():
        log(f"no checkpoint in {args.load} (no {latest}): starting from scratch")
        return
    iteration = int(latest.read_text().strip())
    path = checkpoint_path(args.load, iteration, dist.get_rank())
    if not path.is_file():
        refuse(f"--load {args.load}: no {path} (was the checkpoint written by fewer ranks?)")
    # On the CPU first: RNG states must stay CPU tensors; weights and optimizer state are
    # copied onto their parameters' device by load_state_dict.
    payload = torch.load(path, map_location="cpu", weights_only=False)
    saved, current = payload["layout"], layout_signature(args)
    if saved != current:
        differences = [
            f"{k} {saved.get(k)} (now {v})" for k, v in current.items() if saved.get(k) != v
        ]
        refuse(f"checkpoint {path} does not fit this launch: {'; '.join(differences)}")
    for chunk, weights in zip(state.chunks, payload["model"], strict=True):
        chunk.load_state_dict(weights, strict=True)
    state.optimizer.load_state_dict(payload["optimizer"])
    state.scheduler.load_state_dict(payload["scheduler"])
    state.iteration = payload["iteration"]
    state.sampler.consumed = payload["consumed_samples"]
    set_rng_state(payload["rng"])
    log(f"resumed from {path.parent} at iteration {state.iteration}")
