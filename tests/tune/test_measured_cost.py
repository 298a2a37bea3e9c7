"""``measured_cost``: the cost model ``--pipeline-reuse auto`` tunes on, from traced spans
(pure Python; the megatron-side tests are in tests/megatron/test_megatron_auto.py)."""

from __future__ import annotations

import pytest

from megatron_prt.core.actions import Action, Op
from megatron_prt.core.placement import Placement
from megatron_prt.core.schedules import build_plan
from megatron_prt.sim.simulate import simulate
from megatron_prt.tune.measured import measured_cost

FWD = {0: 0.4, 1: 0.05, 2: 0.3, 3: 0.35}  # seconds of one forward per model stage


def _gathered(placement: Placement, m: int, split: bool) -> list:
    """One traced iteration per rank: stage k's forward FWD[k], its backward twice that
    (split: I and W alike)."""
    ops = (Op.F, Op.I, Op.W) if split else (Op.F, Op.B)
    length = {Op.F: 1.0, Op.B: 2.0, Op.I: 1.0, Op.W: 1.0}
    return [
        [
            [
                (Action(s, op, mb), 0.0, length[op] * FWD[placement.model_stage(s)])
                for s in placement.rank_stages[rank]
                for op in ops
                for mb in range(m)
            ]
        ]
        for rank in range(placement.ranks)
    ]


@pytest.mark.parametrize("split", [False, True], ids=["whole", "split"])
@pytest.mark.parametrize("placement", [Placement(2, 2), Placement(2, 2, "wave", "bi")], ids=str)
def test_an_empty_middle_stage_costs_what_it_measured(placement, split):
    """Stage 1 holds no layer: its measured 0.05 s forward was dropped (priced 0), so every
    plan looked one stage's step shorter on its path. [Note: an empty middle stage
    measured]"""
    counts = (2, 0, 1, 1)
    cost = measured_cost(placement, counts, _gathered(placement, 4, split), split)
    times = cost.stage_times(placement)
    assert times.fwd == pytest.approx([FWD[k] for k in range(4)])
    assert times.bwd == pytest.approx([2 * FWD[k] for k in range(4)])
    if split:  # W as measured (half of each backward), the step's work out of I only
        w = cost.stage_wgrad_times(placement.depth)
        assert w == pytest.approx([FWD[0], 0.0, FWD[2], FWD[3]])
    simulate(build_plan(placement, 4, "zb" if split else "prt"), cost)  # prices every plan


def test_without_an_empty_middle_stage_there_is_no_stage_work():
    placement = Placement(2, 2)
    cost = measured_cost(placement, (0, 2, 1, 1), _gathered(placement, 4, False), False)
    assert cost.stage is None and cost.embedding.fwd == pytest.approx(FWD[0])
    assert cost.stage_times(placement).fwd == pytest.approx([FWD[k] for k in range(4)])
