"""Training with megatron-core's DDP and optimizer under PRT tracks the unpipelined run;
checkpoint keys, install/uninstall and refused calls."""

from __future__ import annotations

import functools
import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("megatron.core")

import torch
import torch.distributed as dist
from megatron_models import (
    LAYERS_TRAIN,
    assert_tracks_reference,
    batches,
    model_chunks,
    reference,
    setup_megatron,
    step_kwargs,
    train,
    transformer_config,
)

from megatron_prt.core import Placement
from megatron_prt.megatron.config import ReuseConfig
from megatron_prt.runtime.local import all_ok, run_local

M = 4
# fp32: the runs differ only in summation order (micro-batch gradient accumulation, the tied
# and replica sums), measured ~1e-7 relative on losses and norms; a lost micro-batch or an
# unsummed tied gradient moves them by >1e-3 and parameters by a full Adam step (1e-3).
TOL = dict(rtol=1e-5, atol=1e-6)


@functools.cache
def _unpipelined(kind: str):
    state = all_ok(run_local(1, reference, kind, LAYERS_TRAIN, M))[0]["state"]
    return state, all_ok(run_local(1, train, kind, M, None, state))[0]


@pytest.mark.parametrize(
    "kind,reuse",
    [
        ("gpt", ReuseConfig(Placement(2, 2, "wave", "bi"), LAYERS_TRAIN)),
        ("bert", ReuseConfig(Placement(2, 3, "loop", "uni"), LAYERS_TRAIN, (2, 1, 1, 2, 1, 1))),
        ("gpt", ReuseConfig(Placement(2, 2, "wave", "uni"), LAYERS_TRAIN)),
    ],
    ids=["gpt-wave-bi-R2", "bert-loop-uni-R3-uneven", "gpt-wave-uni-R2"],
)
def test_three_training_steps_track_the_reference(kind, reuse):
    state, want = _unpipelined(kind)
    results = all_ok(run_local(reuse.placement.ranks, train, kind, M, reuse, state))
    assert_tracks_reference(results, want, TOL)
    assert max(want["norms"]) > 1.0, "gradient clipping is not exercised"
    # checkpoint keys and global positions: PRT chunks together are the unpipelined model,
    # and each tensor has exactly one main copy (the one a checkpoint save writes)
    mains = [key[:2] for r in results for key in r["keys"] if key[2]]
    assert sorted(mains) == sorted(key[:2] for key in want["keys"])


def _install_roundtrip():
    import megatron.core.pipeline_parallel as pp
    from megatron.core.pipeline_parallel import schedules

    from megatron_prt.megatron import install, uninstall

    originals = (pp.get_forward_backward_func, schedules.get_forward_backward_func)
    assert install(None) is False and pp.get_forward_backward_func is originals[0]
    reuse = ReuseConfig(Placement(2, 2), 4)
    assert install(reuse) and install(reuse)  # idempotent
    func = pp.get_forward_backward_func()
    assert func.reuse == reuse and schedules.get_forward_backward_func() is func
    other = ReuseConfig(Placement(2, 2, "wave"), 4)
    install(other)
    assert pp.get_forward_backward_func().reuse == other
    _multi_module_collection_is_refused(pp)
    _stale_lookup_is_refused(originals[0], schedules)
    uninstall()
    assert (pp.get_forward_backward_func, schedules.get_forward_backward_func) == originals
    assert not hasattr(schedules.forward_backward_pipelining_with_interleaving, "__wrapped__")
    uninstall()  # no-op
    return "megatron.training.training" in sys.modules


def _multi_module_collection_is_refused(pp):
    """megatron-core 0.19's multi-module collection selects megatron's bridge schedule (one
    pipeline per module); PRT's lookup refuses it rather than run one model's plan."""
    from megatron_prt.core.placement import ConfigError

    try:
        from megatron.core import process_groups_config

        multi = process_groups_config.MultiModuleProcessGroupCollection
    except AttributeError:  # before megatron-core 0.19: none exists; the lookup checks the name
        multi = type("MultiModuleProcessGroupCollection", (), {})
    collection = object.__new__(multi)
    with pytest.raises(ConfigError, match="MultiModuleProcessGroupCollection"):
        pp.get_forward_backward_func(schedule_pg_collection=collection)


def _stale_lookup_is_refused(stale_lookup, schedules):
    """A get_forward_backward_func taken before install returns megatron's schedule: it used
    to run PRT's chunks in megatron's order (wave: layers out of order), without a word."""
    from megatron_prt.core.placement import ConfigError
    from megatron_prt.megatron.model import _PREPARED

    megatron_schedule = stale_lookup(pp_size=2, vp_size=2)
    chunk = torch.nn.Linear(2, 2)
    setattr(chunk, _PREPARED, True)  # as prepare_model leaves it
    with pytest.raises(ConfigError, match=r"looked up before megatron_prt\.megatron\.install"):
        megatron_schedule(forward_step_func=None, data_iterator=None, model=[chunk])
    # any other model goes to megatron's schedule itself
    assert megatron_schedule.__wrapped__.__module__ == schedules.__name__


def test_install_swaps_every_lookup_and_uninstall_restores():
    assert all_ok(run_local(1, lambda rank, world: _install_roundtrip()))[0] is False


def _refusals(rank, world):
    from megatron_prt.megatron import make_forward_backward_func, prepare_model
    from megatron_prt.megatron.model import transformer_config_kwargs

    reuse = ReuseConfig(Placement(2, 2, "wave"), 4)
    setup_megatron(2, 2)
    config = transformer_config(**transformer_config_kwargs(reuse))
    model = model_chunks("gpt-untied", config, reuse)
    func = make_forward_backward_func(reuse, timeout_s=30)

    def call(**overrides):
        kwargs = {**step_kwargs("gpt-untied", model, M), **overrides}
        try:
            func(**kwargs)
        except (ValueError, RuntimeError, NotImplementedError) as exc:
            return str(exc)
        return None

    messages = {"unprepared": call()}
    prepare_model(model, reuse)
    messages["chunks"] = call(model=model[:1])
    shared = iter(batches(M))
    messages["shared iterator"] = call(data_iterator=[shared, shared])
    dist.barrier()
    return messages


def test_refused_calls_name_the_fix():
    for messages in all_ok(run_local(2, _refusals)):
        assert "prepare_model(model)" in messages["unprepared"]
        assert "1 model chunks given" in messages["chunks"] and "needs 2" in messages["chunks"]
        assert "its own data iterator" in messages["shared iterator"]


def _default_embedding_group(rank, world):
    from megatron.core import parallel_state

    from megatron_prt.megatron import cpu, prepare_model
    from megatron_prt.megatron.model import transformer_config_kwargs

    cpu.enable()
    parallel_state.initialize_model_parallel(
        pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2
    )
    reuse = ReuseConfig(Placement(2, 2), 4)
    config = transformer_config(**transformer_config_kwargs(reuse))
    model = model_chunks("gpt", config, reuse)
    try:
        prepare_model(model, reuse)
    except ValueError as exc:
        return str(exc)
    return None


def test_tied_embeddings_refuse_megatrons_embedding_group():
    for message in all_ok(run_local(2, _default_embedding_group)):
        assert message and "get_embedding_ranks=megatron_prt.megatron.embedding_ranks" in message


def _casts(rank, world):
    from megatron.core.transformer.module import Float16Module

    from megatron_prt.megatron.model import running_chunk

    setup_megatron(1, None)
    config = transformer_config(2, torch.float32, bf16=True)

    class Echo(torch.nn.Module):
        def forward(self, x):
            return x

    chunk = Float16Module(config, Echo())
    seen = {}
    for first, last in [(True, False), (False, True), (False, False), (True, True)]:
        with running_chunk(first, last):
            seen[(first, last)] = (
                chunk(torch.ones(2)).dtype,
                chunk(torch.ones(2).bfloat16()).dtype,
            )
    seen["outside"] = chunk(torch.ones(2)).dtype  # megatron's own answer: one stage, fp32 out
    return seen


def test_mixed_precision_casts_follow_the_placement():
    """Half precision in at the model's first stage, fp32 out at its last, whichever rank and
    chunk they sit on; nothing in between (megatron tests pipeline rank 0 / P-1 instead)."""
    seen = all_ok(run_local(1, _casts))[0]
    bf16, fp32 = torch.bfloat16, torch.float32
    assert seen[(True, False)] == (bf16, bf16)
    assert seen[(False, True)] == (fp32, fp32)
    assert seen[(False, False)] == (fp32, bf16)
    assert seen[(True, True)] == (fp32, fp32)
    assert seen["outside"] == fp32


def test_trace_flag_writes_the_measured_timeline(tmp_path):
    """--pipeline-reuse-trace: the first training iteration as a Chrome trace (+ PNG)."""
    import json

    from megatron_models import run_prt

    prefix = tmp_path / "sub" / "prt"
    reuse = ReuseConfig(Placement(2, 2, "wave", "bi"), 8, trace_path=str(prefix))
    state = all_ok(run_local(1, reference, "gpt", 8, M))[0]["state"]
    all_ok(run_local(2, run_prt, "gpt", M, reuse, state))
    events = json.loads((tmp_path / "sub" / "prt.json").read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    spans = [e for e in events if e.get("ph") == "X"]
    # every F and B of every stage: 2 pipelines x D stages x their m/2 micro-batches x 2
    assert len(spans) == 2 * reuse.placement.depth * M
    assert {e["tid"] for e in spans} == {0, 1}  # one timeline row per pipeline rank
    pytest.importorskip("matplotlib")
    assert (tmp_path / "sub" / "prt.png").stat().st_size > 0


EXAMPLE = pathlib.Path(__file__).parents[2] / "examples" / "megatron_gpt.py"


def test_megatron_example_trains_under_torchrun():
    """The README's megatron-core example: flags -> validate_args -> install -> training."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
        str(EXAMPLE), "--pipeline-model-parallel-size", "2", "--pipeline-reuse", "2",
        "--pipeline-reuse-placement", "wave", "--pipeline-reuse-direction", "bi",
        "--train-iters", "4",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    runs = [subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)
            for _ in range(2)]  # fmt: skip
    proc = runs[0]
    assert proc.returncode == 0, proc.stderr[-3000:]
    # teardown ended every group ([Note: the default group must end with destroy_process_group])
    assert "outlived destroy_process_group" not in proc.stderr, proc.stderr[-3000:]
    losses = [float(line.split()[4]) for line in proc.stdout.splitlines() if "lm loss" in line]
    assert len(losses) == 4 and losses[-1] < losses[0]
    again = [float(line.split()[4]) for line in runs[1].stdout.splitlines() if "lm loss" in line]
    assert again == losses  # seeded: the CPU initialization was unseeded, each run its own
    (layout,) = [line for line in proc.stdout.splitlines() if line.startswith("schedule ")]
    assert layout.startswith("schedule PRT R=2 wave/bi; 4 stages on 2 ranks, layers 2,2,2,2;")


@pytest.mark.slow  # two launches, one of 4 ranks
def test_megatron_example_prints_the_global_batch_loss_under_data_parallelism():
    """It printed data-parallel rank 0's share of the batch: under DP 2, 4.909880 where the
    global batch's loss was 4.902888. The same global batch on one data-parallel rank (the
    weights depend on the pipeline rank alone) gives the same loss."""

    def first_loss(ranks: str) -> float:
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", ranks,
            "--standalone", str(EXAMPLE), "--pipeline-model-parallel-size", "2",
            "--pipeline-reuse", "2", "--train-iters", "1",
        ]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)
        assert proc.returncode == 0, proc.stderr[-3000:]
        (line,) = [line for line in proc.stdout.splitlines() if "lm loss" in line]
        return float(line.split()[4])

    assert first_loss("4") == pytest.approx(first_loss("2"), rel=1e-6, abs=0)


@pytest.mark.parametrize(
    "flags, world, message",
    [
        (["--pipeline-reuse", "5"], "2", "cannot fill D = R*P = 10 stages"),
        ([], "2", "megatron's own pipeline schedule needs CUDA p2p"),  # was a CUDA traceback
        (["--pipeline-reuse", "2", "--global-batch-size", "3"], "2",
         "--global-batch-size 3 is not a multiple"),  # was cut to one micro-batch
        (["--pipeline-reuse", "2"], "1", "1 process(es) do not divide"),  # no torchrun
    ],
)  # fmt: skip
def test_megatron_example_refuses_impossible_flags_in_one_line(flags, world, message):
    cmd = [sys.executable, str(EXAMPLE), "--pipeline-model-parallel-size", "2", *flags]
    env = {**os.environ, "WORLD_SIZE": world}  # as torchrun would set it; no process starts
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2
    assert message in proc.stderr.splitlines()[-1]


def _built(rank, world, reuse):
    """What build_training leaves behind on this rank, as plain data."""
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.optimizer import OptimizerConfig

    from megatron_prt.megatron.model import transformer_config_kwargs
    from megatron_prt.megatron.training import build_training

    setup_megatron(reuse.placement.ranks, reuse.placement.chunks_per_rank)
    config = transformer_config(dtype=torch.float32, **transformer_config_kwargs(reuse))
    model = model_chunks("gpt", config, reuse)
    training = build_training(
        model, config, optimizer_config=OptimizerConfig(optimizer="adam", lr=1e-3), reuse=reuse
    )
    chunks = training.chunks
    optimized = {id(p) for group in training.optimizer.param_groups for p in group["params"]}
    placement = reuse.placement
    replicas = [c for c, stage in zip(chunks, placement.rank_stages[rank], strict=True)
                if placement.pipeline_of(stage) == 1]  # fmt: skip
    return {
        "ddp": all(isinstance(chunk, DistributedDataParallel) for chunk in chunks),
        # without overlap_grad_reduce finalize reduces each buffer once: no per-chunk hooks
        "no_sync": config.no_sync_func is None,
        "grad_sync": config.grad_sync_func is None,
        "finalize": config.finalize_model_grads_func is not None,
        "optimizer_sees_wrapped": optimized == {id(p) for c in chunks for p in c.parameters()},
        "same_config": training.config is config,
        "replicas_shared": bool(replicas)
        and all(getattr(p, "shared", False) for c in replicas for p in c.parameters()),
    }


def _pipelines_left(rank, world):
    """MegatronPipelines alive after training through the installed schedule, before and
    after teardown, and whether the process group is still up."""
    import gc

    from megatron.core import pipeline_parallel
    from megatron.core.optimizer import OptimizerConfig

    from megatron_prt.megatron import install, teardown
    from megatron_prt.megatron.model import transformer_config_kwargs
    from megatron_prt.megatron.schedule import MegatronPipeline
    from megatron_prt.megatron.training import build_training

    reuse = ReuseConfig(Placement(2, 2, "wave", "bi"), LAYERS_TRAIN)
    setup_megatron(2, reuse.placement.chunks_per_rank)
    config = transformer_config(dtype=torch.float32, **transformer_config_kwargs(reuse))
    model = model_chunks("gpt", config, reuse)
    optimizer_config = OptimizerConfig(optimizer="adam", lr=1e-3)
    model = build_training(model, config, optimizer_config=optimizer_config, reuse=reuse).chunks
    install(reuse)
    pipeline_parallel.get_forward_backward_func()(**step_kwargs("gpt", model, M))
    del model
    gc.collect()
    before = sum(isinstance(o, MegatronPipeline) for o in gc.get_objects())
    dist.barrier()
    teardown()
    after = sum(isinstance(o, MegatronPipeline) for o in gc.get_objects())
    return before, after, dist.is_initialized()


def test_teardown_lets_go_of_the_installed_runtimes_and_every_group():
    # [Note: the default group must end with destroy_process_group]: the installed schedule
    # kept its runtimes (the model, its DDP, their gloo groups) alive into interpreter
    # shutdown, some 50 gloo threads per rank of a 2-rank pretrain_bert
    for before, after, initialized in all_ok(run_local(2, _pipelines_left)):
        assert before >= 1 and after == 0 and not initialized


def test_build_training_wraps_prepares_hooks_and_optimizes_every_chunk():
    """The builder's contract: DDP chunks, per-chunk sync hooks and finalize on the config,
    the optimizer over exactly the wrapped parameters, bi replicas prepared."""
    reuse = ReuseConfig(Placement(2, 1, "loop", "bi"), 4)
    for result in all_ok(run_local(2, _built, reuse)):
        assert all(result.values()), result
