"""The tuned grid's configurations: exhaustive over R, placement, direction, split backward
and split, without the ones that cannot exist; every plan valid for its placement."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from megatron_prt.bench.tuned_grid.grid import grid_entries
from megatron_prt.core.validate import validate
from megatron_prt.sim.cost import CostModel, LayerCost


def _cost(layers: int) -> CostModel:
    head = [LayerCost(3.0, 6.0, wgrad=3.0)]
    return CostModel(layers=(LayerCost(1.0, 2.0, wgrad=1.0),) * (layers - 1) + tuple(head))


def test_grid_covers_every_configuration_that_exists():
    entries = grid_entries(_cost(8), 2, 8)
    labels = [e.label for e in entries]
    assert len(labels) == len(set(labels))
    shapes = {e.label.split(",")[0] for e in entries}
    # R=1: loop only; R=2..4: loop and wave; uni and bi; split backward off and on
    assert len(shapes) == (1 + 2 * 3) * 2 * 2
    assert "R=4 wave/bi split" in shapes and not any(s.startswith("R=1 wave") for s in shapes)
    assert any(label.endswith("balanced") for label in labels)  # the heavy head moves layers
    for e in entries:
        validate(e.plan)
        assert sum(e.stage_layers) == 8 and len(e.stage_layers) == e.plan.placement.depth
        assert e.plan.split_backward == ("split" in e.label)


def test_reuse_beyond_the_layers_is_left_out():
    shapes = {e.label.split(",")[0] for e in grid_entries(_cost(6), 2, 4)}
    assert not any(s.startswith("R=4") for s in shapes) and "R=3 wave/uni" in shapes
