"""Chunks built by hand from megatron's own rules instead of the PRT layout are refused by
``prepare_model`` on every rank (they trained as another model: wave ran its layers out of
order, bi dropped half of them)."""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")

from megatron_models import MBS, SEQ, build_model, setup_megatron, transformer_config

from megatron_prt.core import Placement
from megatron_prt.megatron.config import ReuseConfig
from megatron_prt.runtime.errors import PipelineError
from megatron_prt.runtime.local import run_local


def _prepare(rank, world, direction, how, kind="gpt-untied"):
    from megatron_prt.megatron import prepare_model
    from megatron_prt.megatron.layout import chunk_roles
    from megatron_prt.megatron.model import transformer_config_kwargs

    reuse = ReuseConfig(Placement(2, 2, "wave", direction), 8)
    chunks = reuse.placement.chunks_per_rank
    setup_megatron(2, chunks)
    if how == "megatron-sizes":  # what a user sets without transformer_config_kwargs
        config = transformer_config(
            8, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=chunks
        )
    elif how == "loop-layout":  # a PRT layout, of another placement: other layer numbers
        other = ReuseConfig(Placement(2, 2, "loop", direction), 8)
        config = transformer_config(**transformer_config_kwargs(other))
    else:
        config = transformer_config(**transformer_config_kwargs(reuse))
    model = []
    for c, role in enumerate(chunk_roles(reuse, rank)):
        if how == "megatron-roles":  # megatron's interleaved rule: first chunk of rank 0 ...
            pre, post = c == 0 and rank == 0, c == chunks - 1 and rank == world - 1
        else:
            pre, post = role.pre_process, role.post_process
        model.append(build_model(kind, config, pre, post, vp_stage=c))
    try:
        prepare_model(model, reuse)
    except ValueError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize(
    "direction, how, said",
    [
        ("uni", "megatron-sizes", "was built without the PRT layer layout"),
        ("bi", "megatron-sizes", "was built without the PRT layer layout"),
        ("uni", "megatron-roles", "was built with post_process="),
        ("uni", "roles", None),
        ("bi", "roles", None),
        ("uni", "loop-layout", "], its stage computes layers ["),
    ],
)
@pytest.mark.parametrize("kind", ["gpt-untied", "bert"])  # BERT's layers are its encoder's
def test_chunks_built_as_another_model_are_refused(direction, how, said, kind):
    results = run_local(2, _prepare, direction, how, kind)
    for status, error in results:
        assert status == "ok", error
        if said is None:
            assert error is None
        else:  # a rank with a wrong chunk says how; one whose chunks are right names them
            assert said in error or "refused their chunk" in error, error
    assert said is None or any(said in error for _, error in results)


def _other_split(rank, world):
    """Each rank's chunks are built right for its own flags, and the flags' layer splits
    differ (two plan files): rank 1 ran layers rank 0 also ran, and the gradients came out
    18% off without a word."""
    from functools import partial

    from megatron_models import batches, forward_step, model_chunks

    from megatron_prt.megatron import make_forward_backward_func, prepare_model
    from megatron_prt.megatron.model import transformer_config_kwargs

    split = (3, 3, 1, 1) if rank == 0 else (2, 2, 2, 2)
    reuse = ReuseConfig(Placement(2, 2, "loop", "uni"), 8, split)
    setup_megatron(2, reuse.placement.chunks_per_rank)
    model = model_chunks("gpt", transformer_config(**transformer_config_kwargs(reuse)), reuse)
    prepare_model(model, reuse)
    forward_backward = make_forward_backward_func(reuse, timeout_s=60)
    try:
        forward_backward(
            forward_step_func=partial(forward_step, "gpt", False),
            data_iterator=[iter(batches(2)) for _ in model],
            model=model,
            num_microbatches=2,
            seq_length=SEQ,
            micro_batch_size=MBS,
        )
    except PipelineError as exc:
        return str(exc)
    return None


def test_ranks_with_other_layer_splits_are_refused():
    results = run_local(2, _other_split, deadline_s=120)
    for rank, (status, said) in enumerate(results):
        assert status == "ok" and said is not None, (rank, said)
        assert f"ranks [{1 - rank}] built their stages with another layer split" in said


def test_a_one_stage_pipeline_sums_no_tied_copy():
    """D = 1: one chunk holds the word embedding and, through it, the output weight; the
    pair (0, 0) summed the gradient with itself (doubled). Tied pairs and the chunks whose
    reduction waits for them come from Placement.end_pairs."""
    import torch

    from megatron_prt.megatron.model import _tied_pairs, chunks_summed_after_schedule

    class Tied(torch.nn.Module):
        share_embeddings_and_output_weights = True

    one = ReuseConfig(Placement(1, 1), 2)
    assert _tied_pairs(one, {0: Tied()}) == []
    assert chunks_summed_after_schedule(one.placement, 0, [Tied()]) == set()
    two = ReuseConfig(Placement(2, 2, "wave"), 4)  # stages 0 and 3 on rank 0
    assert _tied_pairs(two, {0: Tied(), 3: Tied()}) == [(0, 3)]
    assert chunks_summed_after_schedule(two.placement, 0, [Tied(), Tied()]) == {0, 1}
