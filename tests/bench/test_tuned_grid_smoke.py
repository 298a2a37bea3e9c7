"""The tuned grid end to end at toy size (2 gloo ranks): the fit in the grid's process runs
after every grid runtime is built ([Note: fit in the grid's process]), and the report gives
both fits' predictions. Slow (about 25 s): `make test-all`."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")

from megatron_prt.bench.tuned_grid import main


@pytest.mark.slow
def test_smoke_run_fits_again_once_the_grids_runtimes_are_built(tmp_path, capfd):
    assert main(["--smoke", "--stacks", "wide", "--out", str(tmp_path)]) == 0
    log = capfd.readouterr().err
    built = log.index(" grid configurations + the tuned pick")
    again = log.index("tuned grid, wide: fitting the costs again, every grid runtime built")
    timed = log.index("tuned grid, wide: repetition 1/1")
    assert built < again < timed
    stack = json.loads((tmp_path / "tuned_grid.json").read_text())["stacks"]["wide"]
    assert stack["early_costs"] and stack["costs"]
    assert all(row["early_s"] and row["predicted_s"] for row in stack["rows"])
    assert (
        "Fitted before the grid's runtimes were built" in (tmp_path / "tuned_grid.md").read_text()
    )
