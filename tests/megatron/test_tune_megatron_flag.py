"""``--pipeline-reuse-plan FILE``: the plan file's settings replace the other flags, and every
mismatch with the model or a conflicting flag is refused naming both and the fix."""

from __future__ import annotations

import warnings

import pytest
from megatron_flags import parse, refusal

from megatron_prt.core.placement import ConfigError, Placement
from megatron_prt.core.schedules import build_plan
from megatron_prt.megatron.args import validate_args
from megatron_prt.tune.plan_file import PlanFile, load_plan

# 8 ranks = DP 2 x PP 4, 10 layers, 8 // (1 * 2) = 4 micro-batches per iteration
MODEL = (
    "--num-layers",
    10,
    "--pipeline-model-parallel-size",
    4,
    "--micro-batch-size",
    1,
    "--global-batch-size",
    8,
)
STAGE_LAYERS = (2, 1, 1, 1, 1, 1, 1, 2)


def _write(tmp_path, placement: Placement, name: str) -> str:
    path = str(tmp_path / name)
    PlanFile(build_plan(placement, 4), STAGE_LAYERS).write(path)
    return path


@pytest.fixture
def wave_bi(tmp_path) -> str:
    return _write(tmp_path, Placement(4, 2, "wave", "bi"), "wave_bi.json")


def test_plan_file_sets_the_configuration(wave_bi):
    args = parse(*MODEL, "--pipeline-reuse-plan", wave_bi)
    config = validate_args(args)
    assert config.placement == Placement(4, 2, "wave", "bi")
    assert config.stage_layers == STAGE_LAYERS
    assert config.plan == build_plan(Placement(4, 2, "wave", "bi"), 4)
    assert args.pipeline_reuse == 2
    assert args.num_virtual_stages_per_pipeline_rank == 4  # two passes, two pipelines


def test_matching_flags_are_accepted(wave_bi):
    config = validate_args(
        parse(
            *MODEL,
            "--pipeline-reuse-plan",
            wave_bi,
            "--pipeline-reuse",
            2,
            "--pipeline-reuse-direction",
            "bi",
            "--pipeline-reuse-stage-layers",
            ",".join(map(str, STAGE_LAYERS)),
        )
    )
    assert config.plan is not None and config.stage_layers == STAGE_LAYERS


@pytest.mark.parametrize(
    "changed, expected",
    [
        (("--num-layers", 12), "splits 10 layers but --num-layers is 12"),
        (("--pipeline-model-parallel-size", 2), "--pipeline-model-parallel-size is 2"),
        (("--global-batch-size", 16), "schedules 4 micro-batches per iteration"),
    ],
)
def test_model_mismatches_are_refused(wave_bi, changed, expected):
    argv = list(MODEL)
    index = argv.index(changed[0])
    argv[index + 1] = changed[1]
    message = refusal(*argv, "--pipeline-reuse-plan", wave_bi)
    assert expected in message and f"--pipeline-reuse-plan {wave_bi}" in message


@pytest.mark.parametrize(
    "extra, flag",
    [
        (("--pipeline-reuse", 3), "--pipeline-reuse 3 conflicts"),
        (("--pipeline-reuse-stage-layers", "1,1,1,1,1,1,2,2"), "--pipeline-reuse-stage-layers"),
        (("--pipeline-reuse-partition", "balanced"), "--pipeline-reuse-partition balanced"),
        (("--pipeline-reuse-partition", "uniform"), "--pipeline-reuse-partition uniform"),
        (
            ("--pipeline-reuse-auto-candidates", 2),
            "auto-candidates 2 given with --pipeline-reuse-plan",
        ),
        (("--pipeline-reuse-costs", "costs.json"), "--pipeline-reuse-costs"),
        (("--pipeline-reuse-memory-budget", "1GiB"), "--pipeline-reuse-memory-budget"),
        (("--pipeline-reuse-split-backward",), "--pipeline-reuse-split-backward conflicts"),
    ],
)
def test_conflicting_flags_are_refused(wave_bi, extra, flag):
    message = refusal(*MODEL, "--pipeline-reuse-plan", wave_bi, *extra)
    assert flag in message and "drop" in message


def test_a_plan_tuned_under_other_recomputation_is_said(tmp_path):
    """The file did not record the recomputation tune priced: a run under other
    --recompute-* flags got another time and memory than predicted, without a word."""
    path = str(tmp_path / "tuned.json")
    tuned = {"recompute": ["full", "uniform", 1]}
    PlanFile(build_plan(Placement(4, 2), 4), STAGE_LAYERS, tuned).write(path)
    assert load_plan(path).recompute == ("full", "uniform", 1)
    with pytest.warns(UserWarning, match=r"tuned with recomputation full \(uniform, 1 layer"):
        validate_args(parse(*MODEL, "--pipeline-reuse-plan", path))
    recompute = ["--recompute-granularity", "full", "--recompute-method", "uniform"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same flags: nothing said
        validate_args(
            parse(*MODEL, "--pipeline-reuse-plan", path, *recompute, "--recompute-num-layers", 1)
        )


def test_recompute_blocks_the_file_split_cannot_hold_name_a_fix_that_runs(wave_bi):
    """The fix said --pipeline-reuse-stage-layers or --partition balanced, both refused
    beside a plan file."""
    recompute = ["--recompute-granularity", "full", "--recompute-method", "uniform"]
    message = refusal(*MODEL, "--pipeline-reuse-plan", wave_bi, *recompute,
                      "--recompute-num-layers", 2)  # fmt: skip
    assert "tune the plan file again with these --recompute-* flags" in message
    assert "--pipeline-reuse-stage-layers" not in message


@pytest.mark.parametrize(
    "extra, flag",
    [
        (("--pipeline-reuse-placement", "wave"), "--pipeline-reuse-placement wave conflicts"),
        (("--pipeline-reuse-direction", "bi"), "--pipeline-reuse-direction bi conflicts"),
    ],
)
def test_placement_and_direction_conflicts_are_refused(tmp_path, extra, flag):
    loop_uni = _write(tmp_path, Placement(4, 2), "loop_uni.json")
    assert flag in refusal(*MODEL, "--pipeline-reuse-plan", loop_uni, *extra)


@pytest.mark.parametrize(
    "extra, flag",
    [
        (("--pipeline-reuse-placement", "loop"), "--pipeline-reuse-placement loop conflicts"),
        (("--pipeline-reuse-direction", "uni"), "--pipeline-reuse-direction uni conflicts"),
    ],
)
def test_a_flag_given_as_its_default_conflicts_too(wave_bi, extra, flag):
    """loop and uni are the defaults: given, they still contradict a wave/bi file."""
    assert flag in refusal(*MODEL, "--pipeline-reuse-plan", wave_bi, *extra)


def test_unreadable_plan_file_is_refused(tmp_path):
    missing = tmp_path / "missing.json"
    message = refusal(*MODEL, "--pipeline-reuse-plan", missing)
    assert f"--pipeline-reuse-plan {missing}" in message and "megatron-prt tune" in message


@pytest.mark.parametrize(
    "which", ["winner", "best balanced plan for the costs without split backward"]
)
def test_megatron_runs_a_tuned_plan_file_with_parity(tmp_path, which):
    """megatron-core BERT on 2 ranks runs the file's plan (built for uneven costs, not the
    plan megatron-prt would build by default) and matches the non-pipelined model."""
    pytest.importorskip("megatron.core")
    from test_megatron_parity import LAYERS, M, _check
    from tune_costs import cost_dict

    from megatron_prt.sim.cost import CostModel
    from megatron_prt.tune.search_plans import tune

    tuned = tune(CostModel.from_dict(cost_dict(LAYERS)), 2, M, reuse_limit=2)
    chosen = tuned.winner
    if which != "winner":
        chosen = next(
            c
            for c in tuned.ranked
            if (c.partition, c.planned_for) == ("balanced", "costs") and not c.plan.split_backward
        )
    assert chosen.plan != build_plan(chosen.plan.placement, M, chosen.plan.schedule)
    path = str(tmp_path / "plan.json")
    PlanFile(chosen.plan, chosen.stage_layers).write(path)
    model = ("--num-layers", LAYERS, "--pipeline-model-parallel-size", 2)
    batches = ("--micro-batch-size", 1, "--global-batch-size", M)
    config = validate_args(parse(*model, *batches, "--pipeline-reuse-plan", path, world_size=2))
    assert config.plan == chosen.plan and config.stage_layers == chosen.stage_layers
    _check("bert", config)
    if which == "winner":  # evaluation with another count runs the default plan
        _check("bert", config, m=M + 1, forward_only=True)
        with pytest.raises(RuntimeError, match=f"--pipeline-reuse-plan schedules {M} micro"):
            _check("bert", config, m=M + 1)  # training with another count is refused


def test_recompute_activations_counts_as_selective(tmp_path):
    """Megatron-LM's --recompute-activations is selective recomputation (its own argument
    check turns it into that after ours ran): a plan tuned with selective ran without a
    word, one tuned without it warned falsely the other way round."""
    path = str(tmp_path / "selective.json")
    tuned = {"recompute": ["selective", None, None]}
    PlanFile(build_plan(Placement(4, 2), 4), STAGE_LAYERS, tuned).write(path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        validate_args(parse(*MODEL, "--pipeline-reuse-plan", path, "--recompute-activations"))


# what `megatron-prt profile` records (sim/model_shape.py) for a model MODEL's flags can run
SHAPE = {
    "model": "bert",
    "hidden_size": 64,
    "num_attention_heads": 4,
    "ffn_hidden_size": 256,
    "seq_length": 32,
    "micro_batch_size": 1,
    "vocab_size": 30592,
    "dtype": "float32",
    "transformer_impl": "local",
    "tensor_model_parallel_size": 1,
    "device": "cpu",
    "swiglu": False,
    "num_query_groups": 4,
    "untie_embeddings_and_output_weights": False,
}
SAME_SHAPE = ("--hidden-size", 64, "--num-attention-heads", 4, "--seq-length", 32)


@pytest.mark.parametrize(
    "other, said",
    [
        (("--hidden-size", 128), r"hidden_size 64 -> 128; ffn_hidden_size 256 -> 512"),
        (("--seq-length", 512), r"seq_length 32 -> 512"),
        (("--bf16",), r"dtype float32 -> bfloat16"),
        (("--transformer-impl", "transformer_engine"), r"transformer_impl local -> transformer_"),
        (("--ffn-hidden-size", 128), r"ffn_hidden_size 256 -> 128"),
        (("--swiglu", "--ffn-hidden-size", 256), r"swiglu False -> True"),
        (("--untie-embeddings-and-output-weights",), r"untie_embeddings_and_output_weights Fa"),
        (("--group-query-attention", "--num-query-groups", 2), r"num_query_groups 4 -> 2"),
    ],
)
def test_a_plan_tuned_for_another_model_shape_is_said(tmp_path, other, said):
    """Plan files did not record the model the costs were measured on: a plan tuned for
    seq 32 ran at seq 512 (another time and memory than predicted) without a word."""
    path = str(tmp_path / "tuned.json")
    PlanFile(build_plan(Placement(4, 2), 4), STAGE_LAYERS, {"model": SHAPE}).write(path)
    assert load_plan(path).model == SHAPE
    local = ("--transformer-impl", "local")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the shape profiled: nothing said
        validate_args(parse(*MODEL, "--pipeline-reuse-plan", path, *SAME_SHAPE, *local))
    argv = (*MODEL, "--pipeline-reuse-plan", path, *SAME_SHAPE, *local, *other)
    with pytest.warns(UserWarning, match=rf"another model shape \({said}.*profile this model"):
        validate_args(parse(*argv))


def test_a_plan_tuned_for_another_vocabulary_is_said_once_the_tokenizer_is_known(tmp_path):
    """The flags' shape check runs before megatron knows the vocabulary, so a plan tuned on
    costs of a 30,592-token head ran under a 64-token tokenizer without a word."""
    from megatron_prt.megatron.plan_flag import warn_other_vocabulary

    path = str(tmp_path / "tuned.json")
    PlanFile(build_plan(Placement(4, 2), 4), STAGE_LAYERS, {"model": SHAPE}).write(path)
    local = ("--transformer-impl", "local")
    config = validate_args(parse(*MODEL, "--pipeline-reuse-plan", path, *SAME_SHAPE, *local))
    assert config.recorded_vocab == ((f"--pipeline-reuse-plan {path} was tuned for", 30592),)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the tokenizer's size or its padded size: nothing said
        warn_other_vocabulary(config.recorded_vocab, 30522, 30592)
        warn_other_vocabulary(config.recorded_vocab, 30522, 30720)  # padded for TP 2
        warn_other_vocabulary(config.recorded_vocab, 30593, 30720)  # NullTokenizer: V + 1
    said = r"tuned for a vocabulary of 30592 tokens, but the tokenizer has 64 \(padded to 128\)"
    with pytest.warns(UserWarning, match=said + r".*--vocab-size 128"):
        warn_other_vocabulary(config.recorded_vocab, 64, 128)
    unshaped = _write(tmp_path, Placement(4, 2), "unshaped.json")
    assert validate_args(parse(*MODEL, "--pipeline-reuse-plan", unshaped)).recorded_vocab == ()


def test_balanced_costs_record_their_vocabulary_for_the_tokenizer_check(tmp_path):
    """A split balanced on a cost file profiled at another vocabulary was not said: the
    flags' check cannot know the tokenizer's size, so the file's is kept for it."""
    import json

    from test_megatron_args import BASE, _costs

    from megatron_prt.megatron.plan_flag import warn_other_vocabulary

    path = tmp_path / "shaped.json"
    path.write_text(json.dumps({**json.loads(open(_costs(tmp_path, 8)).read()),
                                "model": {"vocab_size": 30592}}))  # fmt: skip
    balanced = ("--pipeline-reuse", 2, "--pipeline-reuse-partition", "balanced")
    config = validate_args(parse(*BASE, *balanced, "--pipeline-reuse-costs", path))
    assert config.recorded_vocab == ((f"--pipeline-reuse-costs {path} was profiled on", 30592),)
    with pytest.warns(UserWarning, match=r"profiled on a vocabulary of 30592 tokens"):
        warn_other_vocabulary(config.recorded_vocab, 1000, 1024)


def test_the_shape_and_recompute_warnings_are_said_by_the_first_rank_alone(tmp_path, monkeypatch):
    """Flags are checked on every rank: a 64-rank launch printed each warning 64 times."""
    path = str(tmp_path / "tuned.json")
    tuned = {"model": SHAPE, "recompute": ["full", "uniform", 1]}
    PlanFile(build_plan(Placement(4, 2), 4), STAGE_LAYERS, tuned).write(path)
    argv = (*MODEL, "--pipeline-reuse-plan", path, "--seq-length", 512)
    for rank, said in [("1", 0), ("0", 2)]:
        monkeypatch.setenv("RANK", rank)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            validate_args(parse(*argv))
        messages = [str(w.message) for w in caught]
        assert len(messages) == said, messages
    assert "another model shape" in messages[1] and "recomputation" in messages[0]


def test_a_plan_profiled_on_one_tensor_rank_is_not_said_under_tensor_parallel(tmp_path):
    """profile measures one rank: a warning under TP 2 that no profile could clear."""
    path = str(tmp_path / "tuned.json")
    PlanFile(build_plan(Placement(4, 2), 4), STAGE_LAYERS, {"model": SHAPE}).write(path)
    argv = (*MODEL, "--pipeline-reuse-plan", path, *SAME_SHAPE, "--transformer-impl", "local")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        validate_args(parse(*argv, "--tensor-model-parallel-size", 2, world_size=16))


def test_a_malformed_model_shape_in_a_plan_file_is_refused(tmp_path):
    path = str(tmp_path / "tuned.json")
    shape = {**SHAPE, "hidden_size": "64"}
    PlanFile(build_plan(Placement(4, 2), 4), STAGE_LAYERS, {"model": shape}).write(path)
    with pytest.raises(ConfigError, match=r"tuned.model.hidden_size must be a positive integer"):
        load_plan(path)


def test_a_plan_tuned_for_another_model_kind_is_said_once_the_model_is_built(tmp_path):
    """A plan tuned on a BERT profile trained a GPT without a word: the flags do not say
    which model a script builds, so the first chunk built is compared."""
    from megatron_prt.megatron.plan_flag import warn_other_kind

    path = str(tmp_path / "tuned.json")
    PlanFile(build_plan(Placement(4, 2), 4), STAGE_LAYERS, {"model": SHAPE}).write(path)
    local = ("--transformer-impl", "local")
    config = validate_args(parse(*MODEL, "--pipeline-reuse-plan", path, *SAME_SHAPE, *local))
    assert config.recorded_kind == ((f"--pipeline-reuse-plan {path} was tuned for", "bert"),)
    GPTModel = type("GPTModel", (), {})  # noqa: N806 (megatron's class names are compared)
    BertModel = type("BertModel", (), {})  # noqa: N806
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_other_kind(config.recorded_kind, BertModel())
        warn_other_kind(config.recorded_kind, object())  # another class: not compared
    with pytest.warns(UserWarning, match=r"tuned for a bert model, but this run builds a gpt"):
        warn_other_kind(config.recorded_kind, GPTModel())


def _train_eval_train(rank, world, m: int) -> list[str]:
    """One forward-backward function over a plan for 4 micro-batches: train with ``m``,
    evaluate with ``m``, train with ``m`` again; what each call did."""
    import megatron_models as mm

    from megatron_prt.megatron import make_forward_backward_func, prepare_model
    from megatron_prt.megatron.config import ReuseConfig
    from megatron_prt.megatron.model import transformer_config_kwargs

    placement = Placement(2, 1)
    reuse = ReuseConfig(placement, 2, plan=build_plan(placement, 4, schedule="gpipe"))
    mm.setup_megatron(2, 1)
    config = mm.transformer_config(**transformer_config_kwargs(reuse))
    model = mm.model_chunks("gpt", config, reuse)
    prepare_model(model, reuse)
    forward_backward = make_forward_backward_func(reuse, timeout_s=60)
    done = []
    for forward_only in (False, True, False):
        try:
            forward_backward(**mm.step_kwargs("gpt", model, m), forward_only=forward_only)
            done.append(f"ran {forward_backward.pipeline().plan.schedule}")
        except ConfigError as exc:
            done.append(f"refused: {exc}")
    return done


def test_an_evaluation_does_not_open_another_count_to_training():
    """Evaluation with another count than the plan file's runs the default plan; a training
    call with that count after it found that runtime cached under its key and ran the
    default plan instead of being refused."""
    pytest.importorskip("megatron.core")
    from megatron_prt.runtime.local import all_ok, run_local

    for done in all_ok(run_local(2, _train_eval_train, 2)):
        assert done[1] == "ran prt", done
        for refused in (done[0], done[2]):
            assert refused.startswith("refused: --pipeline-reuse-plan schedules 4 micro"), done


@pytest.mark.parametrize("rampup", [(4, 4, 100), (2, 2, 100)])
def test_a_plan_file_under_a_batch_size_ramp_is_refused(wave_bi, rampup):
    """A ramp starting at the file's count trained, then stopped when the batch grew; one
    starting below it was refused naming --global-batch-size, which already matched."""
    message = refusal(*MODEL, "--pipeline-reuse-plan", wave_bi, "--rampup-batch-size", *rampup)
    assert "--pipeline-reuse-plan and --rampup-batch-size both set" in message, message
