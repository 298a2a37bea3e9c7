"""The per-message CPU fitted in place ([Note: per-message CPU in place] in
megatron_prt/tune/measured.py): from two step times of the same layers, one plan with few
messages and one with many, the fit finds the CPU per message under which the simulator
reproduces their gap; never below the isolated figure. Step times here come from the
simulator itself at a known CPU, so the answer is known."""

from __future__ import annotations

import pytest

from megatron_prt.core import Placement, build_plan
from megatron_prt.sim.cost import CostModel, LayerCost
from megatron_prt.sim.simulate import simulate
from megatron_prt.tune.measured import message_cpu_in_place

LAYERS = (LayerCost(1.0, 2.0),) * 8
FEW = build_plan(Placement(2, 1), 2, "1f1b")
MANY = build_plan(Placement(2, 4), 2, "prt")


def _timed(cost: CostModel) -> list:
    return [(plan, simulate(plan, cost).makespan) for plan in (FEW, MANY)]


@pytest.mark.parametrize("true_cpu", [0.05, 0.2, 0.7])
def test_fit_recovers_the_cpu_that_made_the_steps(true_cpu):
    isolated = CostModel(layers=LAYERS, p2p_latency=0.01, p2p_cpu=0.01)
    measured = _timed(CostModel(layers=LAYERS, p2p_latency=0.01, p2p_cpu=true_cpu))
    # far finer than any measured step resolves; the simulator's event times are not exact
    assert message_cpu_in_place(isolated, measured) == pytest.approx(true_cpu, rel=1e-4)


def test_fit_never_goes_below_the_isolated_figure():
    isolated = CostModel(layers=LAYERS, p2p_latency=0.01, p2p_cpu=0.3)
    measured = _timed(CostModel(layers=LAYERS, p2p_latency=0.01, p2p_cpu=0.1))
    assert message_cpu_in_place(isolated, measured) == 0.3


def test_cost_files_without_p2p_cpu_still_load():
    old = {"layers": [{"fwd": 1.0, "bwd": 2.0}] * 4, "p2p_latency": 0.01}
    assert CostModel.from_dict(old).p2p_cpu == 0.0
    fitted = CostModel.from_dict({**old, "p2p_cpu": 0.02})
    assert fitted.p2p_cpu == 0.02 and CostModel.from_dict(fitted.to_dict()) == fitted
