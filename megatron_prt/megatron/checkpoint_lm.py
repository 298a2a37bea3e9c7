"""Megatron-LM's ``torch_dist`` checkpoints of PRT chunks, saved fully parallel.

Megatron-LM writes ``torch_dist`` checkpoints through megatron-core's
``FullyParallelSaveStrategyWrapper`` (its default; ``--no-ckpt-fully-parallel-save`` turns it
off): each data-parallel group splits the writing of its shards among its ranks, and
``distribute_main_replicas_with_precomputed_distribution`` gives *every* local copy of a
shard on the rank chosen to write it replica id 0. Megatron's own models hold a shard at most
once per rank; a PRT rank can hold one twice. Under ``wave`` the rank holding the first stage
also holds the last, so its word embedding and the last stage's tied output weight (megatron
keys both ``embedding.word_embeddings.weight``, the output copy a non-main replica) and their
Adam moments both became main, and megatron's check stopped the save ("Invalid access
pattern for ShardedTensor(key='embedding.word_embeddings.weight' ...)": written twice).

:func:`install` keeps megatron's assignment and then, on each rank, leaves one copy of each
shard main (the first in the state dict: chunk 0 before chunk 1, so the word embedding) and
makes the others non-main replicas, as megatron marks the tied copy on its last pipeline
stage. Every copy still loads the one saved shard.

A fully parallel load (``--ckpt-fully-parallel-load``) loads a shard once per rank and
fills every copy with that one tensor; torch's optimizers keep it as it is, so the two
copies' Adam moments were one tensor, updated twice a step (a resumed run drifted from the
uninterrupted one without a word). :func:`install` gives every repeat its own copy.
"""

from __future__ import annotations

import contextvars
import functools

_SAVING: contextvars.ContextVar[bool] = contextvars.ContextVar("prt_parallel_save", default=False)


def one_main_copy_per_rank(sharded_state_dict) -> int:
    """Make every ``ShardedTensor`` in ``sharded_state_dict`` (nested) that repeats an earlier
    one's shard a non-main replica, a shard named as the save distribution names it (key,
    global offset, flattened range). Returns how many changed."""
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import is_main_replica
    from megatron.core.dist_checkpointing.utils import _sharded_tensor_shard_id

    seen, demoted = set(), 0
    for tensor in nested_values(sharded_state_dict):
        if not isinstance(tensor, ShardedTensor):
            continue
        shard = _sharded_tensor_shard_id(tensor)
        if shard in seen and is_main_replica(tensor.replica_id):
            tensor.replica_id = 1
            demoted += 1
        seen.add(shard)
    return demoted


def own_copies(loaded):
    """``loaded`` (a nested state dict, changed in place) with every repeat of a tensor
    object replaced by a copy of it."""
    import torch
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace

    seen: set[int] = set()

    def own(value):
        if isinstance(value, torch.Tensor):
            if id(value) in seen:
                return value.clone()
            seen.add(id(value))
        return value

    return dict_list_map_inplace(own, loaded)


def install() -> None:
    """Make megatron-core's fully parallel save leave one main copy per shard on each rank
    (:func:`one_main_copy_per_rank` after its own assignment) and its fully parallel load
    give every copy its own tensor (:func:`own_copies`), process-wide. Idempotent; nothing
    changes for a rank that holds every shard once."""
    from megatron.core.dist_checkpointing.strategies import fully_parallel

    loader = fully_parallel.FullyParallelLoadStrategyWrapper
    if not getattr(loader.load, "megatron_prt", False):
        load = loader.load

        @functools.wraps(load)
        def load_own_copies(self, sharded_state_dict, checkpoint_dir):
            return own_copies(load(self, sharded_state_dict, checkpoint_dir))

        load_own_copies.megatron_prt = True  # type: ignore[attr-defined]
        loader.load = load_own_copies
    distribute = fully_parallel.distribute_main_replicas_with_precomputed_distribution
    if getattr(distribute, "megatron_prt", False):
        return
    wrapper = fully_parallel.FullyParallelSaveStrategyWrapper
    apply_saving = wrapper.apply_saving_parallelization

    @functools.wraps(distribute)
    def distribute_main_replicas(sharded_state_dict, *args, **kwargs):
        distribute(sharded_state_dict, *args, **kwargs)
        if _SAVING.get():
            one_main_copy_per_rank(sharded_state_dict)

    @functools.wraps(apply_saving)
    def apply_saving_parallelization(self, sharded_state_dict):
        token = _SAVING.set(True)  # megatron validates right after distributing, inside
        try:
            return apply_saving(self, sharded_state_dict)
        finally:
            _SAVING.reset(token)

    distribute_main_replicas.megatron_prt = True  # type: ignore[attr-defined]
    fully_parallel.distribute_main_replicas_with_precomputed_distribution = distribute_main_replicas
    wrapper.apply_saving_parallelization = apply_saving_parallelization
