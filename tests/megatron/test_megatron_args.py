"""``--pipeline-reuse*`` flags: parsing, every refusal, and the translation onto Megatron.

Pure argparse: a small stand-in of Megatron-LM's parser holds the settings validate_args
reads, so these tests need neither torch nor megatron.
"""

import argparse
import subprocess
import sys

import pytest
from megatron_flags import BASE, parse, refusal

from megatron_prt.core.placement import ConfigError, Placement
from megatron_prt.megatron.args import add_arguments, validate_args
from megatron_prt.megatron.config import ReuseConfig

# -- parsing --------------------------------------------------------------------------------


def test_flags_parse_with_megatron_style_names():
    args = parse(
        "--pipeline-reuse",
        3,
        "--pipeline-reuse-placement",
        "wave",
        "--pipeline-reuse-direction",
        "bi",
        "--pipeline-reuse-partition",
        "balanced",
        "--pipeline-reuse-stage-layers",
        "1,2,0,3",
        "--pipeline-reuse-trace",
        "t/x",
    )
    assert (
        args.pipeline_reuse,
        args.pipeline_reuse_placement,
        args.pipeline_reuse_direction,
        args.pipeline_reuse_partition,
        args.pipeline_reuse_stage_layers,
        args.pipeline_reuse_trace,
    ) == (3, "wave", "bi", "balanced", (1, 2, 0, 3), "t/x")


def test_defaults_leave_prt_off():
    args = parse()
    assert (
        args.pipeline_reuse,
        args.pipeline_reuse_placement,
        args.pipeline_reuse_direction,
        args.pipeline_reuse_partition,
        args.pipeline_reuse_stage_layers,
        args.pipeline_reuse_trace,
    ) == (None, "loop", "uni", "uniform", None, None)


def test_flags_live_in_their_own_help_group():
    parser = add_arguments(argparse.ArgumentParser())
    group = next(g for g in parser._action_groups if g.title == "pipeline reuse (megatron-prt)")
    assert {a.dest for a in group._group_actions} == {
        "pipeline_reuse",
        "pipeline_reuse_placement",
        "pipeline_reuse_direction",
        "pipeline_reuse_partition",
        "pipeline_reuse_stage_layers",
        "pipeline_reuse_costs",
        "pipeline_reuse_memory_budget",
        "pipeline_reuse_plan",
        "pipeline_reuse_trace",
        "pipeline_reuse_timeout",
        "pipeline_reuse_split_backward",
        "pipeline_reuse_auto_candidates",
    }


@pytest.mark.parametrize(
    "argv",
    [
        ("--pipeline-reuse-stage-layers", "2,x"),
        ("--pipeline-reuse-placement", "zigzag"),
        ("--pipeline-reuse-direction", "both"),
        ("--pipeline-reuse", "two"),
    ],
)
def test_malformed_values_are_argparse_errors(argv, capsys):
    with pytest.raises(SystemExit):
        parse(*argv)
    assert argv[0] in capsys.readouterr().err


def test_importing_args_loads_neither_torch_nor_megatron():
    code = (
        "import sys, megatron_prt.megatron.args\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron')]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# -- off ------------------------------------------------------------------------------------


def test_off_returns_none_and_changes_nothing():
    args = parse(*BASE)
    before = vars(args).copy()
    assert validate_args(args) is None
    assert vars(args) == before


@pytest.mark.parametrize(
    "argv, flag",
    [
        (("--pipeline-reuse-placement", "wave"), "--pipeline-reuse-placement"),
        (("--pipeline-reuse-placement", "loop"), "--pipeline-reuse-placement"),  # its default
        (("--pipeline-reuse-direction", "bi"), "--pipeline-reuse-direction"),
        (("--pipeline-reuse-direction", "uni"), "--pipeline-reuse-direction"),  # its default
        (("--pipeline-reuse-partition", "balanced"), "--pipeline-reuse-partition"),
        (("--pipeline-reuse-stage-layers", "4,4"), "--pipeline-reuse-stage-layers"),
        (("--pipeline-reuse-trace", "trace"), "--pipeline-reuse-trace"),
        (("--pipeline-reuse-timeout", "5"), "--pipeline-reuse-timeout"),
        (("--pipeline-reuse-partition", "uniform"), "--pipeline-reuse-partition"),  # defaults
        (("--pipeline-reuse-timeout", "60"), "--pipeline-reuse-timeout"),
        (("--pipeline-reuse-auto-candidates", "3"), "--pipeline-reuse-auto-candidates"),
        (("--pipeline-reuse-split-backward",), "--pipeline-reuse-split-backward"),
    ],
)
def test_reuse_flags_without_pipeline_reuse_are_refused(argv, flag):
    message = refusal(*BASE, *argv)
    assert flag in message and "given without --pipeline-reuse" in message
    assert "add --pipeline-reuse R" in message


# -- refusals -------------------------------------------------------------------------------


@pytest.mark.parametrize("reuse", [0, -2])
def test_reuse_below_one(reuse):
    message = refusal(*BASE, "--pipeline-reuse", reuse)
    assert f"--pipeline-reuse must be >= 1, got {reuse}" in message
    assert "use 1 for plain 1F1B" in message


def test_no_pipeline():
    message = refusal("--num-layers", 8, "--pipeline-model-parallel-size", 1, "--pipeline-reuse", 2)
    assert "--pipeline-model-parallel-size is 1" in message
    assert "use --pipeline-model-parallel-size 2 or more" in message


def test_balanced_partition_needs_costs():
    message = refusal(*BASE, "--pipeline-reuse", 2, "--pipeline-reuse-partition", "balanced")
    assert "balanced needs --pipeline-reuse-costs FILE" in message
    assert "megatron-prt profile" in message


def test_balanced_partition_and_explicit_stage_layers_conflict(tmp_path):
    message = refusal(
        *BASE, "--pipeline-reuse", 2, "--pipeline-reuse-partition", "balanced",
        "--pipeline-reuse-costs", tmp_path / "c.json", "--pipeline-reuse-stage-layers",
        "1,1,1,1,1,1,1,1",
    )  # fmt: skip
    assert "give one of them" in message


@pytest.mark.parametrize("flag", ["--pipeline-reuse-costs", "--pipeline-reuse-memory-budget"])
def test_cost_flags_need_the_balanced_partition(flag):
    value = "1GiB" if flag.endswith("budget") else "c.json"
    message = refusal(*BASE, "--pipeline-reuse", 2, flag, value)
    assert "read only with --pipeline-reuse-partition balanced" in message


def _costs(tmp_path, layers, act=None):
    import json

    act = act or [1.0] * layers
    path = tmp_path / "costs.json"
    path.write_text(
        json.dumps(
            {
                "layers": [{"fwd": 1.0, "bwd": 2.0, "act": a, "param": 1.0} for a in act],
                "embedding": {"fwd": 0.1, "bwd": 0.2, "act": 1.0, "param": 6.0},
                "head": {"fwd": 0.5, "bwd": 1.0, "act": 2.0, "param": 6.0},
            }
        )
    )
    return str(path)


def test_balanced_costs_must_describe_the_model(tmp_path):
    message = refusal(
        *BASE, "--pipeline-reuse", 2, "--pipeline-reuse-partition", "balanced",
        "--pipeline-reuse-costs", _costs(tmp_path, 5),
    )  # fmt: skip
    assert "describes 5 layers, --num-layers is 8" in message
    message = refusal(
        *BASE, "--pipeline-reuse", 2, "--pipeline-reuse-partition", "balanced",
        "--pipeline-reuse-costs", tmp_path / "missing.json",
    )  # fmt: skip
    assert "--pipeline-reuse-costs" in message and "missing.json" in message


def test_balanced_partition_comes_from_the_partitioner(tmp_path):
    from megatron_prt.sim.cost import CostModel
    from megatron_prt.tune.partition import partition

    costs = _costs(tmp_path, 8)
    args = parse(
        *BASE, "--pipeline-reuse", 2, "--pipeline-reuse-partition", "balanced",
        "--pipeline-reuse-costs", costs, "--pipeline-reuse-memory-budget", "1TiB",
    )  # fmt: skip
    config = validate_args(args)
    want = partition(CostModel.load(costs), config.placement, 4, budget_bytes=2**40)
    assert config.stage_layers == want.balanced.stage_layers
    assert sum(config.layers_per_stage()) == 8


@pytest.mark.parametrize(
    "argv",
    [
        ("--num-layers-per-virtual-pipeline-stage", 1),
        ("--num-virtual-stages-per-pipeline-rank", 2),
        ("--pipeline-model-parallel-layout", "E|t*2|t*2|t*2|t*2,L"),
        ("--decoder-first-pipeline-num-layers", 1),
        ("--decoder-last-pipeline-num-layers", 1),
        ("--account-for-embedding-in-pipeline-split",),
        ("--account-for-loss-in-pipeline-split",),
    ],
)
def test_megatron_layout_flags_conflict(argv):
    message = refusal(*BASE, "--pipeline-reuse", 2, *argv)
    assert f"{argv[0]} conflicts with --pipeline-reuse" in message
    assert "--pipeline-reuse-stage-layers" in message


def test_virtual_pipeline_size_set_in_code_conflicts():
    args = parse(*BASE, "--pipeline-reuse", 2)
    args.virtual_pipeline_model_parallel_size = 2
    with pytest.raises(ConfigError, match=r"virtual_pipeline_model_parallel_size \(set in code"):
        validate_args(args)


def test_all_conflicting_layout_flags_are_named_at_once():
    message = refusal(
        *BASE,
        "--pipeline-reuse",
        2,
        "--decoder-first-pipeline-num-layers",
        1,
        "--decoder-last-pipeline-num-layers",
        1,
    )
    assert "--decoder-first-pipeline-num-layers, --decoder-last-pipeline-num-layers" in message


@pytest.mark.parametrize("flag", ["--encoder-num-layers", "--decoder-num-layers"])
def test_encoder_decoder_stacks_conflict(flag):
    message = refusal(*BASE, "--pipeline-reuse", 2, flag, 4)
    assert f"{flag} conflicts with --pipeline-reuse" in message
    assert "--num-layers instead" in message


def test_num_layers_missing():
    message = refusal("--pipeline-model-parallel-size", 4, "--pipeline-reuse", 2)
    assert "--pipeline-reuse needs --num-layers" in message


def test_too_few_layers_for_the_depth():
    message = refusal("--num-layers", 7, "--pipeline-model-parallel-size", 4, "--pipeline-reuse", 2)
    assert "--num-layers 7 cannot fill D = R*P = 8 stages" in message
    assert "lower --pipeline-reuse" in message


@pytest.mark.parametrize("counts", ["2,2,2", "2,2,2,1", "-1,3,3,3"])
def test_stage_layers_of_wrong_count_or_sum(counts):
    message = refusal(
        "--num-layers",
        8,
        "--pipeline-model-parallel-size",
        2,
        "--pipeline-reuse",
        2,
        f"--pipeline-reuse-stage-layers={counts}",
    )
    assert f"--pipeline-reuse-stage-layers {counts}" in message
    assert "D = R*P = 4 counts >= 0 that sum to --num-layers 8" in message


BI = ("--pipeline-reuse", 2, "--pipeline-reuse-direction", "bi")


@pytest.mark.parametrize(
    "batch_argv, world_size",
    [
        (("--micro-batch-size", 4, "--global-batch-size", 8), 8),  # 8 // (4 * DP 2) = 1
        (("--micro-batch-size", 1), 8),  # Megatron's default global batch: 1 micro-batch
        (("--micro-batch-size", 1, "--global-batch-size", 8, "--rampup-batch-size", 2, 2, 100), 8),
        (("--micro-batch-size", 1, "--global-batch-size", 1), 4),  # DP 1
    ],
)
def test_bi_with_fewer_than_two_microbatches(batch_argv, world_size):
    message = refusal(
        "--num-layers",
        8,
        "--pipeline-model-parallel-size",
        4,
        *BI,
        *batch_argv,
        world_size=world_size,
    )
    assert "--pipeline-reuse-direction bi needs >= 2 micro-batches per iteration" in message
    assert "got 1" in message
    assert "raise --global-batch-size" in message
    assert "or use --pipeline-reuse-direction uni" in message


def test_bi_microbatches_use_a_known_data_parallel_size():
    args = parse(*BASE, *BI)  # 8 // (1 * 2) = 4 from the world size ...
    args.data_parallel_size = 8  # ... but a known size wins: 8 // (1 * 8) = 1
    with pytest.raises(ConfigError, match="got 1"):
        validate_args(args)


@pytest.mark.parametrize("world_size", [None, 6])  # unknown, or not a multiple of TP*PP*CP
def test_bi_microbatch_check_is_skipped_without_a_data_parallel_size(world_size):
    args = parse(
        "--num-layers",
        8,
        "--pipeline-model-parallel-size",
        4,
        *BI,
        "--micro-batch-size",
        1,
        world_size=world_size,
    )
    assert validate_args(args).placement.direction == "bi"


def test_bi_allows_overlapped_grad_reduce():
    # replica sums run before the held chunks' reductions start (tests/megatron/test_megatron_3d.py)
    args = parse(*BASE, *BI, "--overlap-grad-reduce")
    assert validate_args(args).placement.direction == "bi"


def test_trace_directory_must_exist_or_be_creatable(tmp_path):
    path = tmp_path / "missing" / "deeper" / "trace"
    message = refusal(*BASE, "--pipeline-reuse", 2, "--pipeline-reuse-trace", path)
    assert f"--pipeline-reuse-trace {path}" in message
    assert "create it or choose another PATH" in message


def test_validating_after_megatron_is_refused():
    args = parse(*BASE, "--pipeline-reuse", 2)
    args.transformer_pipeline_model_parallel_size = 4  # what Megatron's validate_args sets
    with pytest.raises(ConfigError, match="before it"):
        validate_args(args)


# -- valid configurations ---------------------------------------------------------------


@pytest.mark.parametrize(
    "ranks, reuse, placement, direction, layers, per_stage",
    [
        (4, 1, "loop", "uni", 6, (2, 2, 1, 1)),  # 6 layers on P=4: Megatron alone refuses it
        (2, 3, "wave", "uni", 6, (1,) * 6),
        (2, 2, "loop", "bi", 6, (2, 2, 1, 1)),
        (4, 2, "wave", "bi", 9, (2, 1, 1, 1, 1, 1, 1, 1)),
    ],
)
def test_valid_configs_resolve_and_translate(ranks, reuse, placement, direction, layers, per_stage):
    args = parse(
        "--num-layers",
        layers,
        "--pipeline-model-parallel-size",
        ranks,
        "--pipeline-reuse",
        reuse,
        "--pipeline-reuse-placement",
        placement,
        "--pipeline-reuse-direction",
        direction,
        "--micro-batch-size",
        1,
        "--global-batch-size",
        8,
        world_size=2 * ranks,
    )
    config = validate_args(args)
    expected = Placement(ranks=ranks, reuse=reuse, placement=placement, direction=direction)
    assert config.placement == expected
    assert config.layers_per_stage() == per_stage
    assert args.pipeline_reuse_config is config
    chunks = expected.chunks_per_rank
    assert args.num_virtual_stages_per_pipeline_rank == chunks
    assert args.virtual_pipeline_model_parallel_size == (chunks if chunks > 1 else None)


def test_stage_layers_set_the_split():
    args = parse(
        "--num-layers",
        7,
        "--pipeline-model-parallel-size",
        2,
        "--pipeline-reuse",
        2,
        "--pipeline-reuse-placement",
        "wave",
        "--pipeline-reuse-stage-layers",
        "1,3,2,1",
    )
    assert validate_args(args).layers_per_stage() == (1, 3, 2, 1)


def test_chunks_turn_on_p2p_overlap_so_megatron_accepts_two_ranks():
    args = parse(
        *BASE,
        "--pipeline-model-parallel-size",
        2,
        "--pipeline-reuse",
        2,
        "--no-overlap-p2p-communication",
    )
    validate_args(args)
    assert args.overlap_p2p_comm is True


def test_one_chunk_leaves_p2p_overlap_alone():
    args = parse(*BASE, "--pipeline-reuse", 1, "--no-overlap-p2p-communication")
    validate_args(args)
    assert args.overlap_p2p_comm is False
    assert args.virtual_pipeline_model_parallel_size is None


@pytest.mark.parametrize("untie", [(), ("--untie-embeddings-and-output-weights",)])
def test_tied_and_untied_embeddings_are_accepted(untie):
    assert validate_args(parse(*BASE, "--pipeline-reuse", 2, *untie)) is not None


def test_uni_runs_a_single_microbatch():
    args = parse(
        "--num-layers",
        8,
        "--pipeline-model-parallel-size",
        4,
        "--pipeline-reuse",
        2,
        "--micro-batch-size",
        1,
    )
    assert validate_args(args).placement.direction == "uni"


def test_uni_allows_overlapped_grad_reduce():
    assert validate_args(parse(*BASE, "--pipeline-reuse", 2, "--overlap-grad-reduce"))


def test_bi_with_two_microbatches():
    args = parse(*BASE, *BI, "--global-batch-size", 4)  # 4 // (1 * DP 2) = 2
    assert validate_args(args).placement.chunks_per_rank == 4


def test_trace_path_in_a_creatable_directory_is_kept(tmp_path):
    path = str(tmp_path / "traces" / "iter")
    args = parse(*BASE, "--pipeline-reuse", 2, "--pipeline-reuse-trace", path)
    assert validate_args(args).trace_path == path
    assert not (tmp_path / "traces").exists()  # checking creates nothing


def test_a_repeated_call_returns_the_stored_config():
    args = parse(*BASE, "--pipeline-reuse", 2)
    assert validate_args(args) is validate_args(args)


# -- peer-wait timeout ------------------------------------------------------------------------


def test_split_backward_flag_reaches_the_config():
    assert validate_args(parse(*BASE, "--pipeline-reuse", 2)).split_backward is False
    config = validate_args(parse(*BASE, "--pipeline-reuse", 2, "--pipeline-reuse-split-backward"))
    assert config.split_backward is True


def test_timeout_defaults_to_the_runtimes_60_seconds():
    assert validate_args(parse(*BASE, "--pipeline-reuse", 2)).timeout_s == 60.0


def test_timeout_flag_reaches_the_config():
    config = validate_args(parse(*BASE, "--pipeline-reuse", 2, "--pipeline-reuse-timeout", 7.5))
    assert config.timeout_s == 7.5


@pytest.mark.parametrize("value", ["0", "-5", "nan", "inf", "soon"])
def test_timeout_must_be_positive_seconds(value, capsys):
    with pytest.raises(SystemExit):
        parse(*BASE, "--pipeline-reuse", 2, f"--pipeline-reuse-timeout={value}")
    err = capsys.readouterr().err
    assert "argument --pipeline-reuse-timeout: must be a number of seconds > 0" in err


def test_config_refuses_a_non_positive_timeout():
    with pytest.raises(ConfigError, match="--pipeline-reuse-timeout must be > 0 seconds"):
        ReuseConfig(Placement(2, 1), num_layers=2, timeout_s=0)


def test_install_waits_as_long_as_the_flag_says(monkeypatch):
    """The megatron path's forward-backward gets the flag's timeout (was a fixed 600 s)."""
    pytest.importorskip("megatron.core")
    from megatron_prt.megatron import installer

    seen = []
    monkeypatch.setattr(
        installer, "make_forward_backward_func", lambda reuse, timeout_s: seen.append(timeout_s)
    )
    monkeypatch.setattr(installer, "_sites", lambda: [])
    config = validate_args(parse(*BASE, "--pipeline-reuse", 2, "--pipeline-reuse-timeout", 3))
    try:
        assert installer.install(config)
        assert installer.install(config, timeout_s=9)  # an explicit argument wins
    finally:
        installer.uninstall()
    assert seen == [3.0, 9]


@pytest.mark.parametrize("value", ["auto:", "auto:x", "auto2"])
def test_malformed_auto_reuse_is_refused_naming_the_flag(value):
    from megatron_prt.megatron.args import _reuse_value

    with pytest.raises(argparse.ArgumentTypeError, match=r"--pipeline-reuse takes R"):
        _reuse_value(value)


def test_reuse_config_describes_its_schedule_and_split_in_one_line():
    from megatron_prt.core import build_plan

    plain = ReuseConfig(Placement(2, 2, "wave", "uni"), 10)
    assert plain.name == "PRT R=2 wave/uni"
    assert plain.describe() == "PRT R=2 wave/uni; 4 stages on 2 ranks, layers 3,3,2,2"
    assert ReuseConfig(Placement(2, 1, "loop", "uni"), 4).name == "PRT R=1 (1F1B)"
    split = ReuseConfig(Placement(2, 2, "loop", "bi"), 8, (1, 3, 2, 2), split_backward=True)
    assert split.describe() == (
        "PRT R=2 loop/bi, split backward (I, then W); 4 stages on 2 ranks, layers 1,3,2,2"
    )
    placement = Placement(2, 2, "loop", "uni")
    planned = ReuseConfig(placement, 4, plan=build_plan(placement, 8, schedule="zb"))
    assert planned.describe() == (
        "PRT R=2 loop/uni, plan file (zb order, 8 micro-batches), split backward (I, then W); "
        "4 stages on 2 ranks, layers 1,1,1,1"
    )


def test_a_config_asking_split_backward_of_a_whole_backward_plan_is_refused():
    """Built in code (the flags refuse it in plan_flag), the plan ran as it was, unsplit,
    the flag unheeded without a word."""
    from megatron_prt.core import build_plan

    placement = Placement(2, 2, "loop", "uni")
    with pytest.raises(ConfigError, match="a plan that runs whole backwards; drop the flag"):
        ReuseConfig(placement, 4, plan=build_plan(placement, 8), split_backward=True)
    zb = build_plan(placement, 8, schedule="zb")
    assert ReuseConfig(placement, 4, plan=zb, split_backward=True).splits_backward


def test_a_parser_without_world_size_reads_the_launchers(monkeypatch):
    """A user's own parser has no ``world_size`` (Megatron's parse_args sets it from
    WORLD_SIZE): the check reads WORLD_SIZE too (it was skipped, and the run failed at its
    first call)."""
    monkeypatch.setenv("WORLD_SIZE", "8")
    args = parse("--num-layers", 8, "--pipeline-model-parallel-size", 4, *BI,
                 "--micro-batch-size", 4, "--global-batch-size", 8, world_size=None)  # fmt: skip
    with pytest.raises(ConfigError, match="needs >= 2 micro-batches per iteration"):
        validate_args(args)


def test_runtimes_per_call_shape_are_bounded(monkeypatch):
    """A run whose sequence length changes every call built and kept one runtime per
    length (rings and sockets each): at most KEPT_RUNTIMES are kept, the least recently
    used closed, and never fewer than auto's candidates and two (its measured pick
    alternates them: a rebuild would be timed)."""
    import types

    import torch

    from megatron_prt.megatron import schedule

    built, closed = [], []

    class Fake:
        def __init__(self, plan, *args, **kwargs):
            built.append(self)

        def close(self):
            closed.append(self)

    monkeypatch.setattr(schedule, "MegatronPipeline", Fake)
    model = [torch.nn.Linear(1, 1)]
    config = types.SimpleNamespace(variable_seq_lengths=False)
    for candidates, kept in ((1, schedule.KEPT_RUNTIMES), (9, 11)):
        built.clear()
        closed.clear()
        reuse = ReuseConfig(Placement(2, 2), 4, auto_candidates=candidates)
        pipelines = schedule._Pipelines(reuse, None, 60.0, "auto", False)
        for length in range(1, 21):
            pipelines.get(model, config, None, (4, length, 2, None), forward_only=False)
        again = pipelines.get(model, config, None, (4, 20, 2, None), forward_only=False)
        assert len(built) == 20 and again is built[-1]
        assert closed == built[: 20 - kept] and len(pipelines.by_key) == kept


def test_balanced_costs_of_another_model_shape_are_said(tmp_path):
    """The cost file's measured shape (``model``) was not compared with the flags: a split
    balanced on costs of seq 32 was trained at seq 512 without a word."""
    import json
    import warnings

    path = tmp_path / "shaped.json"
    shape = {"hidden_size": 64, "seq_length": 32, "micro_batch_size": 1}
    path.write_text(json.dumps({**json.loads(open(_costs(tmp_path, 8)).read()), "model": shape}))
    balanced = ("--pipeline-reuse", 2, "--pipeline-reuse-partition", "balanced")
    balanced += ("--pipeline-reuse-costs", path, "--hidden-size", 64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        validate_args(parse(*BASE, *balanced, "--seq-length", 32))
    with pytest.warns(UserWarning, match=r"was profiled on another model shape \(seq_length 32"):
        validate_args(parse(*BASE, *balanced, "--seq-length", 512))


@pytest.mark.parametrize(
    "argv, said",
    [
        # megatron built no MTP layer under PRT's layout and trained without the MTP loss
        (("--mtp-num-layers", 1), "--mtp-num-layers conflicts with --pipeline-reuse"),
        (("--context-parallel-size", 2), "context parallelism is not supported"),
        # refused at the schedule's first call only, after the model, checkpoint and data
        (("--delay-wgrad-compute",), "megatron-prt: delay_wgrad_compute=True is not supported"),
        (("--cuda-graph-impl", "local"), "cuda_graph_impl='local' is not supported"),
        # megatron-core 0.19 captures one whole call and then only replays it
        (("--cuda-graph-impl", "full_iteration"), "cuda_graph_impl='full_iteration'"),
        (("--mtp-num-layers", 0), None),  # megatron's off
        # it orders megatron's interleaved schedule: taken and ignored under PRT
        (
            ("--microbatch-group-size-per-virtual-pipeline-stage", 3),
            "microbatch_group_size_per_vp_stage=3 is not supported",
        ),
        (("--microbatch-group-size-per-virtual-pipeline-stage", 4), None),  # megatron's default
    ],
)
def test_flags_prt_does_not_run_are_refused_before_anything_is_built(argv, said):
    if said is None:
        assert validate_args(parse(*BASE, "--pipeline-reuse", 2, *argv, world_size=16))
        return
    message = refusal(*BASE, "--pipeline-reuse", 2, *argv, world_size=16)
    assert said in message, message


def test_a_chunk_count_copied_from_a_prt_checkpoint_is_this_runs():
    """--use-checkpoint-args --use-mp-args-from-checkpoint-args copies the chunk count PRT
    set into the checkpoint's args: it was refused as a Megatron layout flag "set in code"."""
    for copied, said in ((2, None), (3, "took virtual_pipeline_model_parallel_size 3")):
        args = parse(*BASE, "--pipeline-reuse", 2, world_size=16)
        args.use_mp_args_from_checkpoint_args = True
        args.virtual_pipeline_model_parallel_size = copied
        if said is None:
            assert validate_args(args).placement.chunks_per_rank == copied
            continue
        with pytest.raises(ConfigError, match=said):
            validate_args(args)
    args = parse(*BASE, "--pipeline-reuse", 2, world_size=16)
    args.virtual_pipeline_model_parallel_size = 2  # set in code, not copied: Megatron's own
    with pytest.raises(ConfigError, match="virtual_pipeline_model_parallel_size"):
        validate_args(args)
