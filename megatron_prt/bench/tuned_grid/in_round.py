"""The cost model fitted again in the grid's own rounds: a second prediction of every row.

[Note: in-round fit] The fit in place ([Note: compute fitted in place] in
:mod:`megatron_prt.tune.measured`) reproduces its reference steps (1F1B; every layer its own
stage; R = 1 loop/bi; R = 1 in split backward, the grid's plan for it) exactly as they
measured in the fit phase, minutes before the grid runs. On the 2-core machine a plan's
median moves by -19% to +16% between those two phases of one launch (the host's speed
drifts; the grid's interleaved rounds cancel the drift between rows, nothing cancels it
between phases), and every row's prediction moves with it. The same plans are rows of the
grid (R = 1 loop/uni, R = layers / P loop/uni, R = 1 loop/bi and R = 1 loop/uni split, even
splits), timed in the same shuffled rounds as every other row and the tuned pick. Fitting
the same model (:func:`~megatron_prt.tune.measured.fit_in_place`, from the profiled costs
before any fit) to their grid medians gives a prediction of every other row made at the time
it was measured: what is left of the error is the model's, not the machine's drift. It is
reported beside the prediction fitted before the grid, never instead of it; a pick that is
one of the reference rows (same plan, same split) is marked, since its in-round prediction
is then its own measurement (the split row is the fit phase's split step, the zero-bubble
order built for the traced costs, as the grid builds it for the fitted ones)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from ...core import Placement
from ...core.layers import even_layers
from ...core.placement import ConfigError
from ...core.plan import Plan
from ...sim.cost import CostModel
from ...sim.simulate import simulate
from ...tune.measured import fit_in_place


@dataclass(frozen=True)
class InRoundFit:
    """The model fitted to the reference rows' grid medians: ``cost`` (priced without a
    split: set ``stage_layers`` per row), the compute ``scale`` over the profiled times,
    and the references as ``(label, plan, stage_layers)`` rows."""

    cost: CostModel
    scale: float
    references: tuple[tuple[str, Plan, tuple[int, ...]], ...]

    def predict(self, plan: Plan, stage_layers: tuple[int, ...]) -> float:
        """Simulated seconds of ``plan`` on ``stage_layers`` under the in-round model."""
        return simulate(plan, replace(self.cost, stage_layers=stage_layers)).makespan

    def is_reference(self, plan: Plan, stage_layers: tuple[int, ...]) -> bool:
        """True when ``plan`` on ``stage_layers`` is one of the rows the model was fitted to."""
        run = (plan.compute_only(), tuple(stage_layers))
        return any(run == (p.compute_only(), tuple(c)) for _, p, c in self.references)


def reference_rows(rows: list[tuple], layers: int, ranks: int) -> list[tuple] | None:
    """The grid rows ``(label, plan, stage_layers)`` of the reference steps, in
    :func:`~megatron_prt.tune.measured.fit_in_place`'s order (few messages, many, bi, each
    without split backward; then R = 1 loop/uni in split backward where the grid has it: the
    split form's scale), each on the even split; None when the grid lacks one of the first
    three (every layer its own stage needs R = layers / P among the grid's reuses)."""
    if layers % ranks:
        return None
    wanted = [(1, "uni", False), (layers // ranks, "uni", False), (1, "bi", False)]
    found = []
    for reuse, direction, split in [*wanted, (1, "uni", True)]:
        placement = Placement(ranks, reuse, "loop", direction)
        even = even_layers(layers, placement.depth)
        match = [
            row
            for row in rows
            if row[1].placement == placement
            and row[1].split_backward == split
            and tuple(row[2]) == even
        ]
        if not match and not split:
            return None
        found += match[:1]
    return found


def in_round_fit(
    profiled: CostModel | None, rows: list[tuple], medians: dict[str, float], ranks: int
) -> InRoundFit | None:
    """:func:`~megatron_prt.tune.measured.fit_in_place` of ``profiled`` (the costs before
    any fit, without a split) to the reference rows' ``medians`` (label -> seconds); None
    when there are no profiled costs, the grid lacks a reference row, or no scale fits."""
    if profiled is None:
        return None
    references = reference_rows(rows, len(profiled.layers), ranks)
    if references is None:
        return None
    timed = [(plan, medians[label]) for label, plan, _ in references]
    try:
        # no warning at 0: the report prints the fitted values, and its advice (time the
        # steps again) does not apply to grid medians
        cost, scale = fit_in_place(replace(profiled, stage_layers=()), timed, warn=False)
    except ConfigError:
        return None
    return InRoundFit(cost, scale, tuple((lbl, p, tuple(c)) for lbl, p, c in references))
