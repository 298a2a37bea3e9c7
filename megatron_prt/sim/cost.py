"""Cost model: how long stages take, what they hold, what crosses the wire.

Times are in any unit you like (the simulator reports in the same unit); bytes are bytes.
Either give whole-model totals (split evenly over the D stages) or per-layer costs plus
per-stage layer counts (a layer partition). Loadable from JSON::

    {"fwd_time": 3.0, "bwd_time": 6.0, "p2p_latency": 0.01, "p2p_bandwidth": 1e9,
     "activation_bytes": 8e8, "param_bytes": 4e8, "message_bytes": 1.6e7}

or, per layer (``stage_layers`` optional, default as even as possible)::

    {"layers": [{"fwd": 0.1, "bwd": 0.2, "act": 1e7, "param": 5e6}, ...],
     "stage_layers": [3, 3, 2, 2], "p2p_latency": 0.01, "message_bytes": 1.6e7}
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field

from ..core.placement import ConfigError, Placement
from ..core.timing import StageTimes


@dataclass(frozen=True)
class LayerCost:
    fwd: float
    bwd: float
    act: float = 0.0  # activation bytes kept for backward, one micro-batch
    param: float = 0.0  # parameter (+ grad + optimizer state) bytes


@dataclass(frozen=True)
class CostModel:
    fwd_time: float = 1.0  # whole model, one micro-batch
    bwd_time: float = 2.0
    p2p_latency: float = 0.0  # per cross-rank message
    p2p_bandwidth: float = math.inf  # bytes per time unit
    p2p_cpu: float = 0.0  # rank time one message costs its sender and its receiver
    activation_bytes: float = 1.0  # whole model, one micro-batch
    param_bytes: float = 0.0  # whole model (one replica)
    message_bytes: float = 0.0  # one activation or gradient between stages
    layers: tuple[LayerCost, ...] = field(default=())
    stage_layers: tuple[int, ...] = field(default=())

    def __post_init__(self) -> None:
        for name in (
            "fwd_time",
            "bwd_time",
            "p2p_latency",
            "p2p_cpu",
            "activation_bytes",
            "param_bytes",
        ):
            if getattr(self, name) < 0:
                raise ConfigError(f"cost {name} must be >= 0, got {getattr(self, name)}")
        if self.p2p_bandwidth <= 0:
            raise ConfigError("cost p2p_bandwidth must be > 0")
        if self.stage_layers and sum(self.stage_layers) != len(self.layers):
            raise ConfigError(
                f"stage_layers sums to {sum(self.stage_layers)} but there are "
                f"{len(self.layers)} layers"
            )

    @property
    def hop_time(self) -> float:
        return self.p2p_latency + self.message_bytes / self.p2p_bandwidth

    def layer_counts(self, depth: int) -> tuple[int, ...]:
        if self.stage_layers:
            if len(self.stage_layers) != depth:
                raise ConfigError(
                    f"stage_layers has {len(self.stage_layers)} entries, the pipeline "
                    f"has D = {depth} stages"
                )
            return self.stage_layers
        base, extra = divmod(len(self.layers), depth)
        return tuple(base + (1 if k < extra else 0) for k in range(depth))

    def _per_stage(self, depth: int, total: float, attr: str) -> tuple[float, ...]:
        if not self.layers:
            return (total / depth,) * depth
        out, first = [], 0
        for count in self.layer_counts(depth):
            out.append(sum(getattr(layer, attr) for layer in self.layers[first : first + count]))
            first += count
        return tuple(out)

    def stage_times(self, placement: Placement) -> StageTimes:
        d = placement.depth
        return StageTimes(
            self._per_stage(d, self.fwd_time, "fwd"),
            self._per_stage(d, self.bwd_time, "bwd"),
            self.hop_time,
            self.p2p_cpu,
        )

    def stage_activation_bytes(self, placement: Placement) -> tuple[float, ...]:
        return self._per_stage(placement.depth, self.activation_bytes, "act")

    def stage_param_bytes(self, placement: Placement) -> tuple[float, ...]:
        return self._per_stage(placement.depth, self.param_bytes, "param")

    # -- JSON ------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        data = asdict(self)
        data["layers"] = [asdict(layer) for layer in self.layers]
        data["stage_layers"] = list(self.stage_layers)
        if math.isinf(self.p2p_bandwidth):
            data["p2p_bandwidth"] = None
        return data

    @classmethod
    def from_dict(cls, data: dict) -> CostModel:
        known = {f for f in cls.__dataclass_fields__}
        unknown = set(data) - known
        if unknown:
            raise ConfigError(f"unknown cost keys {sorted(unknown)}; known: {sorted(known)}")
        data = dict(data)
        data["layers"] = tuple(LayerCost(**layer) for layer in data.get("layers", ()))
        data["stage_layers"] = tuple(data.get("stage_layers", ()))
        if data.get("p2p_bandwidth") is None:
            data.pop("p2p_bandwidth", None)
        return cls(**data)

    @classmethod
    def load(cls, path: str) -> CostModel:
        with open(path) as f:
            return cls.from_dict(json.load(f))
