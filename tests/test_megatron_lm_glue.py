"""The Megatron-LM glue the patches call, and the patches themselves (no network in CI).

Megatron-LM's training package is not installable here, so a stand-in ``megatron.training``
(``get_args``, ``core_transformer_config_from_args``) lets the glue run as ``get_model``
drives it: one provider call per chunk, chunk 0 first, pre/post computed megatron's way.
"""

from __future__ import annotations

import inspect
import pathlib
import re
import sys
import types
from functools import partial

import pytest

pytest.importorskip("megatron.core")

import torch
from megatron_models import (
    MBS,
    SEQ,
    batches,
    build_model,
    forward_step,
    grads_by_name,
    is_tied,
    load_global,
    reference,
    setup_megatron,
    transformer_config,
)

from megatron_prt.megatron import megatron_lm
from megatron_prt.runtime.local import all_ok, run_local

PATCHES = pathlib.Path(__file__).parents[1] / "patches"
LAYERS, M = 8, 4


def _stand_in_training(args) -> None:
    training = types.ModuleType("megatron.training")
    training.get_args = lambda: args
    arguments = types.ModuleType("megatron.training.arguments")
    arguments.core_transformer_config_from_args = lambda a: transformer_config(
        a.num_layers,
        pipeline_model_parallel_size=a.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=a.virtual_pipeline_model_parallel_size,
    )
    training.arguments = arguments
    sys.modules["megatron.training"] = training
    sys.modules["megatron.training.arguments"] = arguments


def _get_model_like_megatron(rank, world, kind, reuse_flags, state):
    """Flags -> validate_args -> megatron's get_model loop through the wrapped provider ->
    the installed forward-backward function; returns losses and grads by global name."""
    import argparse

    from megatron.core import pipeline_parallel

    parser = megatron_lm.add_arguments(argparse.ArgumentParser())
    args = parser.parse_args(reuse_flags)
    args.num_layers, args.pipeline_model_parallel_size = LAYERS, world
    args.micro_batch_size, args.global_batch_size = MBS, MBS * M
    args.world_size, args.tensor_model_parallel_size, args.context_parallel_size = world, 1, 1
    reuse = megatron_lm.validate_args(args)
    _stand_in_training(args)
    setup_megatron(world, args.virtual_pipeline_model_parallel_size)
    assert megatron_lm.get_embedding_ranks([0, 1]) == [0]

    def provider(pre_process, post_process, vp_stage=None, config=None, pg_collection=None):
        return build_model(kind, config, pre_process, post_process, vp_stage)

    wrapped = megatron_lm.model_provider(provider)
    chunks = reuse.placement.chunks_per_rank
    model = []
    for vp in range(chunks):  # megatron's guess at pre/post (rank 0 / P-1): the glue ignores it
        model.append(wrapped(pre_process=rank == 0 and vp == 0, post_process=False, vp_stage=vp))
    with torch.no_grad():  # same weights as the reference (prepared copies are overwritten)
        load_global(model, state, is_tied(kind))
    forward_backward = pipeline_parallel.get_forward_backward_func()
    assert forward_backward.reuse == reuse, "the glue installs PRT on the first chunk"
    store = forward_backward(
        forward_step_func=partial(forward_step, kind, False),
        data_iterator=[iter(batches(M)) for _ in model],
        model=model,
        num_microbatches=M,
        seq_length=SEQ,
        micro_batch_size=MBS,
    )
    return {
        "losses": [s["lm loss"] for s in store],
        "grads": grads_by_name(model, is_tied(kind)),
        "timeout_s": forward_backward.pipeline().timeout_s,
    }


@pytest.mark.parametrize(
    "kind,flags",
    [
        ("bert", ["--pipeline-reuse", "2", "--pipeline-reuse-placement", "wave"]),
        ("gpt", ["--pipeline-reuse", "1", "--pipeline-reuse-direction", "bi"]),
    ],
)
def test_model_provider_glue_trains_exactly(kind, flags):
    ref = all_ok(run_local(1, reference, kind, LAYERS, M))[0]
    results = all_ok(run_local(2, _get_model_like_megatron, kind, flags, ref["state"]))
    assert [r["timeout_s"] for r in results] == [60.0, 60.0]  # the README's default
    for got, want in zip(results[-1]["losses"], ref["losses"], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    for result in results:
        for name, grads in result["grads"].items():
            for grad in grads:
                torch.testing.assert_close(grad, ref["grads"][name], rtol=1e-10, atol=1e-13)


def _dies_before_sending_losses(rank, world, flags, state):
    """Rank 0 (holder of the wave's last stage) exits where it would send its losses."""
    import os

    import torch.distributed as dist

    if rank == 0:
        dist.send_object_list = lambda *args, **kwargs: os._exit(1)
    return _get_model_like_megatron(rank, world, "gpt", flags, state)


def test_timeout_flag_reaches_the_runtime_and_a_lost_peer_is_named():
    """``--pipeline-reuse-timeout`` is the wait of the runtime the glue installs (it was a
    fixed 600 s), and losing the peer the last rank collects losses from is a PipelineError
    naming that rank (was gloo's bare RuntimeError)."""
    ref = all_ok(run_local(1, reference, "gpt", LAYERS, M))[0]
    flags = ["--pipeline-reuse", "2", "--pipeline-reuse-placement", "wave"]
    flags += ["--pipeline-reuse-timeout", "45"]
    results = all_ok(run_local(2, _get_model_like_megatron, "gpt", flags, ref["state"]))
    assert [r["timeout_s"] for r in results] == [45.0, 45.0]
    rank0, rank1 = run_local(2, _dies_before_sending_losses, flags, ref["state"], wait_for=[1])
    assert rank0 == ("killed", None)
    status, text = rank1
    assert status == "error"
    assert text.startswith("PipelineError: rank 1: waiting on rank 0 for the losses"), text


def test_without_reuse_the_glue_changes_nothing():
    import argparse

    args = megatron_lm.add_arguments(argparse.ArgumentParser()).parse_args([])
    assert megatron_lm.validate_args(args) is None
    calls = []

    def provider(pre_process, post_process, vp_stage=None, config=None, pg_collection=None):
        calls.append((pre_process, post_process, vp_stage, config))
        return "model"

    def run(rank, world):
        _stand_in_training(args)
        setup_megatron(1, None)
        got = megatron_lm.get_embedding_ranks([0, 3])
        return got, megatron_lm.model_provider(provider)(True, False, vp_stage=None), calls

    got, model, seen = all_ok(run_local(1, run))[0]
    assert got == [0, 3] and model == "model" and seen == [(True, False, None, None)]


# -- the patch files --------------------------------------------------------------------------
def _patch_files() -> list[pathlib.Path]:
    return sorted(PATCHES.glob("*.patch"))


def test_patch_series_is_recorded_and_well_formed():
    tag, *names = (PATCHES / "series").read_text().splitlines()
    assert re.fullmatch(r"core_v0\.16\.1 [0-9a-f]{40}", tag), "first line: tag and its commit"
    assert [p.name for p in _patch_files()] == names
    for path in _patch_files():
        text = path.read_text()
        targets = re.findall(r"^diff --git a/(\S+) b/\1$", text, flags=re.M)
        assert targets, f"{path.name}: no file diffs"
        for hunk in re.finditer(r"^@@ -(\d+),(\d+) \+(\d+),(\d+) @@.*\n((?:[ +\-\\].*\n?)*)",
                                text, flags=re.M):  # fmt: skip
            lines = [ln for ln in hunk.group(5).splitlines() if not ln.startswith("\\")]
            old = sum(1 for ln in lines if ln[:1] in (" ", "-"))
            new = sum(1 for ln in lines if ln[:1] in (" ", "+"))
            assert (old, new) == (int(hunk.group(2)), int(hunk.group(4))), (
                f"{path.name}: hunk at line {hunk.group(1)} miscounts its lines"
            )


def test_patches_call_hooks_that_exist_with_megatrons_signatures():
    text = "".join(p.read_text() for p in _patch_files())
    for name in re.findall(r"pipeline_reuse\.(\w+)", text):
        assert callable(getattr(megatron_lm, name)), name
    assert "from megatron_prt.megatron.megatron_lm import validate_args" in text
    # get_model calls the provider with these keywords; Megatron calls get_embedding_ranks
    # with the pipeline ranks (and optionally the split rank)
    wrapped = inspect.signature(megatron_lm.model_provider(lambda **kw: None), follow_wrapped=False)
    for keyword in ("pre_process", "post_process", "vp_stage", "config"):
        assert keyword in wrapped.parameters
    assert list(inspect.signature(megatron_lm.get_embedding_ranks).parameters)[:1] == ["pp_ranks"]
