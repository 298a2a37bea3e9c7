"""The tuned grid end to end at toy size (2 gloo ranks, one stack): profiling, the fit in
place, the tuner, the selection, the grid and the report. Slow (about 10 s): `make
test-all`. At this size a step takes a few milliseconds, where the fit in place once
failed now and then (the simulator's resolution: tests/tune/test_message_cpu.py)."""

from __future__ import annotations

import importlib.util
import json

import pytest

pytest.importorskip("torch")

from megatron_prt.bench.tuned_grid import main


@pytest.mark.slow
def test_smoke_run_writes_a_report_with_every_row_predicted(tmp_path, capfd):
    assert main(["--smoke", "--stacks", "wide", "--out", str(tmp_path)]) == 0
    log = capfd.readouterr().err
    assert log.index("grid configurations + the tuned pick") < log.index("repetition 1/1")
    stack = json.loads((tmp_path / "tuned_grid.json").read_text())["stacks"]["wide"]
    assert stack["rows"] and all(row["predicted_s"] > 0 for row in stack["rows"])
    assert stack["tuned"]["measured_s"] > 0
    report = (tmp_path / "tuned_grid.md").read_text()
    assert "| wide |" in report
    if importlib.util.find_spec("matplotlib") is not None:  # the picture is optional
        assert "](tuned_grid.png)" in report
        assert (tmp_path / "tuned_grid.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_without_a_picture_the_report_links_none_and_an_old_one_goes(tmp_path, monkeypatch):
    from megatron_prt.bench import tuned_grid

    old = tmp_path / "tuned_grid.png"
    old.write_bytes(b"an earlier launch's picture")
    monkeypatch.setattr(tuned_grid, "plot_grid", lambda path, summary: False)
    assert tuned_grid._chart(str(tmp_path), {}) is None and not old.exists()

    def broken(path, summary):
        raise RuntimeError("no fonts")

    monkeypatch.setattr(tuned_grid, "plot_grid", broken)
    assert tuned_grid._chart(str(tmp_path), {}) is None  # the launch keeps its report
