"""benchmarks/vs_torch_pipelining.py runs end to end in its tiny --smoke mode (no timings
are checked: this machine is shared and timing is the benchmark's job, not a test's)."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "vs_torch_pipelining.py"


def _load_bench():
    spec = importlib.util.spec_from_file_location("vs_torch_pipelining", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while being built
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    bench = _load_bench()
    out = tmp_path_factory.mktemp("bench")
    bench.main(["--smoke", "--microbatches", "1,2", "--out", str(out)])
    data = json.loads((out / "vs_torch_pipelining.json").read_text())
    return bench, out, data


def test_writes_report_chart_and_data(smoke_run):
    bench, out, data = smoke_run
    report = (out / "vs_torch_pipelining.md").read_text()
    assert (out / "vs_torch_pipelining.png").read_bytes()[:4] == b"\x89PNG"
    assert "--smoke --microbatches 1,2" in report
    for cfg in bench.all_configs():
        assert f"| {cfg.label} |" in report
    assert sorted(data["rows"]) == ["1", "2"]


def test_refusals_are_reported_not_raised(smoke_run):
    _, _, data = smoke_run
    rows = {row["key"]: row for row in data["rows"]["1"]}
    assert rows["torch Schedule1F1B (1/rank) [gloo]"]["na"].startswith("n/a: ")
    assert rows["PRT wave/bi R=2 [shm]"]["na"].startswith("n/a: ")
    assert "median_s" in rows["torch ScheduleZBVZeroBubble (2/rank) [gloo]"]


def test_same_schedule_same_memory_on_both_runtimes(smoke_run):
    """The meter hooked into torch's PipelineStage counts what PipelineRuntime counts: the
    same 1F1B order holds the same bytes on every rank."""
    _, _, data = smoke_run
    rows = {row["key"]: row for row in data["rows"]["2"]}
    prt = rows["PRT 1F1B (R=1) [gloo]"]["peak_bytes"]
    assert prt == rows["torch Schedule1F1B (1/rank) [gloo]"]["peak_bytes"]
    assert prt == rows["PRT 1F1B (R=1) [shm]"]["peak_bytes"]
    assert min(prt) > 0
