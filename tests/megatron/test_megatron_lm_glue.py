"""The Megatron-LM glue the patches call, and the patches themselves (no network in CI).

Megatron-LM's training package is not installable here, so a stand-in ``megatron.training``
(``get_args``, ``core_transformer_config_from_args``) lets the glue run as ``get_model``
drives it: one provider call per chunk, chunk 0 first, pre/post computed megatron's way.
"""

from __future__ import annotations

import inspect
import pathlib
import re
import subprocess
import sys
import textwrap
import types

import pytest

pytest.importorskip("megatron.core")

import torch
from megatron_models import (
    MBS,
    build_model,
    grads_by_name,
    is_tied,
    load_global,
    reference,
    setup_megatron,
    step_kwargs,
    transformer_config,
)

from megatron_prt.megatron import megatron_lm
from megatron_prt.runtime.local import all_ok, run_local

PATCHES = pathlib.Path(__file__).parents[2] / "patches"
LAYERS, M = 8, 4
AUTO_FLAGS = ["--pipeline-reuse", "auto:2", "--pipeline-reuse-placement", "wave"]
AUTO_FLAGS += ["--pipeline-reuse-auto-candidates", "1"]  # the tuned plan: final after 3 calls


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
    _, model, forward_backward = _build_like_megatron(rank, world, kind, reuse_flags, state)
    store = forward_backward(**step_kwargs(kind, model, M))
    return {
        "losses": [s["lm loss"] for s in store],
        "grads": grads_by_name(model, is_tied(kind)),
        "timeout_s": forward_backward.pipeline().timeout_s,
    }


def _build_like_megatron(rank, world, kind, reuse_flags, state):
    """(args, model chunks, the installed forward-backward function), built as
    :func:`_get_model_like_megatron` says."""
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
    # Megatron-LM's train() from core_v0.19 passes its process groups
    groups_given = pipeline_parallel.get_forward_backward_func(schedule_pg_collection=None)
    assert groups_given is forward_backward
    _check_fully_parallel_save_installed()
    _check_chunk_stage_queries(reuse, rank, len(model))
    return args, model, forward_backward


def _check_fully_parallel_save_installed():
    """The glue makes Megatron-LM's fully parallel torch_dist save keep one main copy per shard
    on a rank (megatron_prt.megatron.checkpoint_lm; tests/megatron/test_megatron_lm_ckpt.py)."""
    from megatron.core.dist_checkpointing.strategies import fully_parallel

    assert fully_parallel.distribute_main_replicas_with_precomputed_distribution.megatron_prt


def _check_chunk_stage_queries(reuse, rank, chunks):
    """Asked per chunk (as Megatron-LM does building data iterators), megatron's stage queries
    answer for the stage the placement gives that chunk."""
    from megatron.core import parallel_state

    stages = reuse.placement.rank_stages[rank]
    for chunk in range(chunks):
        model_stage = reuse.placement.model_stage(stages[chunk])
        first = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=chunk)
        last = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=chunk)
        assert (first, last) == (model_stage == 0, model_stage == reuse.placement.depth - 1), (
            f"rank {rank} chunk {chunk} (model stage {model_stage})"
        )


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

    from megatron_prt.megatron import losses

    if rank == 0:
        losses._send_object = lambda *args, **kwargs: os._exit(1)
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
TAGS = sorted(p.name for p in PATCHES.iterdir() if p.is_dir())
# The lines each tag's first patch adds where Megatron-LM validates its arguments.
VALIDATE_HOOKS = {
    "core_v0.16.1": "0001-initialize-translate-pipeline-reuse-flags.patch",
    "core_v0.19.0": "0001-arguments-translate-pipeline-reuse-flags.patch",
}


def _patch_files(tag: str | None = None) -> list[pathlib.Path]:
    return sorted((PATCHES / tag).glob("*.patch") if tag else PATCHES.glob("*/*.patch"))


def test_every_supported_tag_has_patches():
    assert TAGS == sorted(VALIDATE_HOOKS), "patches/<tag>/ directories"


@pytest.mark.parametrize("tag", TAGS)
def test_patch_series_is_recorded_and_well_formed(tag):
    first, *names = (PATCHES / tag / "series").read_text().splitlines()
    assert re.fullmatch(rf"{re.escape(tag)} [0-9a-f]{{40}}", first), "first line: tag, commit"
    assert [p.name for p in _patch_files(tag)] == names
    for path in _patch_files(tag):
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


def _patched_validate_hook(tag: str) -> str:
    """The lines ``tag``'s first patch adds before Megatron's ``validate_args``, dedented to
    run on their own."""
    text = (PATCHES / tag / VALIDATE_HOOKS[tag]).read_text()
    added = [ln[1:] for ln in text.splitlines() if ln.startswith("+") and not ln.startswith("++")]
    return textwrap.dedent("\n".join(added))


@pytest.mark.parametrize("tag", TAGS)
@pytest.mark.parametrize(
    "flags,named",
    [
        (["--pipeline-reuse-placement", "wave", "--pipeline-reuse-direction", "bi"],
         "--pipeline-reuse-placement, --pipeline-reuse-direction given without --pipeline-reuse"),
        (["--pipeline-reuse-timeout", "30"], "--pipeline-reuse-timeout given without"),
    ],
)  # fmt: skip
def test_patched_megatron_refuses_reuse_flags_without_pipeline_reuse(
    tag, flags, named, capsys, monkeypatch
):
    """Megatron-LM with the patches: PRT flags without ``--pipeline-reuse`` stop the run with
    the flag named (they used to be dropped, and plain 1F1B trained), in one line on rank
    0's stderr and exit status 2 (was a ConfigError traceback from every rank)."""
    import argparse

    from megatron_prt.megatron import bert_args

    monkeypatch.setattr(bert_args, "OTHER_RANKS_WAIT_S", 0.0)
    args = megatron_lm.add_arguments(argparse.ArgumentParser()).parse_args(flags)
    for rank, says in (("0", True), ("1", False)):
        monkeypatch.setenv("RANK", rank)
        with pytest.raises(SystemExit) as stopped:
            exec(_patched_validate_hook(tag), {"args": args})
        assert stopped.value.code == 2
        err = capsys.readouterr().err
        assert (err.startswith("megatron-prt: error: " + named) and err.count("\n") == 1) == says
        assert says or err == ""


@pytest.mark.parametrize("tag", TAGS)
def test_patched_megatron_translates_reuse_flags_and_ignores_other_scripts(tag):
    import argparse

    args = megatron_lm.add_arguments(argparse.ArgumentParser()).parse_args(
        ["--pipeline-reuse", "2", "--pipeline-reuse-placement", "wave"]
    )
    args.num_layers, args.pipeline_model_parallel_size = 8, 2
    exec(_patched_validate_hook(tag), {"args": args})
    assert args.pipeline_reuse_config.placement.chunks_per_rank == 2
    assert args.num_virtual_stages_per_pipeline_rank == 2
    other = argparse.Namespace(num_layers=8)  # a script without add_arguments: untouched
    exec(_patched_validate_hook(tag), {"args": other})
    assert vars(other) == {"num_layers": 8}


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


def test_validate_args_prints_the_layout_on_rank_0(capsys):
    import argparse

    args = megatron_lm.add_arguments(argparse.ArgumentParser()).parse_args(
        ["--pipeline-reuse", "2", "--pipeline-reuse-placement", "wave"]
    )
    args.num_layers, args.pipeline_model_parallel_size = 10, 2
    megatron_lm.validate_args(args)
    assert capsys.readouterr().out == (
        "megatron-prt: schedule PRT R=2 wave/uni; 4 stages on 2 ranks, layers 3,3,2,2\n"
    )


@pytest.mark.parametrize(
    "flags", [["--pipeline-reuse", "2", "--pipeline-reuse-direction", "bi"], AUTO_FLAGS]
)
def test_checkpointed_args_load_with_torch_weights_only(tmp_path, flags):
    """Megatron-LM saves ``args`` in every checkpoint and loads them with ``weights_only``:
    the PRT config they carry must load (it stopped every resume with 'Unsupported global'),
    and so must ``--pipeline-reuse auto``'s value (it stopped every resume of auto)."""
    import argparse

    args = megatron_lm.add_arguments(argparse.ArgumentParser()).parse_args(flags)
    args.num_layers, args.pipeline_model_parallel_size = 8, 2
    reuse = megatron_lm.validate_args(args)
    torch.save({"args": args}, tmp_path / "model_optim_rng.pt")
    loaded = torch.load(tmp_path / "model_optim_rng.pt", weights_only=True)["args"]
    assert loaded.pipeline_reuse_config == reuse
    assert loaded.pipeline_reuse == args.pipeline_reuse


def _auto_like_megatron(rank, world, state, calls, saved=None, iteration=0):
    """``calls`` training calls of ``--pipeline-reuse auto`` built as Megatron-LM builds it;
    ``saved``: a checkpoint's args the run resumes from at ``iteration`` (megatron's
    ``load_args_from_checkpoint`` stood in). Returns, after each call, whether the args
    carry a pick and whether auto still profiles, and the args as Megatron-LM's save writes
    and its load reads them (``weights_only``)."""
    import io

    args, model, forward_backward = _build_like_megatron(rank, world, "gpt", AUTO_FLAGS, state)
    args.data_parallel_size, args.finetune = 1, False
    if saved is not None:
        args.load, args.iteration = "ckpt", iteration
        checkpointing = types.ModuleType("megatron.training.checkpointing")
        checkpointing.load_args_from_checkpoint = lambda copied: (copied, saved)
        sys.modules["megatron.training.checkpointing"] = checkpointing
    carried, profiling = [], []
    for _ in range(calls):
        forward_backward(**step_kwargs("gpt", model, M))
        carried.append(getattr(args, "pipeline_reuse_auto_pick", None) is not None)
        profiling.append(forward_backward.auto.profiling)
    written = io.BytesIO()
    torch.save({"args": args}, written)
    written.seek(0)
    loaded = torch.load(written, weights_only=True)["args"]
    final = forward_backward.auto.final
    return {"carried": carried, "profiling": profiling, "args": loaded, "final": final}


def test_auto_pick_travels_in_megatron_lm_checkpoints_and_is_resumed():
    """[Note: Megatron-LM's checkpoints carry auto's pick]: the args Megatron-LM saves hold
    auto's pick once it is made (they held none: a resume profiled again and, with dropout,
    left the uninterrupted run's numbers); a resume under the same grid runs it from its
    first call, one under another grid profiles again."""
    state = all_ok(run_local(1, reference, "gpt", LAYERS, M))[0]["state"]
    first = all_ok(run_local(2, _auto_like_megatron, state, 4))
    for result in first:
        assert result["carried"] == [False, False, True, True], result["carried"]
        assert result["profiling"] == [True, True, False, False], result["profiling"]
    saved = first[0]["args"]
    resumed = all_ok(run_local(2, _auto_like_megatron, state, 1, saved, 3))
    for result in resumed:
        assert result["profiling"] == [False] and result["carried"] == [True]
        assert result["final"] == first[0]["final"]
    saved.data_parallel_size = 2  # the pick was timed on another grid
    other = all_ok(run_local(2, _auto_like_megatron, state, 1, saved, 3))
    assert [r["profiling"] for r in other] == [[True], [True]]


def _first_call_after_loading(rank, world, state, case):
    """The first call of a run under ``case.run`` flags that loaded a checkpoint saved under
    ``case.saved`` (None: megatron's own schedule, ``case.vp`` chunks, ``case.extra`` saved
    settings) in ``case.format`` (megatron's ``load_args_from_checkpoint`` stood in)."""
    import argparse

    from megatron_prt.core.placement import ConfigError

    saved_flags, ckpt_format, saved_vp = case["saved"], case["format"], case.get("vp")
    args, model, forward_backward = _build_like_megatron(rank, world, "gpt", case["run"], state)
    args.load, args.iteration, args.finetune, args.ckpt_format = "ckpt", 3, False, "torch"
    parser = megatron_lm.add_arguments(argparse.ArgumentParser())
    saved = parser.parse_args(saved_flags or [])
    saved.num_layers, saved.pipeline_model_parallel_size = LAYERS, world
    saved.micro_batch_size, saved.global_batch_size = MBS, MBS * M
    saved.world_size, saved.tensor_model_parallel_size, saved.context_parallel_size = world, 1, 1
    if saved_flags:
        megatron_lm.validate_args(saved)
    saved.virtual_pipeline_model_parallel_size = saved_vp
    saved.ckpt_format = ckpt_format
    vars(saved).update(case.get("extra", {}))
    checkpointing = types.ModuleType("megatron.training.checkpointing")
    checkpointing.load_args_from_checkpoint = lambda copied: (copied, saved)
    sys.modules["megatron.training.checkpointing"] = checkpointing
    try:
        forward_backward(**step_kwargs("gpt", model, M), forward_only=True)
    except ConfigError as exc:
        return str(exc)
    return "ran"


R2, WAVE2 = (
    ["--pipeline-reuse", "2"],
    ["--pipeline-reuse", "2", "--pipeline-reuse-placement", "wave"],
)
R1, WAVE1 = (
    ["--pipeline-reuse", "1"],
    ["--pipeline-reuse", "1", "--pipeline-reuse-placement", "wave"],
)
LAYOUT_CASES = {  # name: (case, refused)
    "loop->wave": ({"run": R2, "saved": WAVE2, "format": "torch"}, True),
    "uni->bi": (
        {"run": R2, "saved": [*R2, "--pipeline-reuse-direction", "bi"], "format": "torch"},
        True,
    ),
    # megatron's one chunk per rank: R=2's second chunk got nothing
    "megatron R=1 -> R=2": ({"run": R2, "saved": None, "format": "torch"}, True),
    "same layout": ({"run": R2, "saved": R2, "format": "torch"}, False),
    "megatron interleaved": ({"run": R2, "saved": None, "format": "torch", "vp": 2}, False),
    # megatron's split counted the embedding: uneven, its layers elsewhere
    "megatron interleaved, embedding in the split": (
        {
            "run": R2,
            "saved": None,
            "format": "torch",
            "vp": 2,
            "extra": {"account_for_embedding_in_pipeline_split": True},
        },
        True,
    ),
    "R=1 loop and wave hold the same": ({"run": R1, "saved": WAVE1, "format": "torch"}, False),
    "torch_dist": ({"run": R2, "saved": WAVE2, "format": "torch_dist"}, False),
}


@pytest.mark.parametrize("name", LAYOUT_CASES)
def test_a_torch_format_checkpoint_of_another_layout_is_refused(name):
    """[Note: torch-format checkpoints hold chunks by position]: a loop R=3 checkpoint
    resumed as wave R=3 trained on at another loss, a megatron R=1 one under R=2 loaded
    nothing into the second chunk, without a word. Even an evaluation's first call refuses."""
    case, refused = LAYOUT_CASES[name]
    state = all_ok(run_local(1, reference, "gpt", LAYERS, M))[0]["state"]
    for text in all_ok(run_local(2, _first_call_after_loading, state, case)):
        if refused:
            assert "is a torch-format checkpoint saved under" in text, text
            assert "--ckpt-convert-format torch_dist" in text, text
        else:
            assert text == "ran", text


def test_checkpointed_args_of_a_plan_file_run_load_with_torch_weights_only(tmp_path):
    """``--pipeline-reuse-plan FILE``: the config in the args holds the plan, whose classes
    the weights_only load refused ('Unsupported global: ...Plan'): [Note: a config pickles
    its plan as JSON]. The loaded config runs the same plan."""
    import argparse

    from megatron_prt.core.placement import Placement
    from megatron_prt.core.schedules import build_plan
    from megatron_prt.tune.plan_file import PlanFile

    plan = build_plan(Placement(2, 2, "wave", "bi"), M)
    PlanFile(plan, (2, 2, 2, 2)).write(str(tmp_path / "plan.json"))
    parser = megatron_lm.add_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--pipeline-reuse-plan", str(tmp_path / "plan.json")])
    args.num_layers, args.pipeline_model_parallel_size = LAYERS, 2
    args.micro_batch_size, args.global_batch_size, args.world_size = MBS, MBS * M, 2
    args.tensor_model_parallel_size, args.context_parallel_size = 1, 1
    reuse = megatron_lm.validate_args(args)
    assert reuse.plan == plan
    torch.save({"args": args}, tmp_path / "model_optim_rng.pt")
    loaded = torch.load(tmp_path / "model_optim_rng.pt", weights_only=True)["args"]
    assert loaded.pipeline_reuse_config == reuse and loaded.pipeline_reuse_config.plan == plan


def test_config_built_script_trains_through_a_provider_only_under_reuse():
    """``pretrain_gpt.py`` from core_v0.19 builds its model from a config: without
    --pipeline-reuse the config stays and no provider is passed (Megatron unchanged); with it,
    ``pretrain`` gets no config and the wrapped provider (``get_model`` then builds the
    chunks, as for BERT)."""
    import argparse

    def provider(pre_process, post_process, vp_stage=None, config=None, pg_collection=None):
        return "model"

    config = object()
    plain = megatron_lm.add_arguments(argparse.ArgumentParser()).parse_args([])
    megatron_lm.validate_args(plain)
    assert megatron_lm.config_or_provider(plain, config, provider) == (config, None)
    reused = megatron_lm.add_arguments(argparse.ArgumentParser()).parse_args(
        ["--pipeline-reuse", "2"]
    )
    reused.num_layers, reused.pipeline_model_parallel_size = 8, 2
    megatron_lm.validate_args(reused)
    kept, wrapped = megatron_lm.config_or_provider(reused, config, provider)
    assert kept is None and wrapped.__wrapped__ is provider


def test_script_providers_are_chained_and_kept_without_reuse(monkeypatch):
    """``pretrain_gpt.py`` has its own embedding ranks (MTP) and argument provider (ModelOpt):
    without --pipeline-reuse they decide; the PRT flags are always added."""
    import argparse

    seen = []

    def script_ranks(pp_ranks, *rest):
        seen.append(pp_ranks)
        return [pp_ranks[0], pp_ranks[-1], 99]

    def script_arguments(parser):
        parser.add_argument("--script-flag", default="x")
        return parser

    parser = megatron_lm.add_arguments_and(script_arguments)(argparse.ArgumentParser())
    args = parser.parse_args(["--pipeline-reuse-timeout", "5"])
    assert (args.script_flag, args.pipeline_reuse_timeout) == ("x", 5.0)
    plain = megatron_lm.add_arguments_and(None)(argparse.ArgumentParser()).parse_args([])
    assert plain.pipeline_reuse is None

    for name in ("megatron.training", "megatron.training.arguments"):  # undone after the test
        monkeypatch.delitem(sys.modules, name, raising=False)
    _stand_in_training(argparse.Namespace())  # no pipeline_reuse_config: PRT off
    assert megatron_lm.embedding_ranks_or(script_ranks)([0, 1, 2]) == [0, 2, 99]
    training_args = argparse.Namespace(pipeline_reuse_config=object())
    _stand_in_training(training_args)  # PRT on: only the first rank, the script not asked
    assert megatron_lm.embedding_ranks_or(script_ranks)([0, 1, 2]) == [0]
    assert seen == [[0, 1, 2]]


def test_a_plan_of_another_vocabulary_is_said_when_megatron_lm_builds_the_model(monkeypatch):
    """Under Megatron-LM the tokenizer is built (and the vocabulary padded) before the model:
    the provider's first chunk compares them with the plan or cost file's vocabulary."""
    import argparse
    import warnings

    from megatron_prt.core.placement import Placement
    from megatron_prt.megatron.config import ReuseConfig

    training = types.ModuleType("megatron.training")
    training.get_tokenizer = lambda: types.SimpleNamespace(vocab_size=30522)
    monkeypatch.setitem(sys.modules, "megatron.training", training)
    reuse = ReuseConfig(Placement(2, 2), 4, recorded_vocab=(("p.json was tuned for", 30592),))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # padded to 30592 at divisible-by 128: the same
        megatron_lm._warn_other_vocabulary(reuse, argparse.Namespace(padded_vocab_size=30592))
    training.get_tokenizer = lambda: types.SimpleNamespace(vocab_size=50257)
    with pytest.warns(UserWarning, match=r"30592 tokens, but the tokenizer has 50257 \(padded"):
        megatron_lm._warn_other_vocabulary(reuse, argparse.Namespace(padded_vocab_size=50304))


def test_checkpointed_args_load_once_the_glue_is_imported(tmp_path):
    """``--use-checkpoint-args`` reads a checkpoint's args before any validation runs: the
    PRT config in them failed with 'Unsupported global' unless validate_args had run in
    the process. Importing the glue, as the patched scripts do first, is enough now."""
    import argparse

    args = megatron_lm.add_arguments(argparse.ArgumentParser()).parse_args(AUTO_FLAGS)
    args.num_layers, args.pipeline_model_parallel_size = 8, 2
    megatron_lm.validate_args(args)
    torch.save({"args": args}, tmp_path / "model_optim_rng.pt")
    read = (
        "import torch, megatron.core, megatron_prt.megatron.megatron_lm; "
        f"a = torch.load({str(tmp_path / 'model_optim_rng.pt')!r}, weights_only=True)['args']; "
        "print(a.pipeline_reuse_config.placement)"
    )
    done = subprocess.run([sys.executable, "-c", read], capture_output=True, text=True)
    assert done.returncode == 0 and "Placement(ranks=2" in done.stdout, done.stderr[-800:]
