"""A checkpoint saved under one PRT layout resumes under another.

Two steps of megatron's DDP + Adam (float64) under TP 1 x P 2 (R 2, wave, uni) x DP 2 are
saved with megatron_prt.megatron.checkpoint (megatron-core's dist_checkpointing, torch_dist);
each other layout loads model and optimizer state and trains steps 2 and 3. Its losses must
equal, micro-batch by micro-batch, those of one uninterrupted run on one rank (megatron's
no-pipelining schedule, the same four micro-batches per step): a misplaced layer, a lost
tensor-parallel shard or a missing Adam moment is off by far more than the tolerance.
"""

from __future__ import annotations

import functools

import pytest

pytest.importorskip("megatron.core")
pytest.importorskip("psutil")  # megatron's torch_dist writer logs memory through it

import torch
from megatron_models import parallel_train

from megatron_prt.core import Placement
from megatron_prt.megatron.config import ReuseConfig
from megatron_prt.runtime.local import all_ok, run_local

G = 4  # micro-batches per step over all data-parallel ranks
LAYERS = 6
SAVED = (1, Placement(2, 2, "wave", "uni"), 2)  # TP, placement, DP
# float64 losses agree to summation order (1e-12) while TP is unchanged. megatron computes
# the vocab-parallel cross entropy in fp32, so a different TP size rounds the loss
# differently: one fp32 ulp (measured 4.8e-7 absolute, 1.2e-7 relative); an error in what
# was loaded moves losses by >1e-4.
SAME_TP, OTHER_TP = dict(rtol=1e-12, atol=0), dict(rtol=1e-6, atol=0)
RESUMED = [  # (TP, placement, DP): what changes against SAVED
    (1, Placement(2, 3, "loop", "uni"), 2),  # R 2 -> 3, wave -> loop
    (1, Placement(2, 2, "wave", "bi"), 1),  # uni -> bi, DP 2 -> 1
    (1, Placement(4, 1, "loop", "uni"), 1),  # P 2 -> 4, DP 2 -> 1
    (2, Placement(2, 2, "wave", "bi"), 1),  # TP 1 -> 2, uni -> bi, DP 2 -> 1
]


def _train(kind, tp, placement, dp, steps, states=None, load=None, save=None):
    """Losses of every step, micro-batches of all DP ranks in order."""
    reuse = None if placement is None else ReuseConfig(placement, LAYERS)
    ranks = tp * dp * (1 if placement is None else placement.ranks)
    ckpt = {"steps": steps, "load": load, "save": save}
    results = all_ok(
        run_local(
            ranks, parallel_train, kind, tp, G // dp, reuse, states, None, False,
            torch.float64, ckpt, deadline_s=600,
        )
    )  # fmt: skip
    by_dp = {r["dp"]: r for r in results if r["tp"] == 0 and r["losses"] and r["losses"][0]}
    assert sorted(by_dp) == list(range(dp))
    steps = range(len(by_dp[0]["losses"]))
    losses = [[loss for d in range(dp) for loss in by_dp[d]["losses"][s]] for s in steps]
    return losses, results


@functools.cache
def _saved(kind: str, directory: str):
    """The uninterrupted run's losses; SAVED's first two steps written to ``directory``."""
    whole, results = _train(kind, 1, None, 1, (0, 4))
    states = {0: results[0]["state"]}
    tp, placement, dp = SAVED
    first, _ = _train(kind, tp, placement, dp, (0, 2), states, save=directory)
    torch.testing.assert_close(torch.tensor(first), torch.tensor(whole[:2]), **SAME_TP)
    return whole


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(tmp_path_factory.mktemp("ckpt") / "step2")


@pytest.mark.slow
@pytest.mark.parametrize("tp,placement,dp", RESUMED, ids=lambda v: str(v))
def test_resumed_under_another_layout_continues_the_run(checkpoint, tp, placement, dp):
    whole = _saved("gpt", checkpoint)
    resumed, _ = _train("gpt", tp, placement, dp, (2, 4), load=checkpoint)
    tol = SAME_TP if tp == SAVED[0] else OTHER_TP
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(whole[2:]), **tol)


def test_a_layout_with_an_empty_middle_stage_resumes(tmp_path):
    """A stage of no layer, embedding or head asks the checkpoint for nothing, and megatron's
    load returns only the keys it loaded: the resume failed with KeyError 'chunk1', called
    the checkpoint damaged and told the user to start again, even under the same layout."""
    placement = Placement(2, 2, "wave", "uni")  # stage 2: rank 1's second chunk, empty
    reuse = ReuseConfig(placement, LAYERS, (2, 1, 0, 3))
    saved = str(tmp_path / "step1")

    def run(steps, load=None, save=None):
        ckpt = {"steps": steps, "load": load, "save": save}
        results = all_ok(
            run_local(
                2, parallel_train, "gpt", 1, G, reuse, None, None, False, torch.float64, ckpt,
                deadline_s=300,
            )
        )  # fmt: skip
        return next(r["losses"] for r in results if r["losses"] and r["losses"][0])

    whole = run((0, 2))
    run((0, 1), save=saved)
    resumed = run((1, 2), load=saved)
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(whole[1:]), **SAME_TP)


def _errors(results) -> list[str]:
    assert all(status == "error" for status, _ in results), results
    return [str(payload) for _, payload in results]


def test_another_vocabulary_or_tie_is_refused_on_every_rank(tmp_path, monkeypatch):
    """megatron loads the word embedding and output layer with ``allow_shape_mismatch``: a
    checkpoint of a 64-token model loaded into a 72-token one with rows cut or left as
    initialised, without a word. And megatron tells each rank only of the keys it asked for:
    a tied model's checkpoint loaded untied was refused on the last stage alone, whose peer
    went on into its next collective."""
    import megatron_models

    reuse = ReuseConfig(Placement(2, 1), LAYERS)
    saved = str(tmp_path / "step1")

    def run(kind, steps, load=None, save=None):
        ckpt = {"steps": steps, "load": load, "save": save}
        args = ("gpt" if kind is None else kind, 1, G, reuse, None, None, False, torch.float64)
        return run_local(2, parallel_train, *args, ckpt, deadline_s=300)

    all_ok(run("gpt", (0, 1), save=saved))
    monkeypatch.setattr(megatron_models, "VOCAB", 72)  # the forked ranks build with it
    for text in _errors(run("gpt", (1, 2), load=saved)):
        assert "embedding.word_embeddings.weight of shape (64, 16)" in text, text
        assert "this model's is (72, 16)" in text, text
    monkeypatch.setattr(megatron_models, "VOCAB", 64)
    for text in _errors(run("gpt-untied", (1, 2), load=saved)):
        assert "it was saved from another model" in text, text


def test_weights_without_optimizer_state_are_named_so(tmp_path):
    """Saved with optimizer=None and loaded with an optimizer: it said the checkpoint came
    from another optimizer."""
    reuse = ReuseConfig(Placement(2, 1), LAYERS)
    saved = str(tmp_path / "weights")
    args = ("gpt", 1, G, reuse, None, None, False, torch.float64)
    ckpt = {"steps": (0, 1), "save": saved, "save_optimizer": False}
    all_ok(run_local(2, parallel_train, *args, ckpt, deadline_s=300))
    ckpt = {"steps": (1, 2), "load": saved}
    for text in _errors(run_local(2, parallel_train, *args, ckpt, deadline_s=300)):
        assert "holds no optimizer state (saved with optimizer=None)" in text, text


def test_global_state_refuses_tensor_parallel_shards(monkeypatch):
    """The bench's merge of every rank's weights by name let the lowest tensor-parallel
    rank's shard stand for the whole tensor."""
    from megatron.core import parallel_state

    from megatron_prt.megatron.weights import global_state

    monkeypatch.setattr(parallel_state, "model_parallel_is_initialized", lambda: True)
    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_world_size", lambda: 2)
    with pytest.raises(ValueError, match=r"under tensor parallelism \(size 2\)"):
        global_state([], tied=True)
