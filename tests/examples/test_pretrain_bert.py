"""examples/pretrain_bert.py and examples/demo.py: BERT pretraining with PRT under torchrun.

* End to end on 2 CPU ranks with the embedded corpus (prepared once into a temporary cache):
  PRT wave R=2 trains with finite, decreasing loss, reports a measured bubble and per-rank
  activation memory, and writes the first iteration's timeline; PRT bi R=2 runs too.
* A run stopped at iteration 3 (checkpoint) and resumed gives exactly the numbers of the
  uninterrupted run (fp32 on CPU, dropout on: RNG states are part of the checkpoint); a
  checkpoint saved under R=2 wave resumes under R=1 with the uninterrupted run's numbers.
* Unsupported flags stop before anything starts: exit status 2 and one line on stderr.
"""

from __future__ import annotations

import hashlib
import importlib.util
import itertools
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_prt.megatron import bert_args, checkpoint
from megatron_prt.megatron.bert_step import MicroBatchSampler
from megatron_prt.megatron.pipeline_probe import PipelineProbe, measured_bubble, predicted_bubble

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "pretrain_bert.py"
# A tiny BERT: a launch takes about 15 s on 2 cores, most of it imports.
TINY = (
    "--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 32 "
    "--micro-batch-size 2 --global-batch-size 8 --lr 3e-3 --log-interval 1 --eval-iters 1"
).split()
WAVE = ["--pipeline-reuse", "2", "--pipeline-reuse-placement", "wave"]
BI = ["--pipeline-reuse", "2", "--pipeline-reuse-direction", "bi"]
LINE = re.compile(
    r"iteration +(\d+)/\d+ \| lm loss (\S+) \| sop loss (\S+) \| lr (\S+) \| grad norm (\S+)"
)


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    return module


pretrain_bert = _load("pretrain_bert")  # the entry point: its flags and refusals
demo = _load("demo")  # examples/demo.py: summaries and the comparison table


def launch(*flags: str, ranks: int = 2) -> str:
    """Run the example under torchrun on CPU; its output (stdout and stderr)."""
    status, output = run_example(*flags, ranks=ranks)
    assert status == 0, output[-4000:]
    # teardown ended every group ([Note: the default group must end with destroy_process_group])
    assert "outlived destroy_process_group" not in output, output[-4000:]
    return output


def run_example(*flags: str, ranks: int = 2) -> tuple[int, str]:
    """``(exit status, stdout and stderr)`` of the example under torchrun on CPU."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", str(ranks), str(EXAMPLE), *TINY, *flags]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    return done.returncode, done.stdout + done.stderr


def progress(output: str) -> list[tuple]:
    """(iteration, lm loss, sop loss, lr, grad norm) of every progress line, as printed."""
    return [match.groups() for match in LINE.finditer(output)]


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory):
    pytest.importorskip("megatron.core")
    return str(tmp_path_factory.mktemp("bert_cache"))


@pytest.fixture(scope="module")
def wave_run(data_cache, tmp_path_factory):
    trace = tmp_path_factory.mktemp("trace") / "wave"
    flags = ["--pipeline-model-parallel-size", "2", *WAVE, "--data-cache-path", data_cache]
    flags += ["--train-iters", "8", "--eval-interval", "4", "--pipeline-reuse-trace", str(trace)]
    return launch(*flags), trace


def bi_flags(data_cache: str, *extra: str) -> list[str]:
    flags = ["--pipeline-model-parallel-size", "2", *BI, "--data-cache-path", data_cache]
    return [*flags, "--train-iters", "6", "--eval-interval", "3", *extra]


@pytest.fixture(scope="module")
def bi_run(data_cache):
    return launch(*bi_flags(data_cache))


# ------------------------------------------------------------------------------ end to end


def test_wave_trains_with_decreasing_loss_and_measures_the_pipeline(wave_run):
    output, trace = wave_run
    lines = progress(output)
    assert [int(line[0]) for line in lines] == list(range(1, 9))
    lm = [float(line[1]) for line in lines]
    assert all(math.isfinite(x) for x in lm)
    assert sum(lm[-3:]) / 3 < sum(lm[:3]) / 3 - 0.05, lm
    valid = re.findall(r"validation at iteration \d+: lm loss (\S+)", output)
    assert len(valid) == 2 and float(valid[1]) < float(valid[0])
    summary = demo.summary_of(output.splitlines())
    assert summary["schedule"] == "PRT R=2 wave/uni" and summary["iteration"] == 8
    assert summary["stage_layers"] == [1, 1, 1, 1] and summary["split_backward"] is False
    assert summary["recompute"] == "none" and "recomputation none;" in output  # were left out
    assert summary["transformer_impl"] == "local" and "local layers, recomputation" in output
    assert 0.0 <= summary["bubble"] < 1.0 and summary["predicted_bubble"] > 0
    assert len(summary["peak_activation_bytes"]) == 2
    assert all(b > 0 for b in summary["peak_activation_bytes"])
    assert summary["trace"] == [f"{trace}.json", f"{trace}.png"]
    assert Path(f"{trace}.json").is_file() and Path(f"{trace}.png").is_file()
    assert f"timeline of iteration 1: {trace}.json, {trace}.png" in output


def test_default_corpus_cache_is_named_by_the_tokenizer_kind(wave_run, data_cache):
    version = f"py{sys.version_info.major}.{sys.version_info.minor}"
    folder = Path(data_cache) / f"bert-pydoc-{version}-sentencepiece"
    assert (folder / "prepared.json").is_file() and (folder / "tokenizer.model").is_file()
    assert f"tokenizer {folder}/tokenizer.model" in wave_run[0]


def test_bi_trains(bi_run):
    lines = progress(bi_run)
    assert [int(line[0]) for line in lines] == list(range(1, 7))
    assert all(math.isfinite(float(line[1])) for line in lines)
    summary = demo.summary_of(bi_run.splitlines())
    assert summary["schedule"] == "PRT R=2 loop/bi" and summary["num_microbatches"] == 4


def test_resumed_run_equals_uninterrupted_run(bi_run, data_cache, tmp_path):
    save = str(tmp_path / "ckpt")
    first = launch(*bi_flags(data_cache, "--save", save, "--save-interval", "3",
                             "--exit-interval", "3"))  # fmt: skip
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "3"
    names = {p.name for p in (tmp_path / "ckpt" / "iter_0000003").iterdir()}
    assert {"metadata.json", ".metadata"} <= names  # torch_dist
    resumed = launch(*bi_flags(data_cache, "--load", save))
    assert "resumed from" in resumed
    # megatron-core's calls of deprecated torch APIs, twice per rank (nothing to act on)
    assert not any(text in resumed for text in checkpoint.TORCH_DEPRECATIONS)
    full = progress(bi_run)
    assert progress(first) == full[:3]
    assert progress(resumed) == full[3:]
    want, got = demo.summary_of(bi_run.splitlines()), demo.summary_of(resumed.splitlines())
    for key in ("lm_loss", "sop_loss", "valid", "iteration"):
        assert got[key] == want[key], key


def test_auto_resumed_after_its_pick_continues_the_run_exactly(data_cache, tmp_path):
    """[Note: auto's pick is resumed] in megatron_prt/megatron/auto.py: with dropout on and
    R = 2 a resumed auto run profiled again, other plans drawing other masks."""
    flags = ["--pipeline-model-parallel-size", "2", "--pipeline-reuse", "auto:2",
             "--pipeline-reuse-auto-candidates", "1", "--data-cache-path", data_cache,
             "--train-iters", "6", "--eval-interval", "3"]  # fmt: skip
    save = tmp_path / "ckpt"
    whole = launch(*flags, "--save", str(save), "--save-interval", "4")
    (save / "latest").write_text("4\n")  # auto switched after iteration 3
    resumed = launch(*flags, "--load", str(save))
    assert "iter_0000004's pick" in resumed and "profiling nothing" in resumed, resumed[-3000:]
    assert progress(resumed) == progress(whole)[4:]


def test_checkpoint_resumes_under_another_layout(data_cache, tmp_path):
    # No dropout: the RNG streams of R=2 wave's chunks do not map onto R=1's.
    flags = ["--pipeline-model-parallel-size", "2", "--data-cache-path", data_cache,
             "--train-iters", "6", "--eval-interval", "3",
             "--hidden-dropout", "0", "--attention-dropout", "0"]  # fmt: skip
    save = tmp_path / "ckpt"
    whole = launch(*flags, *WAVE, "--save", str(save), "--save-interval", "3")
    (save / "latest").write_text("3\n")  # resume from iteration 3's checkpoint, not 6's
    resumed = launch(*flags, "--pipeline-reuse", "1", "--load", str(save))
    assert "resumed from" in resumed and "iter_0000003" in resumed
    assert "PRT R=1 (1F1B)" in resumed
    assert progress(resumed) == progress(whole)[3:]
    want, got = demo.summary_of(whole.splitlines()), demo.summary_of(resumed.splitlines())
    for key in ("lm_loss", "sop_loss", "valid", "iteration"):
        assert got[key] == want[key], key


def test_distributed_optimizer_overlap_and_recompute_give_the_same_losses(data_cache):
    """Megatron-LM's production flags reach megatron-core (they were unrecognized): with
    the distributed optimizer sharding Adam over DP 2, overlapped reduction and full
    recomputation the losses are the plain run's (fp32; dropout off: recomputation redraws
    no masks then)."""
    flags = ["--pipeline-model-parallel-size", "2", *BI, "--data-cache-path", data_cache,
             "--train-iters", "3", "--hidden-dropout", "0", "--attention-dropout", "0"]  # fmt: skip
    plain = progress(launch(*flags, ranks=4))
    more = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--recompute-granularity",
            "full", "--recompute-method", "uniform"]  # fmt: skip
    production = progress(launch(*flags, *more, ranks=4))
    assert len(plain) == 3 and len(production) == 3
    for ours, theirs in zip(production, plain, strict=True):
        assert abs(float(ours[1]) / float(theirs[1]) - 1) < 1e-6, (ours, theirs)


def test_a_plan_tuned_for_another_vocabulary_is_said_at_the_start(data_cache, tmp_path):
    """pretrain_bert trained a plan tuned on costs of a 30,592-token head under its own
    tokenizer without a word (the flags' check runs before the tokenizer is built)."""
    from megatron_prt.core.placement import Placement
    from megatron_prt.core.schedules import build_plan
    from megatron_prt.tune.plan_file import PlanFile

    path = str(tmp_path / "plan.json")  # TINY: 4 layers, 8 // 2 = 4 micro-batches
    tuned = {"model": {"vocab_size": 30592}}
    PlanFile(build_plan(Placement(2, 2, "wave", "uni"), 4), (1, 1, 1, 1), tuned).write(path)
    flags = ["--pipeline-model-parallel-size", "2", "--pipeline-reuse-plan", path]
    output = launch(*flags, "--data-cache-path", data_cache, "--train-iters", "1")
    said = re.findall(r"tuned for a vocabulary of 30592 tokens, but the tokenizer has \d+", output)
    assert len(said) == 1, output[-4000:]  # once: the first rank alone


def test_nan_loss_stops_every_rank_naming_the_iteration(data_cache):
    # lr 1e6: iteration 1 is finite, its step overflows the weights, iteration 2's loss is NaN
    flags = ["--pipeline-model-parallel-size", "2", *WAVE, "--data-cache-path", data_cache]
    status, output = run_example(*flags, "--train-iters", "4", "--lr", "1e6")
    assert status != 0, output[-4000:]
    assert "pretrain_bert.py: error: iteration 2: lm loss nan" in output
    assert "--no-stop-on-nan" in output
    assert [int(line[0]) for line in progress(output)] == [1]
    assert "SUMMARY" not in output


def test_no_stop_on_nan_trains_on(data_cache):
    flags = ["--data-cache-path", data_cache, "--train-iters", "3", "--lr", "1e6"]
    output = launch(*flags, "--no-stop-on-nan", ranks=1)
    lm = [line[1] for line in progress(output)]
    assert len(lm) == 3 and lm[1:] == ["NAN", "NAN"]
    assert "SUMMARY" in output


@pytest.fixture(scope="module")
def two_checkpoints(data_cache, tmp_path_factory):
    """A --save directory with the checkpoints of iterations 2 and 4 (latest: 4)."""
    save = tmp_path_factory.mktemp("two") / "ckpt"
    launch(*bi_flags(data_cache, "--save", str(save), "--save-interval", "2",
                     "--exit-interval", "4"))  # fmt: skip
    assert (save / "latest").read_text().strip() == "4"
    return save


def _copy(directory: Path, tmp_path: Path) -> Path:
    import shutil

    return Path(shutil.copytree(directory, tmp_path / "ckpt"))


def test_incomplete_checkpoint_stops_every_rank(two_checkpoints, data_cache, tmp_path):
    save = _copy(two_checkpoints, tmp_path)
    (save / "iter_0000004" / ".metadata").unlink()  # torch's index of the tensors
    status, output = run_example(*bi_flags(data_cache, "--load", str(save)))
    assert status != 0, output[-3000:]
    for rank in (0, 1):
        assert f"rank {rank}: --load {save}: {save}/iter_0000004 is missing or incomplete" in output
    assert f"echo 2 > {save}/latest" in output  # the fix: the earlier complete checkpoint
    assert "iteration      5/6" not in output


class _RunsCode:
    """A pickled object that runs ``print`` when unpickled without ``weights_only``."""

    def __reduce__(self):
        return (print, ("unpickling ran code",))


def test_truncated_or_unsafe_files_are_refused_naming_the_folder(two_checkpoints, data_cache,
                                                                 tmp_path):  # fmt: skip
    import torch

    save = _copy(two_checkpoints, tmp_path)
    folder = save / "iter_0000004"
    torch.save({"extra": _RunsCode()}, folder / "common.pt")
    status, output = run_example(*bi_flags(data_cache, "--load", str(save)))
    assert status != 0
    assert f"rank 0: cannot read {folder}" in output, output[-3000:]
    assert "unpickling ran code" not in output  # torch.load(weights_only=True)
    assert f"iteration(s) 2; to resume from 2: echo 2 > {save}/latest" in output

    save = _copy(two_checkpoints, tmp_path / "truncated")
    for shard in (save / "iter_0000004").glob("*.distcp"):
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    status, output = run_example(*bi_flags(data_cache, "--load", str(save)))
    assert status != 0
    assert f"cannot load {save}/iter_0000004" in output, output[-3000:]
    assert "(CheckpointException" not in output  # the failing rank's own error, not the wrapper
    assert f"echo 2 > {save}/latest" in output
    assert "iteration      5/6" not in output


def test_another_model_is_refused_naming_the_flags_or_the_tensors(two_checkpoints, data_cache,
                                                                   tmp_path):  # fmt: skip
    """A checkpoint of the model with the binary head, loaded without it, used to resume
    with the head's tensors dropped (megatron's load skips tensors nobody asks for)."""
    import torch
    from megatron.core import dist_checkpointing

    status, output = run_example(*bi_flags(data_cache, "--load", str(two_checkpoints),
                                           "--bert-no-binary-head"))  # fmt: skip
    assert status != 0, output[-3000:]
    assert "holds another model (the binary head there, --bert-no-binary-head here)" in output
    # a checkpoint without the record: the tensors themselves are compared
    save = _copy(two_checkpoints, tmp_path)
    folder = save / "iter_0000004"
    state = dist_checkpointing.load_common_state_dict(str(folder))
    del state["extra"]["model"]
    torch.save(state, folder / "common.pt")  # megatron-core reads a common.pt first
    status, output = run_example(*bi_flags(data_cache, "--load", str(save),
                                           "--bert-no-binary-head"))  # fmt: skip
    assert status != 0, output[-3000:]
    assert "tensor(s) this model lacks (" in output and "binary_head" in output, output[-3000:]
    assert "it was saved from another model" in output
    assert "iteration      5/6" not in output


def test_the_vocabulary_is_recorded_and_another_padding_refused(two_checkpoints, data_cache):
    """megatron-core loads the embedding and output layer with allow_shape_mismatch: a
    resume at another padding cut or zero-filled their rows without a word."""
    from megatron.core import dist_checkpointing

    folder = str(two_checkpoints / "iter_0000004")
    model = dist_checkpointing.load_common_state_dict(folder)["extra"]["model"]
    assert model["padded_vocab_size"] % 128 == 0 and model["make_vocab_size_divisible_by"] == 128
    assert 0 <= model["padded_vocab_size"] - model["vocab_size"] < 128
    status, output = run_example(*bi_flags(data_cache, "--load", str(two_checkpoints),
                                           "--make-vocab-size-divisible-by", "1000"))  # fmt: skip
    assert status != 0, output[-3000:]
    assert f"the vocabulary padded to {model['padded_vocab_size']} rows there" in output
    assert "give --make-vocab-size-divisible-by 128" in output


@pytest.mark.slow  # the record's check, as the binary head's case above
def test_other_attention_heads_are_refused_naming_the_flag(two_checkpoints, data_cache):
    status, output = run_example(*bi_flags(data_cache, "--load", str(two_checkpoints),
                                           "--num-attention-heads", "8"))  # fmt: skip
    assert status != 0 and "--num-attention-heads 4 there, 8 here" in output, output[-3000:]


def test_changed_schedule_on_resume_is_refused_naming_the_flags(two_checkpoints, data_cache):
    status, output = run_example(*bi_flags(data_cache, "--load", str(two_checkpoints),
                                           "--lr", "1e-3"))  # fmt: skip
    assert status != 0
    # megatron-core 0.16: its scheduler refuses; 0.19 already refuses the optimizer's groups
    scheduler = f"rank 0: {two_checkpoints}/iter_0000004: OptimizerParamScheduler" in output
    groups = f"rank 0: {two_checkpoints}/iter_0000004: the optimizer's parameter groups" in output
    assert scheduler or groups, output[-3000:]
    assert "--use-checkpoint-opt_param-scheduler" in output if scheduler else "--lr" in output
    assert "iteration      5/6" not in output


def test_another_data_order_on_resume_is_refused_unless_allowed(two_checkpoints, data_cache):
    """megatron shuffles every mapped pass over the data together: a resumed run with another
    --seed, or a --train-iters that maps more passes, read the saved position in another
    order (samples repeated and skipped) without a word ([Note: the data order on resume])."""
    load = ("--load", str(two_checkpoints))
    status, output = run_example(*bi_flags(data_cache, *load, "--seed", "99"))
    assert status != 0 and "--seed 1234 there, 99 here" in output, output[-3000:]
    assert "--allow-new-data-order" in output and "iteration      5/6" not in output
    longer = ("--train-iters", "4000", "--use-checkpoint-opt_param-scheduler")
    status, output = run_example(*bi_flags(data_cache, *load), *longer)
    assert status != 0 and "--train-iters 4000 x --global-batch-size 8 maps" in output, output
    allowed = ("--seed", "99", "--allow-new-data-order", "--exit-interval", "5")
    output = launch(*bi_flags(data_cache, *load, *allowed))
    assert "resumed from" in output and "iteration      5/6" in output, output[-3000:]


# -------------------------------------------------------------------------------- refusals


def test_refused_flag_exits_2_with_one_line():
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), "--tensor-model-parallel-size", "2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert done.stdout == ""
    assert len(done.stderr.splitlines()) == 1, done.stderr
    # one rank cannot hold two tensor-parallel shards
    assert "--tensor-model-parallel-size 2 x --pipeline-model-parallel-size 1 must " in done.stderr
    assert "divide the number of ranks (1)" in done.stderr


FULL_RECOMPUTE = ["--recompute-granularity", "full", "--recompute-method", "uniform"]


@pytest.mark.parametrize(
    ("flags", "world", "message"),
    [
        (["--fp16"], 1, "--fp16 needs --device cuda"),
        (["--bf16"], 1, "--bf16 needs --device cuda"),
        (["--transformer-impl", "transformer_engine"], 1, "transformer_engine needs --device cuda"),
        (["--pipeline-model-parallel-size", "2"], 2, "--pipeline-reuse 1 for 1F1B"),
        (["--pipeline-reuse", "2"], 1, "--pipeline-reuse needs a pipeline"),
        (["--global-batch-size", "7"], 1, "--global-batch-size 7 must be a positive multiple"),
        (["--save-interval", "5"], 1, "--save-interval needs --save"),
        (["--make-vocab-size-divisible-by", "0"], 1, "--make-vocab-size-divisible-by must be >= 1"),
        (["--sequence-parallel"], 1, "--sequence-parallel needs --tensor-model-parallel-size > 1"),
        (  # were megatron tracebacks at the model's build and the first forward
            ["--tensor-model-parallel-size", "2", "--ffn-hidden-size", "33"],
            2,
            "--ffn-hidden-size 33 must be a multiple of --tensor-model-parallel-size 2",
        ),
        (
            ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--seq-length", "33"],
            2,
            "--seq-length 33 must be a multiple of --tensor-model-parallel-size 2 under",
        ),
        (["--recompute-granularity", "full"], 1, "needs --recompute-method uniform or block"),
        (["--recompute-method", "block"], 1, "--recompute-method needs --recompute-granularity"),
        ([*FULL_RECOMPUTE, "--recompute-num-layers", "0"], 1, "must be >= 1, got 0"),  # was 1
        (["--recompute-num-layers", "2"], 1, "--recompute-num-layers needs"),  # was ignored
        (["--use-distributed-optimizer", "--save", "ck"], 1, "needs Transformer Engine or apex"),
        (["--save", "/dev/null/x"], 1, "--save /dev/null/x: not a folder"),  # was at 1st save
        (["--save", str(Path(__file__))], 1, "not a folder that can be created or written"),
        (["--lr-decay-style", "exp"], 1, "invalid choice: 'exp'"),
        (["--data-path", "x"], 1, "--data-path needs --tokenizer-model or --vocab-file"),
        (
            ["--tokenizer-type", "BertWordPieceLowerCase", "--tokenizer-model", "m"],
            1,
            "--tokenizer-type BertWordPieceLowerCase reads --vocab-file, not --tokenizer-model",
        ),
        (["--tokenizer-type", "Foo"], 1, "invalid choice: 'Foo'"),
        (
            ["--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "2"],
            1,
            "--lr-warmup-fraction or --lr-warmup-iters, not both",
        ),
    ],
)
def test_refusals_are_one_line(flags, world, message, monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit) as stop:
        pretrain_bert.parse_args(flags)
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and message in err, err


def test_a_gpu_without_fused_adam_refuses_resumable_distributed_optimizer(monkeypatch, capsys):
    """On a GPU without Transformer Engine or apex megatron-core's distributed optimizer runs
    torch's Adam too, whose sharded state its loader refuses on every resume (a bare
    AssertionError, reported as a damaged checkpoint); the refusal looked at the device."""
    from megatron.core.optimizer import distrib_optimizer

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(distrib_optimizer, "HAVE_APEX_OR_TE", False)
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit):
        pretrain_bert.parse_args(
            ["--device", "cuda", "--use-distributed-optimizer", "--load", "ck"]
        )
    assert "needs Transformer Engine or apex" in capsys.readouterr().err
    monkeypatch.setattr(distrib_optimizer, "HAVE_APEX_OR_TE", True)
    assert pretrain_bert.parse_args(["--device", "cuda", "--use-distributed-optimizer"]).device


def test_transformer_engine_without_transformer_engine_is_refused():
    """pretrain_bert built local layers whatever the device: a GPU run could not ask for
    Transformer Engine's. Without it installed the flag is refused before megatron imports it."""
    import argparse

    from megatron_prt.megatron.bert_args import _transformer_engine_problems

    args = argparse.Namespace(device="cuda", transformer_impl="transformer_engine")
    problems = list(_transformer_engine_problems(args))
    if importlib.util.find_spec("transformer_engine") is not None:
        assert problems == []
    else:
        assert len(problems) == 1 and "Transformer Engine is not installed" in problems[0]
    local = argparse.Namespace(device="cpu", transformer_impl="local")
    assert list(_transformer_engine_problems(local)) == []


def test_a_plan_file_alone_implies_pipeline_reuse_on_cpu(tmp_path, monkeypatch):
    """Was: ``--pipeline-reuse-plan FILE`` without ``--pipeline-reuse`` refused on CPU as
    megatron's own CUDA-only schedule, though the plan file implies PRT."""
    from megatron_prt.core.placement import Placement
    from megatron_prt.core.schedules import build_plan
    from megatron_prt.tune.plan_file import PlanFile

    path = str(tmp_path / "plan.json")  # TINY: 4 layers, 8 // 2 = 4 micro-batches
    tuned = {"bubble_fraction": 0.072}  # what tune predicted under its costs
    PlanFile(build_plan(Placement(2, 1, "loop", "bi"), 4), (3, 1), tuned).write(path)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("RANK", raising=False)
    flags = [*TINY, "--pipeline-model-parallel-size", "2", "--pipeline-reuse-plan", path]
    args = pretrain_bert.parse_args(flags)
    placement = args.reuse.placement
    assert (placement.reuse, placement.direction) == (1, "bi")
    assert args.reuse.tuned_bubble == 0.072  # SUMMARY's tuned_bubble, beside the uniform one


def test_tensorboard_without_the_package_is_refused(monkeypatch, capsys):
    monkeypatch.setattr(bert_args, "_tensorboard_available", lambda: False)
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(SystemExit):
        pretrain_bert.parse_args(["--tensorboard-dir", "tb"])
    assert "pip install tensorboard" in capsys.readouterr().err


def test_help_names_the_1f1b_baseline(capsys):
    with pytest.raises(SystemExit):
        pretrain_bert.parse_args(["--help"])
    out = capsys.readouterr().out
    assert "--pipeline-reuse 1 (PRT's 1F1B-equivalent plan)" in out
    assert "--tokenizer-type" in out and "--tokenizer-model" in out
    assert "WordPiece vocab.txt" not in out  # --vocab-file is BertWordPiece*'s, not the default


def test_unloadable_tokenizer_is_one_line_and_exit_2(tmp_path):
    bogus = tmp_path / "bogus.model"
    bogus.write_text("not a SentencePiece model")
    cache = ["--data-cache-path", str(tmp_path / "cache")]
    command = [sys.executable, str(EXAMPLE), *TINY, *cache, "--tokenizer-model", str(bogus)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 2, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if "error" in line.lower()]
    digest = hashlib.md5(bogus.read_bytes(), usedforsecurity=False).hexdigest()[:12]
    assert errors == [f"pretrain_bert.py: error: {tmp_path}/cache/bert-pydoc-py"
                      f"{sys.version_info.major}.{sys.version_info.minor}-SentencePieceTokenizer-"
                      f"bogus-{digest}/tokenizer.model is not a SentencePiece model (INTERNAL: "
                      f"could not parse ModelProto from {errors[0].split(' from ')[-1]}"
                      ], errors  # fmt: skip
    assert "Traceback" not in done.stderr


# ------------------------------------------------------------------------------ pure parts


class _Optimizer:
    """What megatron's OptimizerParamScheduler reads and writes of an optimizer."""

    def __init__(self) -> None:
        self.param_groups = [{"lr": None, "weight_decay": None}]


def _scheduler(flags, monkeypatch):
    from megatron_prt.megatron.bert_setup import scheduler

    monkeypatch.setenv("WORLD_SIZE", "1")
    optimizer = _Optimizer()
    return scheduler(pretrain_bert.parse_args(flags), optimizer), optimizer


def test_scheduler_is_megatrons_with_megatron_lm_flags(monkeypatch):
    pytest.importorskip("megatron.core")
    flags = ["--lr", "1e-3", "--min-lr", "1e-5", "--train-iters", "10", "--global-batch-size",
             "8", "--lr-warmup-fraction", "0.2", "--lr-warmup-init", "1e-4",
             "--lr-decay-style", "cosine"]  # fmt: skip
    schedule, optimizer = _scheduler(flags, monkeypatch)
    lrs = [optimizer.param_groups[0]["lr"]]
    for _ in range(10):
        schedule.step(increment=8)  # one iteration: a global batch of samples
        lrs.append(optimizer.param_groups[0]["lr"])
    assert lrs[0] == pytest.approx(1e-4) and lrs[2] == pytest.approx(1e-3)  # 2 warm-up iters
    assert lrs[1] == pytest.approx(1e-4 + (1e-3 - 1e-4) / 2)
    assert lrs[-1] == pytest.approx(1e-5) and all(a >= b for a, b in itertools.pairwise(lrs[2:]))
    resumed, _ = _scheduler([*flags, "--use-checkpoint-opt_param-scheduler"], monkeypatch)
    resumed.load_state_dict(schedule.state_dict())
    assert resumed.num_steps == 80


class _Runtime:
    def __init__(self, plan, peak):
        self.plan, self.peak = plan, peak
        self.trace_enabled = self.measure_memory = False

    def memory_peak(self):
        return self.peak


class _ForwardBackward:
    def __init__(self):
        self.running, self.auto = None, type("Auto", (), {"done": False})()

    def pipeline(self):
        return self.running


def test_probe_measures_the_plan_auto_switched_to():
    """The probe kept the first runtime: after --pipeline-reuse auto switched plans, every
    log line and the summary gave the first plan's bubble and memory, and the predicted
    bubble was the flags' default plan's."""
    from megatron_prt.core import Placement, build_plan
    from megatron_prt.megatron.config import ReuseConfig

    reuse = ReuseConfig(Placement(2, 2), 4)
    first = _Runtime(build_plan(reuse.placement, 4), 1)
    tuned = _Runtime(build_plan(reuse.placement, 4, "zb"), 2)
    fb = _ForwardBackward()
    probe = PipelineProbe(fb)
    fb.running = first
    probe.after_iteration()  # auto profiles: its runtimes are left alone
    assert probe.runtime is None and not first.trace_enabled
    fb.running, fb.auto.done = tuned, True
    probe.after_iteration()
    assert probe.runtime is tuned and tuned.trace_enabled and tuned.measure_memory
    probe.after_iteration()
    assert probe.own_peak == 2 and not tuned.measure_memory
    want = predicted_bubble(reuse, 4, tuned.plan)
    assert want != predicted_bubble(reuse, 4)  # the zb plan, not the flags' default
    assert predicted_bubble(reuse, 4, probe.plan) == want


def test_measured_bubble_from_spans():
    # rank 0 busy 0..1 and 2..3, rank 1 busy 1..2: 3 of 2 x 3 seconds busy.
    spans = [[("a", 0.0, 1.0), ("b", 2.0, 3.0)], [("c", 1.0, 2.0)]]
    assert measured_bubble(spans) == pytest.approx(0.5)
    assert measured_bubble([[], []]) is None


def test_sampler_gives_each_data_parallel_rank_its_slice():
    dataset = [{"text": [i], "types": [0], "labels": [i], "loss_mask": [1],
                "padding_mask": [1], "is_random": i % 2} for i in range(10)]  # fmt: skip
    ranks = [MicroBatchSampler(dataset, 2, r, 2) for r in range(2)]
    batches = [s.next_global_batch(2) for s in ranks]
    texts = [[b["text"].flatten().tolist() for b in rank] for rank in batches]
    assert texts == [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]
    assert [s.consumed for s in ranks] == [8, 8]
    assert ranks[0].next_global_batch(1)[0]["text"].flatten().tolist() == [8, 9]
    assert ranks[1].next_global_batch(1)[0]["text"].flatten().tolist() == [0, 1]  # wraps


def test_compare_summaries_table():
    base = {"schedule": "PRT R=1 (1F1B)", "world_size": 4, "device": "cpu", "cpu_count": 2,
            "pipeline_model_parallel_size": 4, "data_parallel_size": 1, "num_microbatches": 8,
            "iteration": 30, "ms_per_iteration": 200.0, "bubble": 0.4, "predicted_bubble": 0.27,
            "peak_activation_bytes": [2**20, 2**19], "lm_loss": 6.0, "sop_loss": 0.7,
            "valid": {"lm loss": 5.9}, "trace": None}  # fmt: skip
    run = dict(base, schedule="PRT R=2 wave/uni", ms_per_iteration=160.0, bubble=0.2)
    table = demo.compare_summaries(run, base)
    assert re.search(r"speedup vs baseline +1\.250x +1\.000x", table)
    assert re.search(r"bubble, measured +20\.0% +40\.0%", table)
    assert "1.00 0.50" in table
    assert "time-share 2 CPU cores" in table
    assert json.loads(json.dumps(run)) == run  # summaries are plain JSON


def test_auto_switches_split_backward_plans_under_overlapped_grad_reduce(data_cache):
    """[Note: DDP's recorded gradient counts] in megatron_prt/megatron/training.py: megatron's
    DDP kept the first plan's count of W hooks after its release; the measured pick's next
    plan fired fewer and its reduction was never started (an assertion at iteration 4-5),
    or more and it started while a W still added to the gradients (replicas apart)."""
    flags = ["--pipeline-model-parallel-size", "2", "--pipeline-reuse", "auto:2"]
    flags += ["--pipeline-reuse-split-backward", "--overlap-grad-reduce"]
    output = launch(*flags, "--data-cache-path", data_cache, "--train-iters", "8")
    assert [int(line[0]) for line in progress(output)] == list(range(1, 9)), output[-3000:]


def test_the_default_corpus_folder_follows_the_tokenizer_files_content(tmp_path):
    """A folder prepared for one spm.model was reused for another file of the same name:
    the run trained with the first one's tokenizer and data."""
    first, second = tmp_path / "a" / "spm.model", tmp_path / "b" / "spm.model"
    for path, content in ((first, b"one"), (second, b"two")):
        path.parent.mkdir()
        path.write_bytes(content)
    names = {pretrain_bert._file_digest(str(path)) for path in (first, second)}
    assert len(names) == 2 and all(name.startswith("spm-") for name in names)
