"""The instance-spread benchmark's smoke mode runs on 2 gloo ranks and reports, per
instance, its medians of both phases and its spread (no timing assertions)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")

from megatron_prt.bench.instance_spread import main, spearman


def test_smoke_reports_every_instance_and_a_spread(tmp_path, capsys):
    args = ["--smoke", "--remedy", "reclone", "--ballast-between", "0.01", "--out", str(tmp_path)]
    assert main(args) == 0
    report = json.loads((tmp_path / "instance_spread.json").read_text())
    groups = {(g["plan"], g["group"]): g for g in report["groups"]}
    plans = ("R=1 loop/uni, even", "R=2 wave/uni split, even")
    assert set(groups) == {(plan, group) for plan in plans for group in ("none", "reclone")}
    for g in groups.values():
        assert [r["instance"] for r in g["instances"]] == [0, 1, 2]
        for r in g["instances"]:
            assert len(r["median_s"]) == 2 and min(r["median_s"]) > 0
            assert len(r["placement"]) == 2  # one per rank
        assert len(g["spread"]) == 2 and min(g["spread"]) >= 0
    assert "Spread (max/min - 1)" in capsys.readouterr().out


def test_spearman_of_same_and_reversed_orders():
    assert spearman([1.0, 2.0, 3.0], [10.0, 20.0, 30.0]) == 1.0
    assert spearman([1.0, 2.0, 3.0], [3.0, 2.0, 1.0]) == -1.0
