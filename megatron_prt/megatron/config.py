"""What ``--pipeline-reuse*`` resolves to: one frozen value every module of the integration reads.

Kept free of megatron imports so flags can be validated (and tested) before megatron loads.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core.placement import ConfigError, Placement


def check_layers_fill_stages(num_layers: int, depth: int, layers: str, reuse: str) -> None:
    """The rule for a split chosen from the layer count (uniform, or the partitioner's):
    ``num_layers`` must give each of the ``depth`` = R*P stages a layer. ``layers`` and
    ``reuse`` name the flags the count and R came from; raises :class:`ConfigError`."""
    if num_layers < depth:
        raise ConfigError(
            f"{layers} {num_layers} cannot fill D = R*P = {depth} stages; "
            f"use at least {depth} layers or lower {reuse}"
        )


@dataclass(frozen=True)
class ReuseConfig:
    """``placement``: P, R, loop|wave, uni|bi. ``stage_layers``: transformer layers of each
    model stage ``0..D-1`` in flow order (``None``: as even as possible, earlier stages take the
    remainder). ``trace_path``: where a traced iteration's Chrome trace goes (``None``: off).
    ``timeout_s``: how long a rank waits on a peer before :class:`PipelineError`."""

    placement: Placement
    num_layers: int
    stage_layers: tuple[int, ...] | None = None
    trace_path: str | None = None
    schedule: str = "prt"
    timeout_s: float = 60.0

    def __post_init__(self) -> None:
        self.layers_per_stage()  # refuse impossible counts at construction
        if not self.timeout_s > 0:
            raise ConfigError(f"--pipeline-reuse-timeout must be > 0 seconds, got {self.timeout_s}")

    def layers_per_stage(self) -> tuple[int, ...]:
        """Layer count of every model stage ``0..D-1``; raises :class:`ConfigError`."""
        depth = self.placement.depth
        if self.stage_layers is None:
            check_layers_fill_stages(self.num_layers, depth, "--num-layers", "--pipeline-reuse")
            base, extra = divmod(self.num_layers, depth)
            return tuple(base + (1 if k < extra else 0) for k in range(depth))
        counts = tuple(self.stage_layers)
        if len(counts) != depth or sum(counts) != self.num_layers or min(counts) < 0:
            raise ConfigError(
                f"--pipeline-reuse-stage-layers {','.join(map(str, counts))} must give D = R*P "
                f"= {depth} counts >= 0 that sum to --num-layers {self.num_layers}"
            )
        return counts

    def layer_offset(self, model_stage: int) -> int:
        """Global index of the first layer of ``model_stage`` (0-based)."""
        return sum(self.layers_per_stage()[:model_stage])
