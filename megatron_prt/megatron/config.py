"""What ``--pipeline-reuse*`` resolves to: one frozen value every module of the integration reads.

Kept free of megatron imports so flags can be validated (and tested) before megatron loads.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core.layers import stage_layer_counts
from ..core.placement import ConfigError, Placement
from ..core.plan import Plan


@dataclass(frozen=True)
class ReuseConfig:
    """``placement``: P, R, loop|wave, uni|bi. ``stage_layers``: transformer layers of each
    model stage ``0..D-1`` in flow order (``None``: as even as possible, earlier stages take the
    remainder). ``trace_path``: where a traced iteration's Chrome trace goes (``None``: off).
    ``timeout_s``: how long a rank waits on a peer before :class:`PipelineError`.
    ``split_backward``: run every backward as I (input gradient) then W (weight gradient).
    ``plan``: the plan to run as it is (``--pipeline-reuse-plan``; ``None``: built from
    ``placement`` and ``schedule`` for the micro-batches of each call). ``auto_iterations``:
    with ``--pipeline-reuse auto``, the training calls profiled before the plan is tuned
    and switched (:mod:`megatron_prt.megatron.auto`; 0: off)."""

    placement: Placement
    num_layers: int
    stage_layers: tuple[int, ...] | None = None
    trace_path: str | None = None
    schedule: str = "prt"
    timeout_s: float = 60.0
    split_backward: bool = False
    plan: Plan | None = None
    auto_iterations: int = 0

    def __post_init__(self) -> None:
        self.layers_per_stage()  # refuse impossible counts at construction
        if self.plan is not None and self.plan.placement != self.placement:
            raise ConfigError("--pipeline-reuse-plan: the plan's placement is not the flags'")
        if not self.timeout_s > 0:
            raise ConfigError(f"--pipeline-reuse-timeout must be > 0 seconds, got {self.timeout_s}")

    def layers_per_stage(self) -> tuple[int, ...]:
        """Layer count of every model stage ``0..D-1``; raises :class:`ConfigError`."""
        depth = self.placement.depth
        return stage_layer_counts(
            self.num_layers,
            depth,
            self.stage_layers,
            name="--pipeline-reuse-stage-layers",
            total=f"--num-layers {self.num_layers}",
            fix=f"use at least {depth} layers or lower --pipeline-reuse",
        )

    def layer_offset(self, model_stage: int) -> int:
        """Global index of the first layer of ``model_stage`` (0-based)."""
        return sum(self.layers_per_stage()[:model_stage])
