"""The model a cost file was measured on, and what a run that reads it is (stdlib only).

A cost file's times and bytes hold for one model shape: ``megatron-prt profile`` records it
under the cost key ``model``, ``megatron-prt tune`` copies it into the plan file
(``tuned.model``), and the readers compare it with what they run:
``--pipeline-reuse-plan`` and ``--pipeline-reuse-costs`` with the training flags,
``simulate --plan`` with its ``--costs``. A plan tuned for another shape still runs exactly
(the order and split do not depend on it), so a difference is said, not refused: its time
and memory are not what tune predicted. Keys are Megatron-LM's argument names::

    {"model": "bert", "hidden_size": 768, "num_attention_heads": 12,
     "ffn_hidden_size": 3072, "seq_length": 512, "micro_batch_size": 4,
     "vocab_size": 30522, "dtype": "bfloat16", "transformer_impl": "local",
     "tensor_model_parallel_size": 1, "device": "cuda", "swiglu": false,
     "num_query_groups": 12, "untie_embeddings_and_output_weights": false,
     "hidden_dropout": 0.1, "attention_dropout": 0.1}

Only keys both sides give (and neither gives as ``null``) are compared: a hand-written cost
file may give none, and a run may not know some at its check (the training flags give no
vocabulary: megatron pads it after the check, and the megatron layer compares it then,
``megatron_prt.megatron.plan_flag.warn_other_vocabulary``).
"""

from __future__ import annotations

from collections.abc import Mapping

from ..core.placement import ConfigError

SHAPE_KEYS = (
    "model",
    "hidden_size",
    "num_attention_heads",
    "ffn_hidden_size",
    "seq_length",
    "micro_batch_size",
    "vocab_size",
    "dtype",
    "transformer_impl",
    "tensor_model_parallel_size",
    "device",
    "swiglu",
    "num_query_groups",
    "untie_embeddings_and_output_weights",
    "hidden_dropout",
    "attention_dropout",
)
_WORDS = ("model", "dtype", "transformer_impl", "device")
_FRACTIONS = ("hidden_dropout", "attention_dropout")  # probabilities in [0, 1)
_SWITCHES = ("swiglu", "untie_embeddings_and_output_weights")  # the rest are whole numbers


def check_shape(value: object, where: str = "model") -> dict | None:
    """``value`` as a shape (a copy), or None for None. :class:`ConfigError` naming
    ``where`` and the key for anything else: not an object, a key not in
    :data:`SHAPE_KEYS`, a word that is not a string, a size that is not a positive integer."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ConfigError(f"key {where} must be a JSON object of model sizes, got {value!r}")
    unknown = sorted(set(value) - set(SHAPE_KEYS))
    if unknown:
        raise ConfigError(f"unknown keys {unknown} in {where}; known: {list(SHAPE_KEYS)}")
    for key, given in value.items():
        if given is None:
            continue
        if key in _WORDS:
            ok, kind = isinstance(given, str), "a string"
        elif key in _SWITCHES:
            ok, kind = isinstance(given, bool), "true or false"
        elif key in _FRACTIONS:
            number = isinstance(given, int | float) and not isinstance(given, bool)
            ok, kind = number and 0 <= given < 1, "a probability in [0, 1)"
        else:
            ok = isinstance(given, int) and not isinstance(given, bool) and given > 0
            kind = "a positive integer"
        if not ok:
            raise ConfigError(f"key {where}.{key} must be {kind} or null, got {given!r}")
    return dict(value)


def shape_differences(recorded: Mapping | None, running: Mapping | None) -> list[str]:
    """``key recorded -> running`` for each key both give, in :data:`SHAPE_KEYS` order, whose
    values differ; empty when either side is None."""
    if not recorded or not running:
        return []
    return [
        f"{key} {recorded[key]} -> {running[key]}"
        for key in SHAPE_KEYS
        if recorded.get(key) is not None
        and running.get(key) is not None
        and recorded[key] != running[key]
    ]


def default_ffn(ffn_hidden_size: int | None, hidden_size: int) -> int:
    """megatron's FFN size: the one given, else ``4 * hidden_size`` (not under swiglu)."""
    return ffn_hidden_size or 4 * hidden_size


def dtype_name(bf16: bool, fp16: bool) -> str:
    """The parameter dtype Megatron-LM's ``--bf16`` / ``--fp16`` flags give, by name."""
    return "bfloat16" if bf16 else "float16" if fp16 else "float32"


def describe_shape(shape: Mapping | None) -> str:
    """One line, e.g. ``bert, hidden_size 768, seq_length 512, ...``; ``unknown`` for None."""
    if not shape:
        return "unknown"
    parts = [str(shape["model"])] if shape.get("model") else []
    parts += [f"{key} {shape[key]}" for key in SHAPE_KEYS[1:] if shape.get(key) is not None]
    return ", ".join(parts)


def differences_message(
    what: str,
    recorded: Mapping | None,
    running: Mapping | None,
    consequence: str,
    sides: str = "file -> this run",
) -> str | None:
    """A sentence for a warning when ``recorded`` (the file's) and ``running`` differ
    (``what``: e.g. ``--pipeline-reuse-plan plan.json was tuned for``; ``consequence``:
    what that means and the fix; ``sides``: which is which in ``old -> new``), else None."""
    differences = shape_differences(recorded, running)
    if not differences:
        return None
    return f"{what} another model shape ({'; '.join(differences)}, {sides}): {consequence}"
