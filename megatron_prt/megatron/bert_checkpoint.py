"""Checkpoints of ``examples/pretrain_bert.py`` through megatron-core's dist_checkpointing
(:mod:`megatron_prt.megatron.checkpoint`, ``torch_dist`` format) in ``DIR/iter_XXXXXXX/``,
with the iteration in ``DIR/latest``: a run saved under one layout (R, placement, direction,
pipeline, tensor- and data-parallel size) resumes under another.

Besides model and optimizer, a checkpoint holds the run's plain state once (iteration, data
position, the learning-rate scheduler's state, the saving layout) and each (pipeline rank,
tensor-parallel rank)'s RNG states as one shard of a byte tensor (JSON text): a run resumed
under the same pipeline and tensor-parallel sizes continues every RNG stream, so it gives the
numbers of an uninterrupted run; under other sizes the streams cannot map onto the new ranks
and start from ``--seed`` again (said in the log). Plain state is read by
``torch.load(weights_only=True)``; with the local layer spec the checkpoint holds no
``ShardedObject`` (whose reader would unpickle freely), but with ``--transformer-impl
transformer_engine`` megatron saves each TE layer's ``_extra_state`` as one, which its load
unpickles: load only checkpoints you trust there.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import sys
import threading
from importlib.metadata import version
from pathlib import Path
from typing import NoReturn

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from ..sim.model_shape import default_ffn
from .auto import pick_conditions, pick_record, resume_pick
from .bert_args import PROG, say_error
from .bert_setup import log, pad_vocab
from .bert_step import TrainState, microbatches_per_iteration
from .data_order import data_order, other_data_order
from .save_signals import Terminated, terminated_raises

RNG_KEY = "pretrain_bert.rng_state"  # the byte tensor's name in the checkpoint


def rng_state() -> dict:
    """Every RNG training reads (dropout draws from torch's and megatron's tracker), as plain
    JSON values."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    version, keys, gauss = random.getstate()
    name, np_keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": [version, list(keys), gauss],
        "numpy": [name, np_keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": torch.get_rng_state().tolist(),
        "tracker": {k: v.tolist() for k, v in get_cuda_rng_tracker().get_states().items()},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state().tolist()
    return state


def set_rng_state(state: dict) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    version, keys, gauss = state["python"]
    random.setstate((version, tuple(keys), gauss))
    name, np_keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(np_keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    tracker = {k: torch.tensor(v, dtype=torch.uint8) for k, v in state["tracker"].items()}
    get_cuda_rng_tracker().set_states(tracker)
    if "cuda" in state:
        torch.cuda.set_rng_state(torch.tensor(state["cuda"], dtype=torch.uint8))


def _grid() -> tuple[int, int, int, int, int]:
    """``(pipeline rank, pipeline size, tensor rank, tensor size, data rank)``."""
    from megatron.core import parallel_state as ps

    return (
        ps.get_pipeline_model_parallel_rank(),
        ps.get_pipeline_model_parallel_world_size(),
        ps.get_tensor_model_parallel_rank(),
        ps.get_tensor_model_parallel_world_size(),
        ps.get_data_parallel_rank(),
    )


def _rng_shard(data: torch.Tensor):
    """This rank's row of the ``(P, TP, bytes)`` RNG tensor; data-parallel replicas hold
    the same states (same seeds, same draws), so replica 0 writes it."""
    from megatron.core.dist_checkpointing import ShardedTensor

    pp, p, tp, t, dp = _grid()
    return ShardedTensor.from_rank_offsets(
        RNG_KEY, data.view(1, 1, -1), (0, pp, p), (1, tp, t), replica_id=dp
    )


def layout(args: argparse.Namespace) -> dict:
    """The launch layout a checkpoint records (for the log and the RNG decision)."""
    reuse = args.reuse
    return {
        "pipeline_model_parallel_size": args.pipeline_model_parallel_size,
        "tensor_model_parallel_size": args.tensor_model_parallel_size,
        "data_parallel_size": args.data_parallel_size,
        "placement": "megatron" if reuse is None else reuse.name,
        "device": args.device,  # see restores_rng
    }


def restores_rng(saved: dict, args: argparse.Namespace) -> bool:
    """Whether a checkpoint saved under the :func:`layout` ``saved`` restores its RNG states
    in this run: the same pipeline and tensor-parallel sizes (each rank's streams) and
    device (CPU and CUDA generator states differ in kind and size: a CUDA checkpoint's
    tracker states crashed a CPU run at its first dropout). A layout from before the device
    was recorded is taken for this run's device."""
    return (
        saved["pipeline_model_parallel_size"] == args.pipeline_model_parallel_size
        and saved["tensor_model_parallel_size"] == args.tensor_model_parallel_size
        and saved.get("device", args.device) == args.device
    )


def _layout_text(layout: dict) -> str:
    """A recorded :func:`layout` as the start line says it."""
    return (
        f"{layout['placement']}, tensor {layout['tensor_model_parallel_size']} x pipeline "
        f"{layout['pipeline_model_parallel_size']} x data {layout['data_parallel_size']}"
    )


# the flags that fix the model's tensors beyond their shapes (a model with more attention
# heads has the same weight shapes) or that decide which tensors exist
MODEL_FLAGS = {
    "num_layers": "--num-layers",
    "hidden_size": "--hidden-size",
    "ffn_hidden_size": "--ffn-hidden-size",
    "num_attention_heads": "--num-attention-heads",
    "max_position_embeddings": "--max-position-embeddings",
    "bert_binary_head": "--bert-no-binary-head",
}


def model_shape(args: argparse.Namespace) -> dict:
    """The model a checkpoint holds, as :data:`MODEL_FLAGS` name it (defaults resolved),
    and its vocabulary (:data:`VOCAB_KEYS`, once the run has set them)."""
    shape = {name: getattr(args, name) for name in MODEL_FLAGS}
    shape["ffn_hidden_size"] = default_ffn(shape["ffn_hidden_size"], args.hidden_size)
    shape["max_position_embeddings"] = shape["max_position_embeddings"] or args.seq_length
    shape.update({key: getattr(args, key, None) for key in VOCAB_KEYS})
    shape["make_vocab_size_divisible_by"] = args.make_vocab_size_divisible_by  # not compared
    shape["transformer_impl"] = getattr(args, "transformer_impl", "local")
    bf16, fp16 = getattr(args, "bf16", False), getattr(args, "fp16", False)
    shape["precision"] = "--bf16" if bf16 else "--fp16" if fp16 else "fp32"
    return shape


# recorded since 2026-12-04 (older checkpoints lack them: their tensors decide): another
# --transformer-impl names the layer norms' tensors otherwise, another precision keeps other
# optimizer state (fp32 main parameters): both were refused as "another model / optimizer"
RUN_FLAGS = {"transformer_impl": "--transformer-impl", "precision": "precision"}


# [Note: the vocabulary on resume] megatron pads the tokenizer's vocabulary to a multiple of
# --make-vocab-size-divisible-by x the tensor-parallel size, and megatron-core loads the
# word-embedding and output-layer tensors with allow_shape_mismatch: rows are cut or zero-
# filled without a word, and the padded rows' logits are part of every softmax. So another
# padding (another TP size, another divisor) or another tokenizer would resume another model,
# and so would a tokenizer of the same size whose ids stand for other pieces (the digest), or
# the same pieces split from the text otherwise (the tokenizer type: cased or not).
VOCAB_KEYS = ("vocab_size", "padded_vocab_size", "vocab_digest", "tokenizer_type")


def _divisor_for(tokens: int, padded: int, tp: int, saved_divisor, layout: dict) -> int | None:
    """A ``--make-vocab-size-divisible-by`` that pads ``tokens`` to ``padded`` at
    tensor-parallel size ``tp``: the saved run's multiple spread over ``tp`` ranks where it
    divides, else the largest power of two, else the largest; None when none does."""

    def pads(d: int) -> bool:
        return d > 0 and pad_vocab(tokens, d, tp) == padded

    saved_multiple = (saved_divisor or 0) * layout.get("tensor_model_parallel_size", 0)
    powers = [1 << k for k in range(padded.bit_length(), -1, -1)]
    for d in [saved_multiple // tp if saved_multiple % tp == 0 else 0, *powers]:
        if pads(d):
            return d
    return next((d for d in range(padded // tp, 0, -1) if pads(d)), None)


def _other_vocab(args: argparse.Namespace, theirs: dict, ours: dict, layout: dict) -> list[str]:
    """Why the checkpoint's vocabulary is not this run's (checkpoints that predate the
    record give none): another tokenizer, or another padding with the divisor that
    reproduces the saved one at this tensor-parallel size."""
    fix = "give the --vocab-file or --tokenizer-model it was saved with"
    if theirs.get("vocab_size") not in (None, ours["vocab_size"]):
        sizes = f"{theirs['vocab_size']} tokens there, {ours['vocab_size']} here"
        return [f"a tokenizer of {sizes} ({fix})"]
    if theirs.get("vocab_digest") not in (None, ours["vocab_digest"]):
        return [f"another vocabulary of the same {ours['vocab_size']} tokens there ({fix})"]
    if theirs.get("tokenizer_type") not in (None, ours["tokenizer_type"]):
        kind = theirs["tokenizer_type"]
        return [f"--tokenizer-type {kind} there, {ours['tokenizer_type']} here (give {kind})"]
    saved = theirs.get("padded_vocab_size")
    if saved in (None, ours["padded_vocab_size"]):
        return []
    tp, tokens = args.tensor_model_parallel_size, ours["vocab_size"]
    divisor = _divisor_for(tokens, saved, tp, theirs.get("make_vocab_size_divisible_by"), layout)
    fix = (
        f"give --make-vocab-size-divisible-by {divisor}"
        if divisor
        else f"no --make-vocab-size-divisible-by gives {saved} at --tensor-model-parallel-size "
        f"{tp}: resume at the tensor-parallel size it was saved with"
    )
    return [
        f"the vocabulary padded to {saved} rows there, {ours['padded_vocab_size']} here (a "
        f"multiple of --make-vocab-size-divisible-by x --tensor-model-parallel-size; {fix})"
    ]


def _other_model(args: argparse.Namespace, saved: dict, folder: Path) -> str | None:
    """Why the checkpoint's model is not this run's, naming the flags; None when it is (or
    the checkpoint predates the record: its tensors are still compared on load)."""
    if "model" not in saved:
        return None
    ours = model_shape(args)
    theirs = saved["model"]

    def differs(name: str) -> str:  # the values as the flag gives them
        if name != "bert_binary_head":
            return f"{MODEL_FLAGS[name]} {theirs.get(name)} there, {ours[name]} here"
        flag = MODEL_FLAGS[name]
        return f"the binary head there, {flag} here" if theirs.get(name) else f"{flag} there"

    differ = [differs(name) for name in MODEL_FLAGS if theirs.get(name) != ours[name]]
    differ += [
        f"{flag} {theirs[name]} there, {ours[name]} here"
        for name, flag in RUN_FLAGS.items()
        if name in theirs and theirs[name] != ours[name]
    ]
    differ += _other_vocab(args, theirs, ours, saved.get("layout", {}))
    if not differ:
        return None
    return (
        f"{folder} holds another model ({'; '.join(differ)}): give the flags it was saved "
        "with, or start without --load"
    )


def first_failure(exc: BaseException) -> BaseException:
    """The first failing rank's own exception of a ``CheckpointException`` (torch keeps
    ``{rank: (exception, stack summary)}``); any other exception as it is."""
    failures = getattr(exc, "failures", None)
    if not failures:
        return exc
    first = next(iter(failures.values()))
    return first[0] if isinstance(first, tuple) and first else exc


def checkpoint_dir(root: str, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}"


def save_checkpoint(args: argparse.Namespace, state: TrainState) -> None:
    """All ranks write ``DIR/iter_XXXXXXX``; rank 0 then points ``latest`` at it.
    Collective (``latest`` is written after every rank's part). A rank whose save fails
    (its own error, or a peer killed or failing mid-save) prints which folder, the root
    cause and the checkpoint ``latest`` still names, and exits with status 1; the partial
    folder lacks dist_checkpointing's metadata, so no load takes it for a checkpoint, and
    the next save of that iteration writes over it."""
    from torch.distributed.checkpoint import CheckpointException  # a BaseException

    folder = checkpoint_dir(args.save, state.iteration)
    try:
        with terminated_raises():
            _save(args, state, folder)
            if dist.get_rank() == 0:  # (a full disk here too stops with the message)
                latest = Path(args.save) / "latest"
                latest.with_suffix(".tmp").write_text(f"{state.iteration}\n")
                latest.with_suffix(".tmp").replace(latest)
            dist.barrier()
    except (Exception, CheckpointException, Terminated) as exc:
        _stop_saving(args, folder, exc)
    log(f"saved checkpoint of iteration {state.iteration} to {folder}")


def _save(args: argparse.Namespace, state: TrainState, folder: Path) -> None:
    """Every rank's part of ``folder``; returns once all ranks wrote theirs."""
    from .checkpoint import save_checkpoint as save_sharded  # megatron: not at flag parsing

    if dist.get_rank() == 0:  # written over, a folder is not complete until this save is
        for name in _METADATA:
            (folder / name).unlink(missing_ok=True)
    dist.barrier()
    text = json.dumps(rng_state()).encode()
    sizes: list = [None] * dist.get_world_size()
    dist.all_gather_object(sizes, len(text))
    rng = torch.frombuffer(bytearray(text.ljust(max(sizes))), dtype=torch.uint8)
    extra = {
        "iteration": state.iteration,
        "consumed_samples": state.sampler.consumed,
        "scheduler": state.scheduler.state_dict(),
        "layout": layout(args),
        "model": model_shape(args),
        "data_order": data_order(args, state),
        "rng_bytes": max(sizes),
        "rng": _rng_shard(rng),
    }
    schedule = state.auto_schedule
    pick = None if schedule is None else pick_record(schedule, args.reuse, pick_conditions(args))
    if pick is not None:  # [Note: auto's pick is resumed]
        extra["auto_pick"] = pick
    save_sharded(str(folder), state.chunks, state.optimizer, state.iteration, extra)
    dist.barrier()


def _stop_saving(args: argparse.Namespace, folder: Path, exc: BaseException) -> NoReturn:
    """Exit status 1 naming ``folder``, why its save failed (the failing rank's report when
    this rank's wait on it failed, or it was terminated) and what ``latest`` still names."""
    from ..runtime.errors import is_wait_failure, post_failure, root_cause

    if threading.current_thread() is threading.main_thread():
        # the launcher's SIGTERM to the survivors arrives while this waits for the root
        # cause; the rank exits below anyway, and the report must reach the log first
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    exc = first_failure(exc)
    rank = dist.get_rank()
    reason = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:200]}"
    waited = is_wait_failure(exc) or isinstance(exc, Terminated)
    post_failure(f"rank {rank}: saving {folder} failed: {reason}", root=not waited, final=True)
    cause = root_cause(None, wait_s=0.0 if isinstance(exc, Terminated) else 2.0) if waited else ""
    latest = Path(args.save) / "latest"
    kept = latest.read_text().strip() if latest.is_file() else None
    resume = (
        f"{latest} still names iteration {kept}, which loads (--load {args.save})"
        if kept
        else f"no earlier checkpoint was saved in {args.save}"
    )
    because = f"{cause}; this rank saw {reason}" if cause else reason
    message = f"rank {rank}: saving {folder} failed ({because}); {resume}"
    say_error(message)
    sys.exit(1)


def load_checkpoint(args: argparse.Namespace, state: TrainState) -> None:
    """Resume from ``--load DIR/latest``; without ``latest`` start fresh (Megatron-LM's
    behaviour, so ``--save D --load D`` restarts a preempted job). When any rank cannot
    load (``latest`` unreadable, the folder missing, incomplete or truncated; another model:
    flags of :data:`MODEL_FLAGS` that differ, or tensors that differ) each such rank prints
    why (and which earlier complete checkpoint loads instead, where that helps), and every
    rank exits with status 2. Collective."""
    iteration, common, problem = _read_common(args)
    _agree(args, problem, iteration)
    if iteration is None:
        log(f"no checkpoint in {args.load} (no {Path(args.load) / 'latest'}): starting fresh")
        return
    folder = checkpoint_dir(args.load, iteration)
    saved = common["extra"]
    same_rng_grid = restores_rng(saved["layout"], args)
    request = {}
    if same_rng_grid:
        request["rng"] = _rng_shard(torch.zeros(saved["rng_bytes"], dtype=torch.uint8))
    from torch.distributed.checkpoint import CheckpointException  # a BaseException

    from .checkpoint import CheckpointMismatchError, load_checkpoint_state

    loaded, problem = None, _other_model(args, saved, folder)
    try:
        if problem is None:
            loaded = load_checkpoint_state(
                str(folder), state.chunks, state.optimizer, request, optional=(RNG_KEY,),
                agree=False,  # _agree below, which also hears of ranks that failed the load
            )  # fmt: skip
    except CheckpointMismatchError as exc:  # a model the flags above do not tell apart
        problem = str(exc)
    except (Exception, CheckpointException) as exc:  # name the folder, not the trace
        exc = first_failure(exc)
        reason = (str(exc).strip().splitlines() or [""])[0][:200]
        problem = (
            f"cannot load {folder} ({type(exc).__name__}: {reason}): it is truncated, "
            f"damaged or of another model; {_earlier(args, iteration)}"
        )
        if "parameter group" in reason:  # megatron-core 0.19 keys groups by lr and decay
            problem = (
                f"{folder}: the optimizer's parameter groups are not the checkpoint's ({reason}); "
                "resume with the --lr, --min-lr and --weight-decay it was saved with"
            )
    problem = problem or other_data_order(args, saved, state, folder)  # after the model's
    if problem is None:
        try:  # megatron asserts that flags and checkpoint agree on the schedule
            state.scheduler.load_state_dict(saved["scheduler"])
        except AssertionError as exc:
            problem = (
                f"{folder}: {exc} (megatron counts the schedule in samples: iterations x "
                "--global-batch-size; --lr-decay-iters and --lr-warmup-iters default to "
                "--train-iters and 0); pass --use-checkpoint-opt_param-scheduler to take the "
                "checkpoint's schedule or --override-opt_param-scheduler to take the flags'"
            )
    _agree(args, problem)
    state.iteration = saved["iteration"]
    state.sampler.consumed = saved["consumed_samples"]
    if same_rng_grid:
        set_rng_state(json.loads(bytes(loaded["extra"]["rng"].flatten().tolist())))
    else:
        log(f"{folder} was saved under another pipeline / tensor-parallel size or device: "
            f"RNG states start from --seed {args.seed}")  # fmt: skip
    saved_under = _layout_text(saved["layout"])
    log(f"resumed from {folder} (saved under {saved_under}) at iteration {state.iteration}")
    if state.auto_schedule is not None:
        m, grid = microbatches_per_iteration(args), saved["layout"] == layout(args)
        record = saved.get("auto_pick")
        conditions = pick_conditions(args)
        log(resume_pick(state.auto_schedule, args.reuse, record, m, str(folder), grid, conditions))


def _agree(args: argparse.Namespace, problem: str | None, iteration: int | None = None) -> None:
    """Collective: return when no rank has a problem and all read the same ``iteration``;
    otherwise exit status 2 on every rank, a rank with a problem printing it and rank 0
    naming the ranks that could not load, or which ranks saw which checkpoint (a ``--load``
    on storage each node has its own of: the ranks went on to different collectives)."""
    notes: list = [None] * dist.get_world_size()
    dist.all_gather_object(notes, (problem, iteration))
    failed = [r for r, (note, _) in enumerate(notes) if note is not None]
    seen: dict = {}
    for r, (_, theirs) in enumerate(notes):
        seen.setdefault(theirs, []).append(r)
    if not failed and len(seen) > 1:
        what = "; ".join(
            f"{'no latest' if it is None else f'iteration {it}'}: rank(s) {_ranks(ranks)}"
            for it, ranks in seen.items()
        )
        failed = [0]
        problem = (
            f"--load {args.load}: the ranks read different checkpoints ({what}); give "
            "--load a folder every rank reads alike (storage all nodes share)"
        )
        problem = problem if dist.get_rank() == 0 else None
    if failed:
        _stop_loading(args, dist.get_rank(), problem, failed)


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks))


def _stop_loading(
    args: argparse.Namespace, rank: int, problem: str | None, failed: list
) -> NoReturn:
    if problem is not None:
        say_error(f"rank {rank}: {problem}")
    elif rank == 0:
        names = _ranks(failed)
        message = f"--load {args.load}: rank(s) {names} cannot load the checkpoint"
        print(f"{PROG}: error: {message} (their messages say why)", file=sys.stderr, flush=True)
    sys.exit(2)


def _read_common(args: argparse.Namespace) -> tuple[int | None, dict | None, str | None]:
    """``(latest iteration, the checkpoint's plain state, problem)``, local to this rank:
    ``(None, None, None)`` without ``latest``; a problem names the file and the fix."""
    from megatron.core import dist_checkpointing

    latest = Path(args.load) / "latest"
    if not latest.is_file():
        return None, None, None
    text = latest.read_text().strip()
    if not text.isdigit():
        return None, None, f"{latest} holds {text!r}, not an iteration; {_earlier(args, None)}"
    iteration = int(text)
    folder = checkpoint_dir(args.load, iteration)
    if not is_complete(folder):
        why = f"--load {args.load}: {folder} is missing or incomplete (was it copied whole?)"
        return iteration, None, f"{why}; {_earlier(args, iteration)}"
    try:
        common = dist_checkpointing.load_common_state_dict(str(folder))
        if "layout" not in common.get("extra", {}):
            raise KeyError("no 'extra.layout' entry")
    except (Exception, CheckpointException) as exc:  # truncated file, foreign pickle, another
        # script's checkpoint (torch's CheckpointException, 0.19's reader, is no Exception)
        if _newer_format(folder):
            return (
                iteration,
                None,
                (
                    f"--load {args.load}: {folder} was written by megatron-core 0.19 or newer "
                    "(its plain state is inside the tensors, no common.pt), which this "
                    "megatron-core cannot read; resume with megatron-core >= 0.19 "
                    "(requirements-next.txt)"
                ),
            )
        reason = (str(exc).strip().splitlines() or [""])[0].split(". ")[0][:300]
        why = f"cannot read {folder} ({type(exc).__name__}: {reason}): it is "
        why += "truncated, damaged or not written by this script"
        return iteration, None, f"{why}; {_earlier(args, iteration)}"
    return iteration, common, None


def _newer_format(folder: Path) -> bool:
    """A checkpoint of megatron-core 0.19 or newer (no ``common.pt``, and a
    ``metadata.json`` that names no ``common_backend``: older ones name it) under an older
    megatron-core, which cannot read it."""
    try:
        metadata = json.loads((folder / "metadata.json").read_text())
    except (OSError, ValueError):
        return False
    newer = not (folder / "common.pt").exists() and "common_backend" not in metadata
    return newer and not reads_newer_format()


def reads_newer_format() -> bool:
    """Whether the installed megatron-core reads checkpoints of 0.19's format."""
    major, minor = (int(part) for part in version("megatron-core").split(".")[:2])
    return (major, minor) >= (0, 19)


_METADATA = ("metadata.json", ".metadata")  # what a complete torch_dist folder holds


def is_complete(folder: Path) -> bool:
    """A whole torch_dist checkpoint folder: megatron's metadata and torch's tensor index
    (the plain state is ``common.pt`` up to megatron-core 0.18, inside the tensors from 0.19:
    a damaged one fails its read, naming the folder)."""
    return folder.is_dir() and all((folder / name).is_file() for name in _METADATA)


def _earlier(args: argparse.Namespace, iteration: int | None) -> str:
    """The fix: earlier complete checkpoints in ``--load``, or none."""
    complete = [
        found
        for found in checkpoint_iterations(args.load)
        if (iteration is None or found < iteration)
        and is_complete(checkpoint_dir(args.load, found))
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
