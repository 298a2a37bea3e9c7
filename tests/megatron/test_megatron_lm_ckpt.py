"""Megatron-LM's default checkpoint save (``torch_dist``, fully parallel over the data-parallel
ranks) of PRT chunks, with megatron-core alone.

Megatron-LM's ``save_checkpoint`` wraps megatron-core's ``torch_dist`` strategy in
``FullyParallelSaveStrategyWrapper`` over the data-parallel group; under ``wave`` the rank
holding the first stage (word embedding) also holds the last (tied output weight, the same
sharded key), and megatron's validation refused the save: both copies were made the one to
write (megatron_prt.megatron.checkpoint_lm). Here 4 CPU ranks, P=2 x DP=2, R=2, GPT with tied
embeddings: the chunks and their optimizer state are saved the way Megatron-LM saves them,
then loaded into chunks built from another seed, which must then hold the saved weights.
"""

from __future__ import annotations

import multiprocessing
import os

import pytest

pytest.importorskip("megatron.core")
pytest.importorskip("psutil")  # megatron's torch_dist writer logs memory through it

import torch
from megatron_models import model_chunks, setup_megatron, transformer_config

from megatron_prt.core import Placement
from megatron_prt.megatron.config import ReuseConfig
from megatron_prt.runtime.local import all_ok, run_local

LAYERS = 4


def _chunks(reuse: ReuseConfig, seed: int) -> list:
    from megatron_prt.megatron.model import prepare_model, transformer_config_kwargs

    torch.manual_seed(seed)
    config = transformer_config(**transformer_config_kwargs(reuse))
    chunks = model_chunks("gpt", config, reuse)
    prepare_model(chunks, reuse)  # tied output weights copy the word embedding, as in training
    return chunks


def _state(chunks: list, optimizer=None) -> dict:
    state = {f"model{c}": chunk.sharded_state_dict() for c, chunk in enumerate(chunks)}
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(dict(state))
    return state


def _save_like_megatron_lm(rank, world, placement, directory, fixed):
    """Save this rank's chunks and Adam state fully parallel; load them into chunks built from
    another seed. Returns ("refused", message) or ("loaded", names of parameters that differ
    from the saved ones)."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelSaveStrategyWrapper,
    )
    from megatron.core.optimizer import OptimizerConfig

    from megatron_prt.megatron import checkpoint_lm
    from megatron_prt.megatron.training import build_training

    if fixed:
        checkpoint_lm.install()
    reuse = ReuseConfig(placement, LAYERS)
    setup_megatron(placement.ranks, placement.chunks_per_rank)
    assert ps.get_data_parallel_world_size() == 2
    saved = _chunks(reuse, seed=7)
    training = build_training(
        saved, saved[0].config, optimizer_config=OptimizerConfig(optimizer="adam", lr=1e-3,
        params_dtype=torch.float64), reuse=reuse,
    )  # fmt: skip
    optimizer = training.optimizer
    strategy = FullyParallelSaveStrategyWrapper(
        get_default_save_sharded_strategy(), ps.get_data_parallel_group(with_context_parallel=True)
    )
    os.makedirs(directory, exist_ok=True)
    # torch_dist writes through writer processes; run_local's ranks are daemonic (torchrun's
    # are not), and a daemonic process may not start children
    multiprocessing.current_process()._config["daemon"] = False
    try:
        dist_checkpointing.save(_state(saved, optimizer), directory, strategy)
    except CheckpointingException as refused:
        return "refused", str(refused)[:300]
    finally:  # the writer's helper processes (a Manager): run_local's ranks end by os._exit
        for child in multiprocessing.active_children():
            child.terminate()
            child.join(10)
    fresh = _chunks(reuse, seed=8)
    loaded = dist_checkpointing.load(_state(fresh), directory)
    for c, chunk in enumerate(fresh):
        chunk.load_state_dict(loaded[f"model{c}"])
    differ = [
        f"chunk {c} {name}"
        for c, (old, new) in enumerate(zip(saved, fresh, strict=True))
        for (name, a), b in zip(old.named_parameters(), new.parameters(), strict=True)
        if not torch.equal(a, b)
    ]
    return "loaded", differ


@pytest.mark.parametrize("direction", ["uni", "bi"])
def test_fully_parallel_save_of_wave_chunks_with_tied_embeddings(tmp_path, direction):
    placement = Placement(2, 2, "wave", direction)
    assert placement.rank_stages[0][:2] == (0, 3)  # rank 0: the first and the last stage
    results = all_ok(run_local(4, _save_like_megatron_lm, placement, str(tmp_path / "ckpt"), True))
    assert results == [("loaded", [])] * 4, results


def test_without_the_fix_megatron_refuses_the_save(tmp_path):
    """What megatron-core does on its own (what the fix changes): the tied weight on rank 0
    would be written twice, and rank 0's check stops the save (the other ranks, left waiting
    in the save, are ended)."""
    placement = Placement(2, 2, "wave", "uni")
    results = run_local(
        4, _save_like_megatron_lm, placement, str(tmp_path / "ckpt"), False, wait_for=[0]
    )
    status, (outcome, message) = results[0]
    assert (status, outcome) == ("ok", "refused"), results[0]
    assert "Invalid access pattern" in message and "embedding.word_embeddings.weight" in message


def test_one_main_copy_per_rank_demotes_only_repeats_of_a_main_shard():
    from megatron.core.dist_checkpointing import ShardedTensor

    from megatron_prt.megatron.checkpoint_lm import one_main_copy_per_rank

    def shard(key, row, replica=0):
        data = torch.zeros(2, 3)
        return ShardedTensor.from_rank_offsets(key, data, (0, row, 2), replica_id=replica)

    state = {
        "model0": {"embedding": shard("emb", 0), "other_row": shard("emb", 1)},
        "model1": {"output": shard("emb", 0), "copy": shard("layer", 0, replica=1)},
        "optimizer": [shard("exp_avg.emb", 0), shard("exp_avg.emb", 0)],
    }
    assert one_main_copy_per_rank(state) == 2
    replicas = {
        path: tensor.replica_id
        for path, tensor in [
            ("embedding", state["model0"]["embedding"]),
            ("other_row", state["model0"]["other_row"]),
            ("output", state["model1"]["output"]),
            ("copy", state["model1"]["copy"]),
            ("exp_avg 0", state["optimizer"][0]),
            ("exp_avg 1", state["optimizer"][1]),
        ]
    }
    assert replicas == {
        "embedding": 0, "other_row": 0, "output": 1, "copy": 1, "exp_avg 0": 0, "exp_avg 1": 1
    }  # fmt: skip


def test_a_fully_parallel_load_gives_every_copy_its_own_tensor(monkeypatch):
    """megatron's fully parallel load fills every copy of a shard on a rank with one tensor
    (a PRT rank holds the word embedding and its tied output copy under wave): torch's Adam
    kept the two copies' moments as one tensor, updated twice a step."""
    from megatron.core.dist_checkpointing.strategies import fully_parallel

    from megatron_prt.megatron import checkpoint_lm

    shard = torch.arange(6.0)

    def load(self, sharded_state_dict, checkpoint_dir):  # one tensor for both copies
        state = {0: {"exp_avg": shard}, 1: {"exp_avg": shard}}
        return {"optimizer": {"state": state}, "model": [shard, torch.ones(2)]}

    monkeypatch.setattr(fully_parallel.FullyParallelLoadStrategyWrapper, "load", load)
    checkpoint_lm.install()
    loaded = fully_parallel.FullyParallelLoadStrategyWrapper.load(None, {}, "ckpt")
    state = loaded["optimizer"]["state"]
    copies = [state[0]["exp_avg"], state[1]["exp_avg"], loaded["model"][0]]
    assert len({t.data_ptr() for t in copies}) == 3
    assert all(torch.equal(t, shard) for t in copies)
