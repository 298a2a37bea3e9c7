"""Checkpoints of ``examples/pretrain_bert.py``: one file per rank with its model chunks,
optimizer (with its state), scheduler, iteration, data position and RNG states, in
``DIR/iter_XXXXXXX/rank_YY.pt``, and the iteration in ``DIR/latest``; a resumed run continues
with the numbers an uninterrupted run gives.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path
from typing import NoReturn

import numpy as np
import torch
import torch.distributed as dist

from .bert_args import PROG
from .bert_setup import log, params_dtype
from .bert_step import TrainState

CHECKPOINT_FORMAT = 2  # 2: numpy RNG state as a tensor (files load with weights_only=True)


def rng_state() -> dict:
    """Every RNG training reads (dropout draws from torch's and megatron's tracker)."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    state = {
        "python": random.getstate(),
        "numpy": _numpy_state(),
        "torch": torch.get_rng_state(),
        "tracker": {k: v.clone() for k, v in get_cuda_rng_tracker().get_states().items()},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _numpy_state() -> tuple:
    """numpy's global RNG state with its key array as a tensor: ``torch.load(...,
    weights_only=True)`` reads tensors, not numpy arrays."""
    name, keys, *rest = np.random.get_state()
    return (name, torch.from_numpy(keys.astype(np.int64)), *rest)


def set_rng_state(state: dict) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    random.setstate(state["python"])
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))
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
    behaviour, so ``--save D --load D`` restarts a preempted job). Every rank reads its own
    file first; then all ranks compare notes (collective), and if any rank cannot load (no
    file, an unreadable or truncated one, another launch layout or model) each such rank
    prints why and every rank exits with status 2."""
    iteration, payload, problem = _read_own_checkpoint(args)
    rank = dist.get_rank()
    notes: list = [None] * dist.get_world_size()
    dist.all_gather_object(notes, (iteration, problem))
    if problem is None and len({note[0] for note in notes}) > 1:
        iterations = ", ".join(f"rank {r}: {note[0]}" for r, note in enumerate(notes))
        problem = f"--load {args.load}: the ranks see different latest iterations ({iterations})"
    if any(note[1] for note in notes) or problem is not None:
        _stop_loading(args, rank, problem, [r for r, note in enumerate(notes) if note[1]])
    if payload is None:
        log(
            f"no checkpoint in {args.load} (no {Path(args.load) / 'latest'}): starting from scratch"
        )
        return
    for chunk, weights in zip(state.chunks, payload["model"], strict=True):
        chunk.load_state_dict(weights, strict=True)
    state.optimizer.load_state_dict(payload["optimizer"])
    state.scheduler.load_state_dict(payload["scheduler"])
    state.iteration = payload["iteration"]
    state.sampler.consumed = payload["consumed_samples"]
    set_rng_state(payload["rng"])
    folder = checkpoint_path(args.load, iteration, rank).parent
    log(f"resumed from {folder} at iteration {state.iteration}")


def _stop_loading(
    args: argparse.Namespace, rank: int, problem: str | None, failed: list
) -> NoReturn:
    """Exit status 2 on every rank: a rank with a problem prints it; rank 0 also names the
    ranks that could not load when it could."""
    if problem is not None:
        print(f"{PROG}: error: rank {rank}: {problem}", file=sys.stderr, flush=True)
    elif rank == 0:
        names = ", ".join(str(r) for r in failed)
        message = f"--load {args.load}: rank(s) {names} cannot load their checkpoint files"
        print(f"{PROG}: error: {message} (their messages say why)", file=sys.stderr, flush=True)
    sys.exit(2)


def _read_own_checkpoint(args: argparse.Namespace) -> tuple[int | None, dict | None, str | None]:
    """``(latest iteration, this rank's payload, problem)``, local to this rank: ``(None,
    None, None)`` without ``latest``; a problem names the file and the fix."""
    latest = Path(args.load) / "latest"
    if not latest.is_file():
        return None, None, None
    text = latest.read_text().strip()
    if not text.isdigit():
        return None, None, f"{latest} holds {text!r}, not an iteration; {_earlier(args, None)}"
    iteration = int(text)
    path = checkpoint_path(args.load, iteration, dist.get_rank())
    if not path.is_file():
        why = f"--load {args.load}: no {path} (was the checkpoint written by fewer ranks, or "
        return iteration, None, why + f"not copied to this node?); {_earlier(args, iteration)}"
    try:
        # On the CPU first: RNG states must stay CPU tensors; weights and optimizer state are
        # copied onto their parameters' device by load_state_dict.
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # truncated zip, foreign pickle, ...: name the file, not the trace
        reason = (str(exc).splitlines() or [""])[0].split(". ")[0]  # torch adds advice
        why = f"cannot read {path} ({type(exc).__name__}: {reason}): it is "
        why += "truncated, damaged or not written by this version of the script"
        return iteration, None, f"{why}; {_earlier(args, iteration)}"
    saved, current = payload.get("layout", {}), layout_signature(args)
    if saved != current:
        differences = [
            f"{k} {saved.get(k)} (now {v})" for k, v in current.items() if saved.get(k) != v
        ]
        return (
            iteration,
            None,
            f"checkpoint {path} does not fit this launch: {'; '.join(differences)}",
        )
    return iteration, payload, None


def _earlier(args: argparse.Namespace, iteration: int | None) -> str:
    """The fix: earlier checkpoints in ``--load`` with a file for every rank, or none."""
    complete = [
        found
        for found in checkpoint_iterations(args.load)
        if (iteration is None or found < iteration)
        and all(checkpoint_path(args.load, found, r).is_file() for r in range(args.world_size))
    ]
    if not complete:
        return f"no earlier complete checkpoint in {args.load}: start again without --load"
    last = complete[-1]
    listed = ", ".join(str(found) for found in complete)
    return (
        f"earlier complete checkpoints in {args.load}: iteration(s) {listed}; to resume from "
        f"{last}: echo {last} > {Path(args.load) / 'latest'}"
    )


def checkpoint_iterations(root: str) -> list[int]:
    """The iterations of ``root``'s ``iter_XXXXXXX`` directories, in order."""
    found = [p.name[len("iter_") :] for p in Path(root).glob("iter_*") if p.is_dir()]
    return sorted(int(name) for name in found if name.isdigit())
