"""Cost model: how long stages take, what they hold, what crosses the wire.

Times are in any unit you like (the simulator reports in the same unit); bytes are bytes.
Either give whole-model totals (split evenly over the D stages) or per-layer costs plus
per-stage layer counts (a layer partition). Loadable from JSON::

    {"fwd_time": 3.0, "bwd_time": 6.0, "p2p_latency": 0.01, "p2p_bandwidth": 1e9,
     "activation_bytes": 8e8, "param_bytes": 4e8, "message_bytes": 1.6e7}

or, per layer (``stage_layers`` optional, default as even as possible)::

    {"layers": [{"fwd": 0.1, "bwd": 0.2, "act": 1e7, "param": 5e6}, ...],
     "stage_layers": [3, 3, 2, 2], "p2p_latency": 0.01, "message_bytes": 1.6e7}

``layers`` are the transformer layers in model order. Work outside them goes in two optional
entries of the same shape: ``"embedding"`` (input embedding) always belongs to model stage 0,
``"head"`` (final norm, LM head / output layer and loss) always to model stage ``D-1``; each
adds its time, activation and parameter bytes to that stage on top of the stage's layers
(or on top of the stage's share of the whole-model totals when there is no ``layers`` list)::

    {"layers": [{"fwd": 0.1, "bwd": 0.2, "act": 1e7, "param": 5e6}, ...],
     "embedding": {"fwd": 0.01, "bwd": 0.02, "act": 2e6, "param": 1e8},
     "head": {"fwd": 0.3, "bwd": 0.6, "act": 5e7, "param": 1e8},
     "p2p_latency": 0.01, "p2p_bandwidth": 2e10, "p2p_cpu": 0.0, "message_bytes": 1.6e7}

Per entry: ``fwd``/``bwd`` the forward/backward time of one micro-batch, ``act`` the
activation bytes one micro-batch keeps from its forward until its backward, ``param`` the
bytes the weights cost while training (weights, gradients and optimizer state). Every key
but ``fwd`` and ``bwd`` is optional; ``p2p_bandwidth`` ``null`` (or absent) means free.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field

from ..core.placement import ConfigError, Placement
from ..core.timing import StageTimes


@dataclass(frozen=True)
class LayerCost:
    """One layer (or the embedding, or the head) for one micro-batch: times in the cost
    model's unit, bytes in bytes."""

    fwd: float
    bwd: float
    act: float = 0.0  # activation bytes kept for backward, one micro-batch
    param: float = 0.0  # parameter (+ grad + optimizer state) bytes

    def __post_init__(self) -> None:
        for name in ("fwd", "bwd", "act", "param"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value >= 0:
                raise ConfigError(f"layer cost {name} must be a number >= 0, got {value!r}")

    @classmethod
    def from_dict(cls, data: dict, where: str) -> LayerCost:
        """``where`` names the entry in error messages (e.g. ``layers[3]``)."""
        if not isinstance(data, dict):
            raise ConfigError(f"cost {where} must be an object with fwd, bwd, act, param")
        known = set(cls.__dataclass_fields__)
        if set(data) - known or not {"fwd", "bwd"} <= set(data):
            raise ConfigError(
                f"cost {where} has keys {sorted(data)}; it needs fwd and bwd, optionally "
                "act and param"
            )
        return cls(**data)


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
    embedding: LayerCost | None = None  # on model stage 0, on top of its layers
    head: LayerCost | None = None  # LM head + loss, on model stage D-1

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
        if self.stage_layers and min(self.stage_layers) < 0:
            raise ConfigError(f"stage_layers must be counts >= 0, got {list(self.stage_layers)}")
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
            out = [total / depth] * depth
        else:
            values = [getattr(layer, attr) for layer in self.layers]
            out, first = [], 0
            for count in self.layer_counts(depth):
                out.append(sum(values[first : first + count]))
                first += count
        if self.embedding is not None:
            out[0] += getattr(self.embedding, attr)
        if self.head is not None:
            out[-1] += getattr(self.head, attr)
        if attr == "act" and self.layers:
            counts = self.layer_counts(depth)
            out = [a + self.empty_stage_act(k, counts[k], depth) for k, a in enumerate(out)]
        return tuple(out)

    def empty_stage_act(self, stage: int, count: int, depth: int) -> float:
        """Activation bytes a stage with no layer keeps anyway: a runtime holds every
        stage's input for its backward, which a layer's ``act`` already includes (the
        profiler gives a layer its input) but an empty pass-through stage has nothing to
        carry. Stage 0 holds the data, the head its own input."""
        if count or stage == 0 or (stage == depth - 1 and self.head is not None):
            return 0.0
        return self.message_bytes

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
        for end in ("embedding", "head"):  # absent rather than null: older readers accept it
            if data[end] is None:
                del data[end]
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
        data["layers"] = tuple(
            LayerCost.from_dict(layer, f"layers[{i}]")
            for i, layer in enumerate(data.get("layers", ()))
        )
        data["stage_layers"] = tuple(data.get("stage_layers", ()))
        for end in ("embedding", "head"):
            if data.get(end) is not None:
                data[end] = LayerCost.from_dict(data[end], end)
        if data.get("p2p_bandwidth") is None:
            data.pop("p2p_bandwidth", None)
        return cls(**data)

    @classmethod
    def load(cls, path: str) -> CostModel:
        with open(path) as f:
            return cls.from_dict(json.load(f))
