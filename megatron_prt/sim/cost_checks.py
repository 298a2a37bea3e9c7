"""Type checks of a cost file's JSON values before :class:`~megatron_prt.sim.cost.CostModel`
reads them (stdlib only)."""

from __future__ import annotations

import json
import math
from dataclasses import replace

from ..core.placement import ConfigError
from .layer_cost import messages_after
from .recompute import check_recompute

_ENDS = ("embedding", "head", "stage")  # a cost file's entries beside its layer list


def read_json(path: str) -> object:
    """A cost file's JSON; a missing or unreadable file, or text that is not JSON, raises
    :class:`ConfigError` naming ``path``."""
    try:
        with open(path) as f:
            return json.load(f)
    except OSError as exc:
        raise ConfigError(
            f"{path}: {exc.strerror or exc}; give the path of a cost JSON "
            "(`megatron-prt profile ... -o FILE` writes one)"
        ) from exc
    except ValueError as exc:  # not JSON, or not UTF-8
        raise ConfigError(f"{path}: not JSON ({exc})") from exc


def check_value_types(data: object, model: type, layer: type) -> None:
    """Refuse JSON values that ``model.from_dict`` would turn into a ``TypeError`` deep
    inside (a string for a time, a list that is not one): numbers where numbers go (``null``
    and ``Infinity`` only where the field's default is ``None`` or infinite), lists and
    objects where they go. ``model``, ``layer``: the CostModel and LayerCost dataclasses
    (passed in: this module sits below them). Keys and ranges are from_dict's to check."""
    if not isinstance(data, dict):
        raise ConfigError(f"expected a JSON object of cost keys, got {type(data).__name__}")
    parts = {"layers": list, "stage_layers": list, "embedding": dict, "head": dict}
    parts |= {"stage": dict, "model": dict}
    for key, kind in parts.items():
        value = data.get(key)
        if value is not None and not isinstance(value, kind):
            raise ConfigError(f"key {key} must be a JSON {kind.__name__}, got {value!r}")
    words = ("recompute_granularity", "recompute_method")  # strings: _check_recompute
    for key in words:
        if data.get(key) is not None and not isinstance(data[key], str):
            raise ConfigError(f"key {key} must be a string or null, got {data[key]!r}")
    _check_numbers(data, model, "", skip={*parts, *words})
    for index, count in enumerate(data.get("stage_layers") or ()):
        if isinstance(count, bool) or not isinstance(count, int):
            raise ConfigError(f"key stage_layers[{index}] must be an integer, got {count!r}")
    entries = [(f"layers[{i}]", layer) for i, layer in enumerate(data.get("layers") or ())]
    entries += [(end, data[end]) for end in _ENDS if data.get(end) is not None]
    for where, entry in entries:
        if not isinstance(entry, dict):
            raise ConfigError(f"key {where} must be an object with fwd, bwd, act, param")
        _check_numbers(entry, layer, f"{where}.")


def _check_numbers(data: dict, kind: type, prefix: str, skip=()) -> None:
    for name, spec in kind.__dataclass_fields__.items():
        if name in skip or name not in data:
            continue
        value = data[name]
        open_ended = spec.default is None or spec.default == math.inf
        if value is None and open_ended:
            continue
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        endless = spec.default == math.inf  # a bandwidth: infinite is free (a time crashed)
        if not number or math.isnan(value) or (math.isinf(value) and not endless):
            allowed = " (or null)" if open_ended else ""
            finite = "finite " if number and math.isinf(value) else ""
            raise ConfigError(
                f"key {prefix}{name} must be a {finite}number{allowed}, got {value!r}"
            )


_TOTALS = {"act": ("activation_bytes", 1.0), "param": ("param_bytes", 0.0)}  # and defaults


def check_bytes_on_every_layer(data: dict) -> None:
    """``act`` and ``param`` on every layer or on none: a layer without them would be priced
    at 0 bytes beside the others. With none on the layers, neither the model's total
    (``activation_bytes``, ``param_bytes``: read only without a layer list, so an
    over-budget plan passed) nor the embedding's, head's or stage's, beside which the
    layers would be priced at 0 bytes."""
    entries = [
        (i, layer) for i, layer in enumerate(data.get("layers") or ()) if isinstance(layer, dict)
    ]
    for key in ("act", "param"):  # (a layer that is no object is refused by name later)
        missing = [i for i, layer in entries if key not in layer]
        if missing and len(missing) < len(entries):
            raise ConfigError(
                f"cost layers{missing[:8]} have no {key} while other layers do: give {key} "
                "for every layer (or for none, and no memory is priced)"
            )
        total, default = _TOTALS[key]
        ends = [f"{e}.{key}" for e in _ENDS if isinstance(data.get(e), dict) and key in data[e]]
        given = [total] * (data.get(total, default) != default) + ends
        if entries and len(missing) == len(entries) and given:
            raise ConfigError(
                f"cost layers give no {key}, so {', '.join(given)} would price them at 0 "
                f"bytes ({total} is read only without a layer list): give {key} for every "
                f"layer, or drop {', '.join(given)}"
            )
    # beside layers with no grad, grad_bytes was ignored (each layer's grad is param / 4);
    # beside layers that give grad it is their total, as profile writes it
    no_grad = entries and not any("grad" in layer for _, layer in entries)
    if no_grad and data.get("grad_bytes") is not None:
        raise ConfigError(
            "cost layers give no grad, so grad_bytes (the whole model's, read only without a "
            "layer list) would be ignored and each layer priced at param / 4: give each "
            "layer's grad, or drop grad_bytes"
        )


def check_some_compute(model) -> None:
    """Refuse costs read from a file whose every compute time is 0: every plan then
    takes no time, and the ranking is the tie rule's alone (the fits scale the compute
    to 0 on purpose: only ``CostModel.from_dict`` asks)."""
    parts = [*model.layers, model.embedding, model.head, model.stage] if model.layers else []
    times = [t for part in parts if part is not None for t in (part.fwd, part.bwd)]
    if not any(times or (model.fwd_time, model.bwd_time)):
        raise ConfigError(
            "the costs give every stage zero time (every forward and backward time is "
            "0), so every plan takes none; give measured times (`megatron-prt profile` "
            "writes them)"
        )


def check_recompute_costs(model) -> None:
    """Refuse a recomputation setting the costs cannot price (``model``: a CostModel)."""
    check_recompute(model.recompute_granularity, model.recompute_method, model.recompute_num_layers)
    granularity = model.recompute_granularity
    if granularity is None:
        return
    if not model.layers:
        raise ConfigError(
            '--recompute-granularity needs per-layer costs: give a "layers" list '
            "(`megatron-prt profile ... --recompute-granularity ...` writes one)"
        )
    missing = [
        i
        for i, layer in enumerate(model.layers)
        if granularity == "selective"
        and (layer.selective_act is None or layer.selective_bwd is None)
    ]
    if missing:
        raise ConfigError(
            f"--recompute-granularity selective: layers{missing[:3]} have no measured "
            "selective_act / selective_bwd (selective has no derivation); profile with "
            "`megatron-prt profile ... --recompute-granularity selective`"
        )
    inputs = messages_after(model.layers, model.embedding, None)[:-1]
    unsized = [
        i
        for i, (layer, size) in enumerate(zip(model.layers, inputs, strict=True))
        if granularity == "full" and layer.full_act is None and layer.act > 0 and size is None
    ]
    if unsized and model.message_bytes <= 0:  # a recomputed layer would keep 0 bytes
        raise ConfigError(
            f"--recompute-granularity full: layers{unsized[:3]} have no full_act and the "
            "cost file no message_bytes, so a recomputed block's kept input has no size; "
            "give message_bytes (the hidden state a stage sends per micro-batch) or "
            "profile with `megatron-prt profile ... --recompute-granularity full`"
        )


def check_stage_entry(stage):
    """The cost file's ``stage`` entry (a LayerCost), its W set to 0 where not given: the
    step's work around a stage's parts is time only, all of it before W ([Note: every
    stage pays its step's work] in :mod:`megatron_prt.sim.cost`). ConfigError for bytes, a
    W share or a split or recomputed form, which no step's work has."""
    extra = [
        name
        for name, value in vars(stage).items()
        if name not in ("fwd", "bwd", "act", "param", "grad", "wgrad") and value is not None
    ]
    if stage.act or stage.param or stage.grad or stage.wgrad or extra:
        raise ConfigError(
            "cost stage (the work every stage's step adds) is time only: give fwd and bwd "
            f"(act, param, grad and wgrad 0 or absent), got {stage}"
        )
    return replace(stage, wgrad=0.0)
