"""Cost model: how long stages take, what they hold, what crosses the wire.

Times are in any unit you like (the simulator reports in the same unit); bytes are bytes.
Either give whole-model totals (split evenly over the D stages) or per-layer costs plus
per-stage layer counts (a layer partition). Loadable from JSON::

    {"fwd_time": 3.0, "bwd_time": 6.0, "p2p_latency": 0.01, "p2p_bandwidth": 1e9,
     "activation_bytes": 8e8, "param_bytes": 4e8, "message_bytes": 1.6e7}

or, per layer (``stage_layers`` optional, default as even as possible)::

    {"layers": [{"fwd": 0.1, "bwd": 0.2, "act": 1e7, "param": 5e6}, ...],
     "stage_layers": [3, 3, 2, 2], "p2p_latency": 0.01, "message_bytes": 1.6e7}

``"model"`` (optional, not priced) names the shape measured: :mod:`~megatron_prt.sim.model_shape`.
``layers`` are the transformer layers in model order. Work outside them goes in two optional
entries of the same shape: ``"embedding"`` (input embedding) always belongs to model stage 0,
``"head"`` (final norm, LM head / output layer and loss) always to model stage ``D-1``; each
adds its time, activation and parameter bytes to that stage on top of the stage's layers
(or on top of the stage's share of the whole-model totals when there is no ``layers`` list)::

    {"layers": [{"fwd": 0.1, "bwd": 0.2, "act": 1e7, "param": 5e6}, ...],
     "embedding": {"fwd": 0.01, "bwd": 0.02, "act": 2e6, "param": 1e8},
     "head": {"fwd": 0.3, "bwd": 0.6, "act": 5e7, "param": 1e8},
     "p2p_latency": 0.01, "p2p_bandwidth": 2e10, "p2p_cpu": 0.0, "message_bytes": 1.6e7}

``"stage"`` (optional, the same shape, times only) is what every model stage's step does
around its parts: megatron's ``forward_step`` / ``backward_step`` and the model chunk's own
forward (rotary embeddings, masks). [Note: every stage pays its step's work] A profile of
one whole pass runs one step, so that work lands once, in the embedding's forward and the
head's backward, where a pipeline of D stages pays it D times (0.1-0.2 ms a stage on CPU):
plans of more stages looked cheaper than they run. `megatron-prt profile` times it on a
middle chunk, writes it as ``stage`` and takes it out of the embedding and the head, so
the first and last stages cost what they did and every other stage pays it too.

Per entry: ``fwd``/``bwd`` the forward/backward time of one micro-batch, ``act`` the
activation bytes one micro-batch keeps from its forward until its backward, ``param`` the
bytes the weights cost while training (weights, gradients and optimizer state), ``grad``
the bytes of the gradients alone (what direction ``bi`` sums between the two replicas),
``out_bytes`` the output a stage ending with the entry sends (its gradient back the same):
where given, each cut's hop is priced on its own message (:meth:`CostModel.cut_message_bytes`),
else on ``message_bytes``; ``in_act`` the input bytes an entry holds only when it begins a
stage (else in ``act``). All but ``fwd``, ``bwd`` are optional; ``p2p_bandwidth`` ``null``
(or absent) means free.

Replica-gradient sum (direction ``bi`` only). After the iteration's last backward, every
rank sums its stages' gradients with their replicas on the mirrored rank ``P-1-r``
(:mod:`megatron_prt.runtime.replicas`): each of the two ranks sends the gradients of all
its stages and adds what it receives. The exchange of a rank pair starts when both have
finished their step and costs both of them::

    replica_latency + sent_bytes / replica_bandwidth + sent_bytes / replica_add_bandwidth

where ``sent_bytes`` is the sum of ``grad`` over the rank's stages (the same both ways).
With odd P the middle rank holds both replicas of its stages and only adds (no latency, no
transfer). All three default to free, which leaves every prediction without the sum::

    {"fwd_time": 3.0, "bwd_time": 6.0, "param_bytes": 1.6e9, "grad_bytes": 4e8,
     "replica_latency": 0.02, "replica_bandwidth": 2e10, "replica_add_bandwidth": 5e10}

Tied embedding sum (``tied_grad_bytes``, default 0: none). A model that ties its input
embedding to its output weight (megatron's GPT by default, BERT) holds a copy on each
pipeline's first and last stage and sums their gradients after the step, after any
replica sum (:mod:`megatron_prt.sim.replica_sync`). ``tied_grad_bytes`` is one copy's
gradient; the sum is priced at the ``replica_*`` costs (a pairwise exchange and add like
the replica sum's; megatron-prt runs it over the process group, gloo on CPU, where the
runtime sums replicas over its own transport: on CPU the shared-memory figures price it
low); with both stages on one rank (wave with even R; P = 1 with R >= 2) it is an add in place.

``grad`` (``grad_bytes`` for the whole model) defaults to ``param / 4``
(:data:`PARAM_BYTES_PER_GRAD_BYTE`): ``param`` counts 16 bytes per parameter in fp32 Adam
(weight, gradient and two moments, 4 bytes each), of which the gradient is 4.

Split backward (plans with I and W, :mod:`megatron_prt.core.zerobubble`). ``bwd`` stays the
whole backward; its weight-gradient share W is ``wgrad`` per entry (a time, at most
``bwd``), else ``wgrad_fraction`` of ``bwd`` (default 0.5); I is the rest. Where the split
form was measured, ``split_fwd`` and ``split_bwd`` (I + W; ``wgrad`` is then its part, at
most ``split_bwd``) are its forward and backward and price plans with I and W ([Note: the
split form's own costs] in :mod:`~megatron_prt.sim.layer_cost`; under recomputation,
:meth:`CostModel.split_form` says which layers take it). After I a stage
still holds, until W, ``wact`` bytes per entry (what its weight GEMMs need: their inputs and
output gradients, as measured by
:func:`~megatron_prt.runtime.wgrad.measure_split_memory`), else ``wgrad_keep_fraction`` of
the entry's ``act`` (default :data:`~megatron_prt.core.zerobubble.WGRAD_KEEP_FRACTION`,
docs/theory.md section 8); :meth:`CostModel.stage_wgrad_keep` gives the share per stage.
Files without these keys load as before and describe a backward split in half::

    {"fwd_time": 3.0, "bwd_time": 6.0, "wgrad_fraction": 0.4, "wgrad_keep_fraction": 0.9}
    {"layers": [{"fwd": 1, "bwd": 2, "wgrad": 1, "act": 8e6, "wact": 8e6}, ...],
     "head": {"fwd": 0.1, "bwd": 0.1, "act": 4e6, "wact": 0}}

Activation recomputation (megatron's ``recompute_granularity``, ``recompute_method``,
``recompute_num_layers``, same names, same rules; needs per-layer costs). Megatron
recomputes transformer layers only (never the embedding or the head), per model chunk,
which under PRT is per model stage:

* ``full``, ``uniform``: a stage's layers form blocks of ``recompute_num_layers``; a block
  keeps only its input (its first layer's) and reruns its forward in the backward
  (megatron runs whole blocks only: a stage's layer count must be a multiple, which the
  partitioner keeps to; other splits are priced with a shorter last block);
* ``full``, ``block``: the first ``recompute_num_layers`` layers of each stage are
  recomputed one by one (each keeps its input), the rest keep everything;
* ``selective``: every layer keeps all but its attention core (softmax, dropout, the
  ``seq**2`` scores) and reruns that core in the backward.

A recomputed layer's numbers are per entry: ``full_act`` / ``full_bwd`` (the layer as a
block of one: bytes it keeps, backward time with the rerun forward) and ``selective_act``
/ ``selective_bwd``; ``megatron-prt profile --recompute-granularity ...`` measures them.
Without ``full_*`` they are derived: ``full_act`` = the layer's input (the entry before
it's ``out_bytes``, else ``message_bytes``), ``full_bwd = bwd + fwd``; ``selective``
has no derivation and needs measured values. The bytes megatron re-materialises during a
recomputed backward are transient (freed within that backward) and, like a forward's
transients, not counted (:func:`megatron_prt.sim.simulate.held_activations`).

[Note: full recomputation has no W] Under split backward megatron-prt defers weight
gradients of linear layers that run inside a split forward; a fully recomputed layer reruns
its forward inside I, outside it, so its weight gradients are computed in I: such a layer
has no W time and holds nothing after I (measured: a recomputed stage's peak under split
backward equals its peak without). Selective recomputation reruns only the attention core
and keeps the W split of its linear layers::

    {"layers": [{"fwd": 0.1, "bwd": 0.2, "act": 1e7, "full_act": 1.6e6, "full_bwd": 0.31}],
     "recompute_granularity": "full", "recompute_method": "uniform",
     "recompute_num_layers": 1, "message_bytes": 1.6e6}
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from itertools import accumulate

from ..core.layers import check_stage_layers, even_layers
from ..core.placement import ConfigError, Placement
from ..core.timing import StageTimes
from ..core.zerobubble import WGRAD_KEEP_FRACTION
from .cost_checks import (
    check_bytes_on_every_layer,
    check_recompute_costs,
    check_some_compute,
    check_stage_entry,
    check_value_types,
    read_json,
)
from .layer_cost import PARAM_BYTES_PER_GRAD_BYTE, LayerCost, messages_after
from .model_shape import check_shape
from .recompute import KEPT, RECOMPUTED_IN_BLOCK, fold_blocks, layer_roles, runs_whole_blocks

# Share of a backward that is weight-gradient work when a cost model does not say.
DEFAULT_WGRAD_FRACTION = 0.5

_NON_NEGATIVE = (  # CostModel's fields that may be 0
    "fwd_time bwd_time p2p_latency p2p_cpu activation_bytes param_bytes message_bytes "
    "replica_latency tied_grad_bytes"
).split()


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
    grad_bytes: float | None = None  # whole model (one replica); None: param_bytes / 4
    replica_latency: float = 0.0  # bi (and tied sums): per exchange between two ranks
    replica_bandwidth: float = math.inf  # bi: gradient bytes per time unit, each way
    replica_add_bandwidth: float = math.inf  # bi: received gradient bytes summed per time unit
    tied_grad_bytes: float = 0.0  # one copy of the tied embedding / output weight's gradient
    wgrad_fraction: float | None = None  # split backward: W share of bwd; None: 0.5
    wgrad_keep_fraction: float = WGRAD_KEEP_FRACTION  # share of act W holds after I
    recompute_granularity: str | None = None  # megatron's: None, "full" or "selective"
    recompute_method: str | None = None  # full: "uniform" or "block"
    recompute_num_layers: int | None = None  # full: layers per block / recomputed per stage
    kept_split: bool = False  # full: kept layers in the split form (split_form() sets it)
    model: dict | None = field(default=None, compare=False)  # the shape measured, not priced
    stage: LayerCost | None = None  # on every model stage: the step's work around its parts

    def __post_init__(self) -> None:
        for name in _NON_NEGATIVE:  # `not >=`: NaN is refused too
            if not getattr(self, name) >= 0:
                raise ConfigError(f"cost {name} must be >= 0, got {getattr(self, name)}")
        if self.grad_bytes is not None and not self.grad_bytes >= 0:
            raise ConfigError(f"cost grad_bytes must be >= 0, got {self.grad_bytes}")
        for name in ("p2p_bandwidth", "replica_bandwidth", "replica_add_bandwidth"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"cost {name} must be > 0, got {getattr(self, name)}")
        for name in ("wgrad_fraction", "wgrad_keep_fraction"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= 1:
                raise ConfigError(f"cost {name} must be in [0, 1], got {value}")
        if self.stage is not None:
            object.__setattr__(self, "stage", check_stage_entry(self.stage))
        if self.stage_layers:  # the depth is checked where it is known: layer_counts
            check_stage_layers(self.stage_layers, len(self.layers))
        check_recompute_costs(self)

    def with_recompute(
        self, granularity: str | None, method: str | None = None, num_layers: int | None = None
    ) -> CostModel:
        """This cost model under megatron's recomputation setting (``None``: off)."""
        return replace(
            self,
            recompute_granularity=granularity,
            recompute_method=method,
            recompute_num_layers=num_layers,
            kept_split=self.kept_split and granularity == "full",
        )

    def split_form(self) -> CostModel:
        """This model as plans with I and W cost it: every entry's split form ([Note: the
        split form's own costs] in :mod:`~megatron_prt.sim.layer_cost`); itself when no
        entry gives one. :func:`~megatron_prt.sim.simulate.simulate` prices such plans so."""
        parts = (*self.layers, self.embedding, self.head)
        if all(p is None or (p.split_fwd is None and p.split_bwd is None) for p in parts):
            return self
        end = lambda part: None if part is None else part.split_form()  # noqa: E731
        layers = tuple(self._split_layer(layer) for layer in self.layers)
        kept_split = self.recompute_granularity == "full"
        return replace(
            self,
            layers=layers,
            embedding=end(self.embedding),
            head=end(self.head),
            stage=end(self.stage),
            kept_split=kept_split,
        )

    def plain_form(self) -> CostModel:
        """This model with every entry's :meth:`LayerCost.plain_form`: split plans priced
        as plain layers whose backward autograd splits (torch's zero-bubble peers)."""
        return self._each_entry(LayerCost.plain_form)

    def _each_entry(self, change: Callable[[LayerCost], LayerCost], **fields) -> CostModel:
        """This model with ``change`` applied to every entry (layers, embedding, head,
        stage) and ``fields`` replaced."""
        embedding, head, stage = (p and change(p) for p in (self.embedding, self.head, self.stage))
        layers = tuple(map(change, self.layers))
        return replace(self, layers=layers, embedding=embedding, head=head, stage=stage, **fields)

    def _split_layer(self, layer: LayerCost) -> LayerCost:
        """A transformer layer's split form under this model's recomputation: ``full``
        reruns its layers plain, without W ([Note: full recomputation has no W]), so they
        stay whole here and the block method's kept layers, which do split, take the split
        form by their role (``kept_split``, :meth:`_kept`); ``selective`` splits its
        linear layers, so its recomputed backward moves by what splitting adds to the
        whole one."""
        if self.recompute_granularity == "full":
            return layer
        form = layer.split_form()
        if layer.selective_bwd is not None and layer.split_bwd is not None:
            form = replace(form, selective_bwd=layer.selective_bwd + layer.split_bwd - layer.bwd)
        return form

    def folded_recompute(self) -> tuple[CostModel, int]:
        """``(model, unit)``: this model (``stage_layers`` dropped) with recomputation folded
        into plain per-layer costs, where megatron's treatment of a layer does not depend on
        the split. For ``selective`` (``unit`` 1) every layer takes its recomputed numbers.
        For ``full``,
        ``uniform`` every block of ``unit = recompute_num_layers`` layers becomes one layer
        (its first layer's kept bytes, the summed times): a split of the folded layers,
        times ``unit``, splits this model into whole blocks, which megatron's uniform
        method needs per stage, and costs the same. ``block`` (and no recomputation):
        ``(self, 1)``, whose per-stage costs depend on the split (:meth:`layer_roles`)."""
        granularity, method = self.recompute_granularity, self.recompute_method
        if granularity is None or method == "block":
            return self, 1
        unit = self.recompute_num_layers or 1
        if len(self.layers) % unit:
            raise ConfigError(
                f"recompute_num_layers {unit} (--recompute-num-layers, or the cost file's "
                f'"recompute_num_layers") does not divide the {len(self.layers)} layers; '
                "megatron's uniform method recomputes whole blocks of each stage: give a "
                f"block size that divides {len(self.layers)}, or --recompute-method block"
            )
        inputs = messages_after(self.layers, self.embedding, self.message_bytes)[:-1]
        folded = fold_blocks(self.layers, unit, granularity, inputs)
        model = replace(self.with_recompute(None), layers=folded, stage_layers=(), kept_split=False)
        return model, unit

    def runs_whole_blocks(self, counts: tuple[int, ...]) -> bool:
        """Whether megatron can run stages of ``counts`` layers under this recomputation
        (:func:`~.recompute.runs_whole_blocks`)."""
        setting = (self.recompute_granularity, self.recompute_method, self.recompute_num_layers)
        return runs_whole_blocks(setting, counts)

    def layer_roles(self, counts: tuple[int, ...]) -> list[str]:
        """Per transformer layer (model order), with stages of ``counts`` layers: what
        megatron does with it under this model's setting (:func:`~.recompute.layer_roles`)."""
        setting = (self.recompute_granularity, self.recompute_method, self.recompute_num_layers)
        return layer_roles(setting, counts)

    def layer_act_bwd(self, counts: tuple[int, ...]) -> list[tuple[float, float]]:
        """Per transformer layer: ``(bytes kept for backward, backward time)`` under the
        recomputation setting, with stages of ``counts`` layers (:meth:`layer_roles`)."""
        out = []
        inputs = messages_after(self.layers, self.embedding, self.message_bytes)[:-1]
        roles = self.layer_roles(counts)
        for layer, role, size in zip(self.layers, roles, inputs, strict=True):
            if role == KEPT:
                out.append((layer.act, self._kept(layer).bwd))
                continue
            act, bwd = layer.recomputed(self.recompute_granularity, size)
            out.append((0.0 if role == RECOMPUTED_IN_BLOCK else act, bwd))
        return out

    @property
    def hop_time(self) -> float:
        return self.p2p_latency + self.message_bytes / self.p2p_bandwidth

    @property
    def whole_grad_bytes(self) -> float:
        """``grad_bytes``, or the fp32-Adam share of ``param_bytes`` when not given."""
        if self.grad_bytes is None:
            return self.param_bytes / PARAM_BYTES_PER_GRAD_BYTE
        return self.grad_bytes

    @property
    def has_replica_cost(self) -> bool:
        """Whether the sums after the step (bi replicas, tied embeddings) take any time."""
        return bool(
            self.replica_latency
            or not math.isinf(self.replica_bandwidth)
            or not math.isinf(self.replica_add_bandwidth)
        )

    def compute_scaled(self, factor: float) -> CostModel:
        """Every compute time (layers, embedding, head, whole-model totals) times ``factor``;
        messages, the replica sum and bytes unchanged (a calibration: tune/measured.py)."""
        totals = {"fwd_time": self.fwd_time * factor, "bwd_time": self.bwd_time * factor}
        return self._each_entry(lambda part: part.times_scaled(factor), **totals)

    def split_scaled(self, factor: float) -> CostModel:
        """The split form's own times (:meth:`LayerCost.split_scaled`: layers, embedding,
        head, stage) times ``factor``; what plans without split backward cost is unchanged
        (a calibration: tune/measured.py)."""
        return self._each_entry(lambda part: part.split_scaled(factor))

    def without_replica_sync(self) -> CostModel:
        """This cost model with free sums after the step (the replica and tied sums)."""
        return replace(
            self, replica_latency=0.0, replica_bandwidth=math.inf, replica_add_bandwidth=math.inf
        )

    def replica_sync_time(self, sent_bytes: float, added_bytes: float, remote: bool) -> float:
        """Time one rank spends on a sum after the step (bi replicas, tied embeddings):
        ``replica_latency`` when its peer is another rank (``remote``), ``sent_bytes``
        (also received) over ``replica_bandwidth``, ``added_bytes`` summed at
        ``replica_add_bandwidth``."""
        latency = self.replica_latency if remote else 0.0
        return (
            latency + sent_bytes / self.replica_bandwidth + added_bytes / self.replica_add_bandwidth
        )

    def layer_counts(self, depth: int) -> tuple[int, ...]:
        """Layers of every model stage: ``stage_layers``, or the even split."""
        if self.stage_layers:
            return check_stage_layers(self.stage_layers, len(self.layers), depth)
        return even_layers(len(self.layers), depth)

    def _per_stage(self, depth: int, total: float, attr) -> tuple[float, ...]:
        """``attr``: a :class:`LayerCost` field name, or a function of a layer cost."""
        value = attr if callable(attr) else (lambda layer: getattr(layer, attr))
        if not self.layers:
            out = [total / depth] * depth
        else:
            values = [value(layer) for layer in self.layers]
            if self.recompute_granularity is not None and attr in ("act", "bwd"):
                pairs = self.layer_act_bwd(self.layer_counts(depth))
                values = [pair[attr == "bwd"] for pair in pairs]
            elif self.kept_split and attr == "fwd":
                roles = self.layer_roles(self.layer_counts(depth))
                values = [
                    self._kept(layer).fwd if role == KEPT else layer.fwd
                    for layer, role in zip(self.layers, roles, strict=True)
                ]
            out, first = [], 0
            for count in self.layer_counts(depth):
                out.append(sum(values[first : first + count]))
                first += count
        if self.embedding is not None:
            out[0] += value(self.embedding)
        if self.head is not None:
            out[-1] += value(self.head)
        if self.stage is not None:  # [Note: every stage pays its step's work]
            out = [total + value(self.stage) for total in out]
        if attr == "act" and self.layers:
            counts = self.layer_counts(depth)
            out = [a + self.stage_input_act(k, counts, depth) for k, a in enumerate(out)]
        return tuple(out)

    def stage_input_act(self, stage: int, counts: Sequence[int], depth: int) -> float:
        """Bytes of its input a stage keeps beyond its layers' ``act``: a runtime holds every
        stage's received input for its backward. A layer's ``act`` includes its input (the
        profiler's do) unless it gives ``in_act`` (analytic units that count their input as
        the previous unit's output, true only on one rank): the stage's first layer's, or
        the head's when the stage holds no layer. A stage with neither keeps the message it
        passes on. Stage 0 holds the data."""
        if stage == 0:
            return 0.0
        if counts[stage]:
            first = self.layers[sum(counts[:stage])]
        elif stage == depth - 1 and self.head is not None:
            first = self.head
        else:
            return self.cut_message_bytes(counts)[stage - 1]
        if self.recompute_granularity is not None:  # what it keeps is priced with it
            return 0.0
        return first.in_act or 0.0

    def _kept(self, layer: LayerCost) -> LayerCost:
        """``layer`` as it runs when megatron keeps it: its split form under ``kept_split``."""
        return layer.split_form() if self.kept_split else layer

    def stage_times(self, placement: Placement) -> StageTimes:
        """Per stage times; per cut hops where entries give ``out_bytes``, else :attr:`hop_time`."""
        d = placement.depth
        hop: float | tuple[float, ...] = self.hop_time
        if any(p is not None and p.out_bytes is not None for p in (*self.layers, self.embedding)):
            hop = self.cut_hop_times(self.layer_counts(d))
        return StageTimes(
            self._per_stage(d, self.fwd_time, "fwd"),
            self._per_stage(d, self.bwd_time, "bwd"),
            hop,
            self.p2p_cpu,
            self.stage_wgrad_times(d),
        )

    def cut_hop_times(self, counts: Sequence[int]) -> tuple[float, ...]:
        """Each cut's hop, ``p2p_latency + bytes / p2p_bandwidth`` (:meth:`cut_message_bytes`)."""
        cuts = self.cut_message_bytes(counts)
        return tuple(self.p2p_latency + size / self.p2p_bandwidth for size in cuts)

    def cut_message_bytes(self, counts: Sequence[int]) -> tuple[float, ...]:
        """Bytes crossing each cut (``k``: after stage ``k``) of stages of ``counts`` layers:
        ``out_bytes`` of the last layer before it (the embedding's before every layer; an
        empty stage passes on what it received), ``message_bytes`` where it gives none."""
        sent = messages_after(self.layers, self.embedding, self.message_bytes)
        return tuple(sent[done] for done in accumulate(counts[:-1]))

    def stage_wgrad_times(self, depth: int) -> tuple[float, ...] | None:
        """Weight-gradient (W) time of every model stage; ``None`` when the model gives no
        split (no ``wgrad_fraction``, no ``wgrad``): W is then half of every backward."""
        parts = [*self.layers, self.embedding, self.head]
        full = self.recompute_granularity == "full"
        if (
            self.wgrad_fraction is None
            and all(p is None or p.wgrad is None for p in parts)
            and not full
        ):
            return None
        fraction = self.wgrad_fraction
        if fraction is None:
            fraction = DEFAULT_WGRAD_FRACTION
        bwd = self._per_stage(depth, self.bwd_time, "bwd")
        wgt = self._per_stage(
            depth, fraction * self.bwd_time, lambda c: self._kept(c).wgrad_time(fraction)
        )
        if full:  # [Note: full recomputation has no W]
            layer_w = [self._kept(layer).wgrad_time(fraction) for layer in self.layers]
            recomputed = self._recomputed_sum(depth, layer_w)
            wgt = tuple(w - r for w, r in zip(wgt, recomputed, strict=True))
        return tuple(max(0.0, min(w, b)) for w, b in zip(wgt, bwd, strict=True))  # rounding

    def _recomputed_sum(self, depth: int, values: list[float]) -> list[float]:
        """Per model stage, the sum of ``values`` (one per layer) over its recomputed layers."""
        roles, out, first = self.layer_roles(self.layer_counts(depth)), [], 0
        for count in self.layer_counts(depth):
            chosen = range(first, first + count)
            out.append(sum(values[i] for i in chosen if roles[i] != KEPT))
            first += count
        return out

    def stage_activation_bytes(self, placement: Placement) -> tuple[float, ...]:
        return self._per_stage(placement.depth, self.activation_bytes, "act")

    def stage_wgrad_keep(self, placement: Placement) -> tuple[float, ...]:
        """Per model stage, the share of its kept activation bytes that split backward's W
        still needs after I (:func:`~megatron_prt.sim.simulate.held_activations`): the
        entries' ``wact``, else ``wgrad_keep_fraction`` of what they keep, over the stage's
        kept bytes; a fully recomputed layer holds nothing after I ([Note: full
        recomputation has no W]); a stage without activation bytes: ``wgrad_keep_fraction``.
        Above 1 where W's operands outweigh what the forward saved (the output gradients
        are new memory: a bare linear layer saves its input, W needs that and its output
        gradient)."""
        keep, depth = self.wgrad_keep_fraction, placement.depth
        act = self.stage_activation_bytes(placement)
        if not self.layers:
            held = [keep * self.activation_bytes / depth] * depth
        else:
            counts = self.layer_counts(depth)
            by_layer = [layer.wgrad_act(keep) for layer in self.layers]
            if self.recompute_granularity is not None:
                kept, roles = self.layer_act_bwd(counts), self.layer_roles(counts)
                full = self.recompute_granularity == "full"
                by_layer = [
                    0.0
                    if full and role != KEPT
                    else layer.wgrad_act(keep * bytes_kept / (layer.act or 1))
                    for layer, role, (bytes_kept, _) in zip(self.layers, roles, kept, strict=True)
                ]
            held, first = [], 0
            for count in counts:
                held.append(sum(by_layer[first : first + count]))
                first += count
        for index, end in ((0, self.embedding), (-1, self.head)):
            if end is not None:
                held[index] += end.wgrad_act(keep)
        return tuple(h / a if a > 0 else keep for h, a in zip(held, act, strict=True))

    def stage_param_bytes(self, placement: Placement) -> tuple[float, ...]:
        return self._per_stage(placement.depth, self.param_bytes, "param")

    def stage_grad_bytes(self, placement: Placement) -> tuple[float, ...]:
        """Gradient bytes of each model stage ``0..D-1`` (one replica)."""
        return self._per_stage(placement.depth, self.whole_grad_bytes, "grad_bytes")

    # -- JSON ------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        """The cost file's keys (``kept_split``, a pricing state of :meth:`split_form`, is
        none of them)."""
        data = asdict(self)
        del data["kept_split"]
        data["layers"] = [layer.to_dict() for layer in self.layers]
        data["stage_layers"] = list(self.stage_layers)
        for end in ("embedding", "head", "stage"):
            part = getattr(self, end)
            data[end] = None if part is None else part.to_dict()
        for key, default in _OPTIONAL_KEYS.items():  # absent: older readers accept the file
            if data[key] == default:
                del data[key]
        if math.isinf(self.p2p_bandwidth):
            data["p2p_bandwidth"] = None
        return data

    @classmethod
    def from_dict(cls, data: dict) -> CostModel:
        known = {f for f in cls.__dataclass_fields__} - {"kept_split"}  # see to_dict
        unknown = set(data) - known
        if unknown:
            raise ConfigError(f"unknown cost keys {sorted(unknown)}; known: {sorted(known)}")
        data = dict(data)
        check_bytes_on_every_layer(data)
        data["layers"] = tuple(
            LayerCost.from_dict(layer, f"layers[{i}]")
            for i, layer in enumerate(data.get("layers", ()))
        )
        data["stage_layers"] = tuple(data.get("stage_layers", ()))
        data["model"] = check_shape(data.get("model"))
        for end in ("embedding", "head", "stage"):
            if data.get(end) is not None:
                data[end] = LayerCost.from_dict(data[end], end)
        for key in ("p2p_bandwidth", "replica_bandwidth", "replica_add_bandwidth"):
            if data.get(key) is None:  # null: free
                data.pop(key, None)
        model = cls(**data)
        check_some_compute(model)
        return model

    @classmethod
    def load(cls, path: str) -> CostModel:
        """Read a cost JSON file (the format of the module docstring).

        Raises :class:`ConfigError` whose message starts with ``path`` and names the key at
        fault, for a missing or unreadable file, text that is not JSON, and JSON of the wrong
        shape: not an object, unknown or missing keys, a value of the wrong type or range."""
        data = read_json(path)
        try:
            check_value_types(data, CostModel, LayerCost)
            return cls.from_dict(data)
        except ConfigError as exc:
            raise ConfigError(f"{path}: {exc}") from exc


# Keys :meth:`CostModel.to_dict` leaves out at these values, so that a file without them
# still reads in versions that do not know them.
_OPTIONAL_KEYS = {
    "embedding": None,
    "head": None,
    "grad_bytes": None,
    "replica_latency": 0.0,
    "replica_bandwidth": math.inf,
    "replica_add_bandwidth": math.inf,
    "tied_grad_bytes": 0.0,
    "wgrad_fraction": None,
    "wgrad_keep_fraction": WGRAD_KEEP_FRACTION,
    **dict.fromkeys(("recompute_granularity", "recompute_method", "recompute_num_layers")),
    "model": None,
    "stage": None,
}
