"""One entry of a per-layer cost model (a transformer layer, the embedding or the head):
its times for one micro-batch and its bytes; :mod:`megatron_prt.sim.cost` has the file
format and what each key means.

[Note: the split form's own costs] A layer whose backward is split into I and W does not
cost what its whole backward costs: its forward keeps what W needs (the split-capable
linear layer's own autograd function), and W runs apart from I, a second pass over
operands that left the caches (on CPU the tuned grid's profile, benchmarks/tuned_grid.py,
measured the forward about 12% and I + W about 10% over the whole form's). ``split_fwd`` /
``split_bwd`` give the split form's forward and I + W where they were measured;
:meth:`LayerCost.split_form` swaps them in, and every price of a plan with I and W takes
that form (:meth:`~megatron_prt.sim.cost.CostModel.split_form`). Absent, the split form
costs the whole form's times, as before.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from ..core.placement import ConfigError

# fp32 Adam keeps weight, gradient and two moments (4 bytes each) per parameter: the
# gradient is a quarter of ``param``. Used where no ``grad`` bytes are given.
PARAM_BYTES_PER_GRAD_BYTE = 4.0


@dataclass(frozen=True)
class LayerCost:
    """One layer (or the embedding, or the head) for one micro-batch: times in the cost
    model's unit, bytes in bytes."""

    fwd: float
    bwd: float
    act: float = 0.0  # activation bytes kept for backward, one micro-batch
    param: float = 0.0  # parameter (+ grad + optimizer state) bytes
    grad: float | None = None  # gradient bytes; None: param / PARAM_BYTES_PER_GRAD_BYTE
    wgrad: float | None = None  # W's part of the (split form's) bwd; None: the model's fraction
    wact: float | None = None  # bytes of act W still needs after I; None: the model's share
    full_act: float | None = None  # full recompute, a block of one: bytes kept (its input)
    full_bwd: float | None = None  # ... and backward time with the rerun forward
    selective_act: float | None = None  # selective recompute: bytes kept
    selective_bwd: float | None = None  # ... and backward time with the rerun attention core
    split_fwd: float | None = None  # split backward: the forward's time; None: fwd
    split_bwd: float | None = None  # ... and I + W; None: bwd ([Note: the split form's own costs])
    in_act: float | None = None  # input bytes held only when it begins a stage; None: in act
    out_bytes: float | None = None  # what a stage it ends sends (its output); None: the model's

    def __post_init__(self) -> None:
        for name in LAYER_NUMBERS:
            value = getattr(self, name)
            if name not in ("fwd", "bwd", "act", "param") and value is None:
                continue
            if not isinstance(value, (int, float)) or not value >= 0:
                raise ConfigError(f"layer cost {name} must be a number >= 0, got {value!r}")
        whole = "bwd" if self.split_bwd is None else "split_bwd"
        if self.wgrad is not None and self.wgrad > getattr(self, whole):
            raise ConfigError(
                f"layer cost wgrad ({self.wgrad}) is part of {whole} ({getattr(self, whole)}); "
                f"give wgrad <= {whole}"
            )

    def split_form(self) -> LayerCost:
        """This entry as its backward split into I and W costs ([Note: the split form's own
        costs]): ``split_fwd`` / ``split_bwd`` as ``fwd`` / ``bwd`` where given."""
        if self.split_fwd is None and self.split_bwd is None:
            return self
        fwd = self.fwd if self.split_fwd is None else self.split_fwd
        bwd = self.bwd if self.split_bwd is None else self.split_bwd
        return replace(self, fwd=fwd, bwd=bwd, split_fwd=None, split_bwd=None)

    def wgrad_act(self, keep_fraction: float) -> float:
        """Bytes held from I until W: ``wact``, or ``keep_fraction`` of ``act``."""
        return keep_fraction * self.act if self.wact is None else self.wact

    def wgrad_time(self, fraction: float) -> float:
        """Weight-gradient time: ``wgrad``, or ``fraction`` of ``bwd`` when not given."""
        return fraction * self.bwd if self.wgrad is None else self.wgrad

    @property
    def grad_bytes(self) -> float:
        """Gradient bytes: ``grad``, or the fp32-Adam share of ``param`` when not given."""
        return self.param / PARAM_BYTES_PER_GRAD_BYTE if self.grad is None else self.grad

    def recomputed(self, granularity: str, message_bytes: float) -> tuple[float, float]:
        """``(bytes kept, backward time)`` of this layer recomputed under ``granularity``
        (``full``: as a block of one); the module docstring says where they come from."""
        act, bwd = getattr(self, f"{granularity}_act"), getattr(self, f"{granularity}_bwd")
        if granularity == "full":
            act = message_bytes if act is None else act
            bwd = self.bwd + self.fwd if bwd is None else bwd
        return act, bwd

    def times_scaled(self, factor: float) -> LayerCost:
        """This entry with every time (``fwd``, ``bwd`` and the optional ones) times ``factor``."""
        given = {k: getattr(self, k) for k in LAYER_TIMES if getattr(self, k) is not None}
        return replace(self, **{k: v * factor for k, v in given.items()})

    def split_scaled(self, factor: float) -> LayerCost:
        """This entry with its split form's own times times ``factor``: ``split_fwd`` and
        ``split_bwd`` (from ``fwd`` and ``bwd`` where not given: the split form then starts
        as the plain one) and ``wgrad`` where given; the plain times unchanged."""
        form = self.split_form()  # fwd, bwd as the split form has them
        fields = {"split_fwd": form.fwd * factor, "split_bwd": form.bwd * factor}
        if self.wgrad is not None:
            fields["wgrad"] = self.wgrad * factor
        return replace(self, **fields)

    def plain_form(self) -> LayerCost:
        """This entry without the split form's own times: a split backward priced as the
        plain ``bwd`` with W taking its share of the split form's (``wgrad / split_bwd``);
        what a schedule that splits plain layers' backward with autograd runs (torch's
        zero-bubble orders), not megatron-prt's split layers."""
        if self.split_fwd is None and self.split_bwd is None:
            return self
        wgrad = self.wgrad
        if wgrad is not None and self.split_bwd:
            wgrad = wgrad * self.bwd / self.split_bwd
        return replace(self, split_fwd=None, split_bwd=None, wgrad=wgrad)

    def to_dict(self) -> dict:
        """Optional keys left unset are absent rather than null: older readers accept that."""
        return {k: v for k, v in asdict(self).items() if v is not None or k in LAYER_NUMBERS[:4]}

    @classmethod
    def from_dict(cls, data: dict, where: str) -> LayerCost:
        """``where`` names the entry in error messages (e.g. ``layers[3]``)."""
        if not isinstance(data, dict):
            raise ConfigError(f"cost {where} must be an object with fwd, bwd, act, param")
        if set(data) - set(LAYER_NUMBERS) or not {"fwd", "bwd"} <= set(data):
            raise ConfigError(
                f"cost {where} has keys {sorted(data)}; it needs fwd and bwd, optionally "
                f"{', '.join(LAYER_NUMBERS[2:])}"
            )
        try:  # "layer cost fwd ..." -> "cost layers[3]: fwd ..."
            return cls(**data)
        except ConfigError as exc:
            raise ConfigError(f"cost {where}: {str(exc).removeprefix('layer cost ')}") from None


def messages_after(layers, embedding: LayerCost | None, unknown: float | None) -> list:
    """``out[k]``, ``k = 0 .. len(layers)``: the bytes a stage ending after the first ``k``
    layers sends (``k = 0``: after the embedding), which is also layer ``k``'s input (what
    a recomputed layer or block keeps): that entry's ``out_bytes``, ``unknown`` where it
    gives none."""
    return [
        unknown if e is None or e.out_bytes is None else e.out_bytes for e in (embedding, *layers)
    ]


LAYER_NUMBERS = tuple(LayerCost.__dataclass_fields__)  # fwd, bwd, act, param, then optional
LAYER_TIMES = ("fwd", "bwd", "wgrad", "full_bwd", "selective_bwd", "split_fwd", "split_bwd")
