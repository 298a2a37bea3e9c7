"""Checkpoints of PRT model chunks and their megatron-core optimizer through
``megatron.core.dist_checkpointing`` (``torch_dist`` format), resumable under another layout.

Each chunk's ``sharded_state_dict`` names its tensors by their place in the whole model: layer
keys carry global layer numbers (the PRT layer layout gives every chunk its layers' global
offsets), tensor-parallel shards carry their global offsets, and ``bi`` replica chunks and
tied output weights are non-main replicas (:func:`~megatron_prt.megatron.model.prepare_model`),
so every tensor is written once. A checkpoint is therefore one set of tensors of the
unpipelined model: any layout can load it (another R, placement, direction, pipeline size,
tensor-parallel size or data-parallel size), with the optimizer state alongside.

Both functions are collective over every rank of the job.
"""

from __future__ import annotations

import os
import warnings

from .model import unwrap

# The distributed optimizer's format that loads under any other TP / PP / DP layout.
_OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}
# What megatron-core 0.16's torch_dist load makes torch say (twice per rank per load).
TORCH_DEPRECATIONS = (
    "Please use DTensor instead and we are deprecating ShardedTensor",
    "`load_state_dict` is deprecated and will be removed",
)


def _sharded_state(chunks: list, optimizer, is_loading: bool) -> dict:
    state = {f"chunk{c}": unwrap(chunk).sharded_state_dict() for c, chunk in enumerate(chunks)}
    if optimizer is not None:  # maps its parameters to the model's sharded tensors
        state["optimizer"] = optimizer.sharded_state_dict(
            dict(state), is_loading=is_loading, metadata=_OPTIMIZER_METADATA
        )
    return state


def save_checkpoint(
    directory: str, chunks: list, optimizer=None, iteration: int = 0, extra: dict | None = None
) -> None:
    """Write ``chunks`` (this rank's model chunks, DDP-wrapped or not) and ``optimizer``
    (megatron-core's, or ``None``) to ``directory`` (created; must hold no checkpoint) with
    ``iteration``. ``extra``: more state under the key ``"extra"``: plain values (written
    once, by rank 0) and ``ShardedTensor`` s (each rank its shard). Collective."""
    from megatron.core import dist_checkpointing

    os.makedirs(directory, exist_ok=True)
    state = _sharded_state(chunks, optimizer, is_loading=False)
    state["iteration"] = iteration
    if extra is not None:
        state["extra"] = extra
    dist_checkpointing.save(state, directory, sharded_strategy=("torch_dist", 1))


def load_checkpoint(directory: str, chunks: list, optimizer=None) -> int:
    """Load a :func:`save_checkpoint` directory into ``chunks`` and ``optimizer`` built under
    any layout of the same model (see the module docstring); returns the saved iteration.
    Raises ``FileNotFoundError`` naming ``directory`` when it holds no checkpoint. Collective."""
    return int(load_checkpoint_state(directory, chunks, optimizer)["iteration"])


class CheckpointMismatchError(ValueError):
    """The checkpoint's tensors are not this model's: it holds tensors the model lacks, or
    lacks tensors the model has (another model, not another layout)."""


def load_checkpoint_state(
    directory: str,
    chunks: list,
    optimizer=None,
    extra: dict | None = None,
    optional: tuple[str, ...] = (),
    agree: bool = True,
) -> dict:
    """:func:`load_checkpoint`, returning the whole loaded state: ``"iteration"`` and, when
    ``extra`` (the ``ShardedTensor`` s of :func:`save_checkpoint`'s ``extra`` to read, as
    there) is given, ``"extra"`` with those tensors and the saved plain values. Raises
    :class:`CheckpointMismatchError` when the checkpoint's tensors and the model's differ, except
    for the optimizer's when ``optimizer`` is None and tensors whose keys start with one of
    ``optional`` (read only under some layouts), on every rank alike (``agree=False``: only
    on the ranks whose tensors differ, for a caller that agrees on failures itself).
    Collective."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    if not dist_checkpointing.check_is_distributed_checkpoint(directory):
        raise FileNotFoundError(
            f"{directory} holds no torch_dist checkpoint (written by save_checkpoint)"
        )
    request = _sharded_state(chunks, optimizer, True)
    if extra is not None:
        request["extra"] = extra
    _agree_or_raise(_other_shapes(directory, request))  # before the load: all ranks get here
    # megatron's default load skips tensors the checkpoint holds and the model does not ask
    # for: a checkpoint of another model (e.g. with a binary head) would load silently
    with warnings.catch_warnings():  # megatron-core's calls of APIs torch deprecates, per
        # rank: nothing a user of either can act on (their other warnings stay)
        for deprecated in TORCH_DEPRECATIONS:
            warnings.filterwarnings("ignore", deprecated, FutureWarning)
        state, missing, unexpected = dist_checkpointing.load(
            request, directory, strict=StrictHandling.RETURN_ALL
        )
    skipped = optional if optimizer is not None else (*optional, "optimizer.")
    problem = _other_model(directory, {k for k in missing if not k.startswith(skipped)}, unexpected)
    if agree:  # a rank that failed inside the load never gets here: its peers wait for it
        _agree_or_raise(problem)
    elif problem is not None:
        raise CheckpointMismatchError(problem)
    for c, chunk in enumerate(chunks):
        if f"chunk{c}" in state or _holds_tensors(request[f"chunk{c}"]):
            unwrap(chunk).load_state_dict(state[f"chunk{c}"])
        # else a stage of no layer, embedding or head: nothing asked, nothing returned
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
    return state


def _holds_tensors(sharded: dict) -> bool:
    """Whether a chunk's sharded state dict asks for any tensor (megatron's load returns
    only the keys it loaded)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedBase

    return any(isinstance(value, ShardedBase) for value in nested_values(sharded))


def _agree_or_raise(problem: str | None) -> None:
    """Collective: :class:`CheckpointMismatchError` on every rank when any rank found a
    ``problem`` (the lowest rank's, naming it), else return. megatron tells each rank only of
    the keys it asked for: a checkpoint of a tied model loaded untied differs on the last
    stage alone, whose peers went on into the next collective and waited there."""
    import torch.distributed as dist

    problems: list = [None] * dist.get_world_size()
    dist.all_gather_object(problems, problem)
    found = [(rank, text) for rank, text in enumerate(problems) if text is not None]
    if found:
        rank, text = found[0]
        raise CheckpointMismatchError(text if rank == dist.get_rank() else f"rank {rank}: {text}")


def _other_shapes(directory: str, request: dict) -> str | None:
    """Why the checkpoint's tensors that megatron loads with ``allow_shape_mismatch`` (the
    word embedding and output layer: rows cut or left as initialised, without a word) are
    not of the model's global shapes; None when they are."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    asked = [
        value
        for value in nested_values(request)
        if isinstance(value, ShardedTensor) and value.allow_shape_mismatch
    ]
    saved = dist_checkpointing.load_tensors_metadata(directory) if asked else {}
    for tensor in asked:
        theirs = saved.get(tensor.key)
        if theirs is not None and tuple(theirs.global_shape) != tuple(tensor.global_shape):
            return (
                f"{directory} holds {tensor.key} of shape {tuple(theirs.global_shape)}, this "
                f"model's is {tuple(tensor.global_shape)}: another vocabulary, or the same "
                "padded otherwise (megatron pads it to a multiple of "
                "--make-vocab-size-divisible-by x the tensor-parallel size); load it into a "
                "model of the vocabulary and padding it was saved with"
            )
    return None


def _holds_optimizer(directory: str) -> bool:
    """Whether the checkpoint in ``directory`` holds any optimizer tensor."""
    from megatron.core import dist_checkpointing

    return any(
        k.startswith("optimizer.") for k in dist_checkpointing.load_tensors_metadata(directory)
    )


def _other_model(directory: str, extra_keys: set, lacking_keys: set) -> str | None:
    """Why the checkpoint is not the model's, naming a few keys of either kind; None if
    none differ."""

    def some(keys: set) -> str:
        names = sorted(keys)
        return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")

    problems = []
    if extra_keys:
        problems.append(f"holds {len(extra_keys)} tensor(s) this model lacks ({some(extra_keys)})")
    if lacking_keys:
        problems.append(f"lacks {len(lacking_keys)} of this model's ({some(lacking_keys)})")
    optimizer_only = all(k.startswith("optimizer.") for k in extra_keys | lacking_keys)
    if problems and optimizer_only and not extra_keys and not _holds_optimizer(directory):
        return (
            f"{directory} holds no optimizer state (saved with optimizer=None): load it with "
            "optimizer=None (the weights alone), or from a checkpoint saved with the optimizer"
        )
    if problems and optimizer_only:
        return (
            f"{directory}'s optimizer state {' and '.join(problems)}: it was saved by another "
            "optimizer (with or without the distributed optimizer); resume with that one"
        )
    if problems:
        return (
            f"{directory} {' and '.join(problems)}: it was saved from another model; load it "
            "into the model it was saved from (the same layers, sizes and heads)"
        )
    return None
