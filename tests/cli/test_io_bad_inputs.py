"""Bad input at the edges: CLI flags, cost files, ``--pipeline-reuse*`` flags, BERT data.

Every case must end in one clear message that names the flag or file (and the fix), never in
a traceback from deep inside, never in a silently wrong result. The cases are run in-process
and need neither a process group nor a model, except one ``profile`` case (megatron import).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
from megatron_flags import BASE, parse, refusal

from megatron_prt.core.placement import ConfigError

LAYER = {"fwd": 1.0, "bwd": 2.0, "act": 10.0, "param": 5.0}


def _layers(count: int) -> dict:
    return {"layers": [LAYER] * count}


PROFILE = ["profile", "--num-layers", 1, "--hidden-size", 8, "--num-attention-heads", 4]
PROFILE += ["--seq-length", 4, "--micro-batch-size", 1, "--vocab-size", 16]

# -- megatron-prt plan / simulate / compare / partition / profile --------------------------------
# (argv, cost file content: dict (JSON), str or bytes (raw), None (no file), message). "COSTS"
# in argv is the cost file's path, "DIR" the test's temporary directory.
CLI_CASES = {
    "costs: a bool for a time": (
        ["simulate", "--pp", 2, "-m", 4, "--costs", "COSTS"],
        {"fwd_time": True},
        "COSTS: key fwd_time must be a number, got True",
    ),
    "costs: NaN time": (
        ["simulate", "--pp", 2, "-m", 4, "--costs", "COSTS"],
        '{"fwd_time": NaN}',
        "COSTS: key fwd_time must be a number, got nan",
    ),
    "costs: layers not a list": (
        ["simulate", "--pp", 2, "-m", 4, "--costs", "COSTS"],
        {"layers": {"fwd": 1}},
        "COSTS: key layers must be a JSON list",
    ),
    "costs: a string layer time": (
        ["simulate", "--pp", 2, "-m", 4, "--costs", "COSTS"],
        {"layers": [{"fwd": 1, "bwd": "2"}]},
        "COSTS: key layers[0].bwd must be a number, got '2'",
    ),
    "costs: fractional stage_layers": (
        ["simulate", "--pp", 2, "-m", 4, "--costs", "COSTS"],
        {**_layers(1), "stage_layers": [0.5, 0.5]},
        "COSTS: key stage_layers[0] must be an integer, got 0.5",
    ),
    "costs: head not an object": (
        ["simulate", "--pp", 2, "-m", 4, "--costs", "COSTS"],
        {"head": [1]},
        "COSTS: key head must be a JSON dict",
    ),
    "costs: not UTF-8": (
        ["simulate", "--pp", 2, "-m", 4, "--costs", "COSTS"],
        b"\xff\xfe{",
        "COSTS: not JSON",
    ),
    "costs: a directory": (
        ["simulate", "--pp", 2, "-m", 4, "--costs", "DIR"],
        None,
        "--costs DIR: Is a directory",
    ),
    "costs: zero bandwidth": (
        ["simulate", "--pp", 2, "-m", 4, "--costs", "COSTS"],
        {"p2p_bandwidth": 0},
        "--costs COSTS: cost p2p_bandwidth must be > 0",
    ),
    "costs: per-layer times beside --fwd-time": (  # the flag was ignored without a word
        ["simulate", "--pp", 2, "-m", 4, "--costs", "COSTS", "--fwd-time", 5],
        _layers(4),
        "--fwd-time with --costs COSTS, which gives per-layer times: they would be ignored",
    ),
    "costs: per-layer times beside --bwd-time 0": (  # 0 is a value: refused as any other
        ["simulate", "--pp", 2, "-m", 4, "--costs", "COSTS", "--bwd-time", 0],
        _layers(4),
        "--bwd-time with --costs COSTS, which gives per-layer times",
    ),
    "costs: a layer that is no object beside layers with act": (  # named, not "no act"
        ["simulate", "--pp", 2, "-m", 4, "--costs", "COSTS"],
        {"layers": [LAYER, 5, LAYER]},
        "layers[1] must be",
    ),
    "costs: negative message bytes": (  # was priced: "p2p messages 8 (-800000 bytes)"
        ["simulate", "--pp", 2, "-m", 4, "--costs", "COSTS"],
        {"message_bytes": -1e5},
        "--costs COSTS: cost message_bytes must be >= 0, got -100000.0",
    ),
    "costs: act on some layers only": (  # the others were priced at 0 bytes
        ["simulate", "--pp", 2, "-m", 4, "--costs", "COSTS"],
        {"layers": [LAYER, {"fwd": 1.0, "bwd": 2.0, "param": 5.0}, LAYER]},
        "cost layers[1] have no act while other layers do",
    ),
    "tune: a budget with no bytes to price": (  # every plan fit a budget of 1 KiB
        ["tune", "--pp", 2, "-m", 4, "--costs", "COSTS", "--memory-budget", "1KiB"],
        {"layers": [{"fwd": 1.0, "bwd": 2.0}] * 4},
        "--memory-budget: --costs COSTS prices no plan's memory",
    ),
    "costs: stage_layers for another depth": (
        ["simulate", "--pp", 2, "--reuse", 2, "-m", 4, "--costs", "COSTS"],
        {**_layers(4), "stage_layers": [2, 2]},
        "--costs COSTS: stage_layers splits the layers over 2 stages, but this runs D = R*P = 4;"
        " drop stage_layers from the file or choose --pp and --reuse with R*P = 2",
    ),
    "compare: stage_layers fix one depth": (
        ["compare", "--pp", 2, "-m", 4, "--costs", "COSTS"],
        {**_layers(4), "stage_layers": [1, 1, 1, 1]},
        # the fix offered was R*P = 4, which it already was
        "stages, but this runs D = R*P = 2 and 4; drop stage_layers from the file",
    ),
    "compare: costs of zero time": (
        ["compare", "--pp", 2, "-m", 4, "--costs", "COSTS"],
        {"fwd_time": 0, "bwd_time": 0},
        "the costs give every stage zero time",
    ),
    "tune: per-layer costs of zero time": (  # 30 plans ranked, all at time 0
        ["tune", "--pp", 2, "-m", 4, "--costs", "COSTS"],
        {"layers": [{"fwd": 0.0, "bwd": 0.0, "act": 8.0, "param": 4.0}] * 4},
        "the costs give every stage zero time",
    ),
    "plan: -o is a directory": (
        ["plan", "--pp", 2, "-m", 4, "-o", "DIR"],
        None,
        "-o DIR: Is a directory; choose a file",
    ),
    "plan: -o in a missing directory": (
        ["plan", "--pp", 2, "-m", 4, "--format", "csv", "-o", "DIR/no/such/plan.csv"],
        None,
        "-o DIR/no/such/plan.csv: No such file or directory",
    ),
    "simulate: infinite forward time": (
        ["simulate", "--pp", 2, "-m", 4, "--fwd-time", "inf"],
        None,
        "argument --fwd-time: must be a finite number > 0, got 'inf'",
    ),
    "compare: NaN hop time": (
        ["compare", "--pp", 2, "-m", 4, "--p2p-time", "nan"],
        None,
        "argument --p2p-time: must be a finite number >= 0, got 'nan'",
    ),
    "compare: negative micro-batches": (
        ["compare", "--pp", 2, "-m", -3],
        None,
        "argument --microbatches/-m: must be an integer >= 1, got '-3'",
    ),
    "partition: NaN slack": (
        ["partition", "--pp", 2, "-m", 4, "--costs", "COSTS", "--slack", "nan"],
        _layers(4),
        "argument --slack: expected a fraction >= 0",
    ),
    # both ran, the budget meaningless (every peak 0 B) or the slack ignored
    "partition: a budget on costs that price no memory": (
        ["partition", "--pp", 2, "-m", 4, "--costs", "COSTS", "--budget", "1KiB"],
        {"layers": [{"fwd": 1.0, "bwd": 2.0}] * 4},
        "--budget: --costs COSTS prices no partition's memory",
    ),
    "partition: slack beside a budget": (
        ["partition", "--pp", 2, "-m", 4, "--costs", "COSTS", "--budget", "1GiB", "--slack", "0.1"],
        _layers(4),
        "--slack trades time for memory without --budget",
    ),
    "partition: more stages than layers": (
        ["partition", "--pp", 2, "--reuse", 3, "-m", 4, "--costs", "COSTS"],
        _layers(4),
        "--costs COSTS: layer count 4 cannot fill D = R*P = 6 stages; use at least 6 layers",
    ),
    "partition: zero reuse": (
        ["partition", "--pp", 2, "--reuse", 0, "-m", 4, "--costs", "COSTS"],
        _layers(4),
        "argument --reuse: must be an integer >= 1, got '0'",
    ),
    "profile: a dropout that is no probability": (
        [*PROFILE, "--hidden-dropout", "1.5"],
        None,
        "argument --hidden-dropout: must be a finite number in [0, 1), got '1.5'",
    ),
    "profile: message CPU with no transport timed": (
        [*PROFILE, "--comm", "none", "--message-cpu", "in-place"],
        None,
        "--message-cpu in-place fits the message CPU on the transport --comm times, and none "
        "is timed: give --comm",
    ),
    "profile: message CPU on cuda's default": (
        [*PROFILE, "--device", "cuda", "--message-cpu", "in-place"],
        None,
        "none is timed (--device cuda times no transport by default)",
    ),
    "profile: -o in a missing directory": (
        [*PROFILE, "-o", "DIR/no/such/costs.json"],
        None,
        "-o DIR/no/such/costs.json: directory DIR/no/such does not exist",
    ),
    "tune: one rank": (
        ["tune", "--costs", "COSTS", "--pp", 1, "-m", 4],
        _layers(4),
        "--pp 1: a pipeline needs 2 ranks or more",
    ),
    "tune: fewer layers than ranks": (
        ["tune", "--costs", "COSTS", "--pp", 4, "-m", 4],
        _layers(3),
        "--costs COSTS: layer count 3 cannot fill D = R*P = 4 stages; use at least 4 layers or "
        "lower --pp",
    ),
    "tune: whole-model costs": (
        ["tune", "--costs", "COSTS", "--pp", 2, "-m", 4],
        {"fwd_time": 1.0},
        '--costs COSTS: no per-layer "layers" list',
    ),
    "tune: -o in a missing directory, before the search": (
        ["tune", "--costs", "COSTS", "--pp", 2, "-m", 4, "-o", "DIR/no/such/plan.json"],
        _layers(4),
        "-o DIR/no/such/plan.json: directory DIR/no/such does not exist",
    ),
    "profile: zero ffn size": (
        [*PROFILE, "--ffn-hidden-size", 0],
        None,
        "argument --ffn-hidden-size: must be an integer >= 1, got '0'",
    ),
    "profile: heads do not divide hidden": (
        [*PROFILE, "--hidden-size", 30],
        None,
        "--hidden-size 30 is not divisible by --num-attention-heads 4",
    ),
}


@pytest.mark.parametrize("argv, content, message", CLI_CASES.values(), ids=list(CLI_CASES))
def test_cli_refuses_with_one_line_naming_the_flag(run_cli, tmp_path, argv, content, message):
    if "heads do not divide" in message or "not divisible" in message:
        pytest.importorskip("megatron.core")
    costs = tmp_path / "costs.json"
    if isinstance(content, dict):
        costs.write_text(json.dumps(content))
    elif isinstance(content, str):
        costs.write_text(content)
    elif isinstance(content, bytes):
        costs.write_bytes(content)

    def place(text: str) -> str:
        return str(text).replace("COSTS", str(costs)).replace("DIR", str(tmp_path))

    code, out, err = run_cli(*map(place, argv))
    lines = err.strip().splitlines()
    assert code == 2, (out, err)
    assert lines[-1].startswith("megatron-prt"), err
    assert place(message) in lines[-1], err
    assert "Traceback" not in err
    if argv[0] != "profile":  # profile reports progress on stderr before it fails
        assert len(lines) == 1, err


# -- --pipeline-reuse* flags ---------------------------------------------------------------------
BALANCED = ("--pipeline-reuse", 2, "--pipeline-reuse-partition", "balanced")

# (extra argv, cost file content or None, message). BASE: 8 layers, P=4, 4 micro-batches.
FLAG_CASES = {
    "costs: a string time": (
        (*BALANCED, "--pipeline-reuse-costs", "COSTS"),
        {**_layers(8), "fwd_time": "fast"},
        "--pipeline-reuse-costs COSTS: key fwd_time must be a number, got 'fast'",
    ),
    "costs: a layer without bwd": (
        (*BALANCED, "--pipeline-reuse-costs", "COSTS"),
        {"layers": [{"fwd": 1}] * 8},
        "--pipeline-reuse-costs COSTS: cost layers[0] has keys ['fwd']; it needs fwd and bwd",
    ),
    "costs: missing file": (
        (*BALANCED, "--pipeline-reuse-costs", "DIR/none.json"),
        None,
        "--pipeline-reuse-costs DIR/none.json: No such file or directory; give the path",
    ),
    "costs: for another layer count": (
        (*BALANCED, "--pipeline-reuse-costs", "COSTS"),
        _layers(12),
        "--pipeline-reuse-costs COSTS describes 12 layers, --num-layers is 8",
    ),
    "balanced: fewer layers than stages": (
        (
            "--pipeline-reuse",
            3,
            "--pipeline-reuse-partition",
            "balanced",
            "--pipeline-reuse-costs",
            "COSTS",
        ),
        _layers(8),
        "--num-layers 8 cannot fill D = R*P = 12 stages; use at least 12 layers or lower "
        "--pipeline-reuse",
    ),
    "balanced: a budget nothing fits": (
        (*BALANCED, "--pipeline-reuse-costs", "COSTS", "--pipeline-reuse-memory-budget", "1"),
        _layers(8),
        "--pipeline-reuse-memory-budget: no layer partition fits the budget",
    ),
    "uniform: reuse beyond the layers": (
        ("--pipeline-reuse", 3),
        None,
        "--num-layers 8 cannot fill D = R*P = 12 stages",
    ),
    "stage layers: a plan for another depth": (
        ("--pipeline-reuse", 2, "--pipeline-reuse-stage-layers", "4,4"),
        None,
        "--pipeline-reuse-stage-layers 4,4 must give D = R*P = 8 counts",
    ),
}


@pytest.mark.parametrize("extra, content, message", FLAG_CASES.values(), ids=list(FLAG_CASES))
def test_reuse_flags_refuse_naming_the_flag(tmp_path, extra, content, message):
    costs = tmp_path / "costs.json"
    if content is not None:
        costs.write_text(json.dumps(content))

    def place(text) -> str:
        return str(text).replace("COSTS", str(costs)).replace("DIR", str(tmp_path))

    assert place(message) in refusal(*BASE, *map(place, extra))


@pytest.mark.parametrize(
    "flag, value, message",
    [
        ("--pipeline-reuse-memory-budget", "0", "expected bytes > 0 such as 24GiB"),
        ("--pipeline-reuse-memory-budget", "lots", "expected bytes > 0 such as 24GiB"),
        ("--pipeline-reuse-memory-budget", "1e400", "expected bytes > 0 such as 24GiB"),
        ("--pipeline-reuse-timeout", "-1", "must be a number of seconds > 0"),
        ("--pipeline-reuse-stage-layers", "2,,2", "expected comma-separated integers"),
    ],
)
def test_malformed_reuse_flag_values_are_argparse_errors(capsys, flag, value, message):
    with pytest.raises(SystemExit):
        parse(*BASE, "--pipeline-reuse", 2, f"{flag}={value}")
    err = capsys.readouterr().err
    assert f"argument {flag}: {message}" in err


def test_a_refused_config_is_a_config_error_not_a_crash(tmp_path):
    """A cost file of the wrong shape used to escape as TypeError from the partitioner."""
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"layers": "eight"}))
    with pytest.raises(ConfigError, match="key layers must be a JSON list"):
        from megatron_prt.megatron.args import validate_args

        validate_args(parse(*BASE, *BALANCED, "--pipeline-reuse-costs", costs))


# -- examples/bert_data.py -----------------------------------------------------------------------
EXAMPLE = Path(__file__).parents[2] / "examples" / "bert_data.py"


@pytest.fixture(scope="module")
def bert_data():
    if "bert_data" not in sys.modules:  # test_bert_data.py may have loaded it already
        spec = importlib.util.spec_from_file_location("bert_data", EXAMPLE)
        module = importlib.util.module_from_spec(spec)
        sys.modules["bert_data"] = module  # dataclasses look their module up here
        spec.loader.exec_module(module)
    return sys.modules["bert_data"]


@pytest.mark.parametrize("split", ["a,b", "0,0,0", "1,2,3,4", "1,-1,0", "nan,1,1", ""])
def test_a_split_megatron_would_divide_by_zero_on_is_refused(bert_data, split):
    pytest.importorskip("megatron.core")
    with pytest.raises(bert_data.DataError, match="expected up to three weights >= 0"):
        bert_data.split_document_ranges(10, split)


def test_a_data_path_without_files_is_refused(bert_data, tmp_path):
    """``show --data-path`` to a prefix with no files used to fail in megatron's
    IndexedDataset (AssertionError, then AttributeError from its __del__)."""
    pytest.importorskip("megatron.core")
    with pytest.raises(bert_data.DataError, match=r"nope\.idx does not exist"):
        bert_data.samples_per_epoch(str(tmp_path / "nope"), 32)


def test_a_closed_pipe_ends_the_output_quietly():
    """`megatron-prt plan ... | head`: the reader goes away; no traceback, no error line."""
    import subprocess

    argv = [sys.executable, "-m", "megatron_prt", "plan", "--pp", "8", "--reuse", "2"]
    proc = subprocess.Popen(
        [*argv, "-m", "512"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    proc.stdout.readline()
    proc.stdout.close()  # as head does after its lines
    err = proc.stderr.read()
    assert proc.wait() == 1
    assert "Traceback" not in err and "error" not in err, err


@pytest.mark.parametrize("text", ["24G", "24GiB", "24GB", "2.5e10", "512MiB"])
def test_tune_and_megatron_take_the_same_byte_counts(text):
    """One parser for every byte flag: `megatron-prt tune --memory-budget 24G` worked and
    `--pipeline-reuse-memory-budget 24G` was refused."""
    from megatron_prt.cli.partition import parse_bytes
    from megatron_prt.megatron.args import byte_count

    assert parse_bytes(text) == byte_count(text) > 0


def test_compares_stage_layers_refusal_offers_no_depth_it_already_runs(run_cli, tmp_path):
    """compare runs D = P (1F1B) beside R*P: it offered "choose --pp and --reuse with R*P =
    4" for a file of 4 stages at R*P = 4."""
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({**_layers(4), "stage_layers": [1, 1, 1, 1]}))
    code, _, err = run_cli("compare", "--pp", 2, "--reuse", 2, "-m", 4, "--costs", costs)
    assert code == 2 and "drop stage_layers" in err and "choose --pp" not in err, err
