"""The layer split: how many transformer layers each model stage ``0..D-1`` gets.

The one owner of the even split and of the check of explicit per-stage counts; the runtime,
the cost model, the megatron-core integration and the partitioner all call these.
"""

from __future__ import annotations

import argparse
import numbers
from collections.abc import Sequence

from .placement import ConfigError


def even_layers(num_layers: int, depth: int) -> tuple[int, ...]:
    """``num_layers`` over ``depth`` stages as evenly as possible, earlier stages taking the
    remainder: ``even_layers(10, 4) == (3, 3, 2, 2)``. Stages get 0 layers when
    ``num_layers < depth`` (see :func:`stage_layer_counts` for a split that refuses that)."""
    base, extra = divmod(num_layers, depth)
    return tuple(base + (1 if k < extra else 0) for k in range(depth))


def check_stage_layers(
    stage_layers: Sequence[int],
    num_layers: int,
    depth: int | None = None,
    *,
    name: str = "stage_layers",
    total: str | None = None,
) -> tuple[int, ...]:
    """``stage_layers`` as a tuple if it holds integer counts >= 0 summing to ``num_layers``,
    ``depth`` of them (any number if None). Otherwise :class:`ConfigError` naming ``name``
    (the flag or key the counts came from), the counts and what they must be; ``total``
    names the layer total in that message (default ``"the N layers"``)."""
    counts = tuple(stage_layers)
    integers = all(isinstance(c, numbers.Integral) and not isinstance(c, bool) for c in counts)
    if (
        (depth is None or len(counts) == depth)
        and integers
        and min(counts, default=0) >= 0
        and sum(counts) == num_layers
    ):
        return counts
    size = "" if depth is None else f"D = R*P = {depth} "
    got = f"{len(counts)} counts" + (f" summing to {sum(counts)}" if integers else "")
    raise ConfigError(
        f"{name} {','.join(map(str, counts))} must give {size}counts >= 0 that sum to "
        f"{total or f'the {num_layers} layers'} (got {got}); fix the counts or the layers"
    )


def check_layers_fill_stages(num_layers: int, depth: int, layers: str, reuse: str) -> None:
    """The rule for a split chosen from the layer count (even, or the partitioner's):
    ``num_layers`` must give each of the ``depth`` = R*P stages a layer. ``layers`` and
    ``reuse`` name the flags the count and R came from; raises :class:`ConfigError`."""
    _refuse_unfilled(
        num_layers, depth, f"{layers} {num_layers}", f"use at least {depth} layers or lower {reuse}"
    )


def _refuse_unfilled(num_layers: int, depth: int, what: str, fix: str) -> None:
    """The one rule: a split chosen from the layer count gives every stage a layer."""
    if num_layers < depth:
        raise ConfigError(f"{what} cannot fill D = R*P = {depth} stages; {fix}")


def stage_layer_counts(
    num_layers: int,
    depth: int,
    stage_layers: Sequence[int] | None = None,
    *,
    name: str = "stage_layers",
    total: str | None = None,
    fix: str = "give fewer stages or explicit stage_layers",
) -> tuple[int, ...]:
    """The layers of every model stage: ``stage_layers`` checked by
    :func:`check_stage_layers`, or when None the even split, which must give every stage a
    layer (``num_layers >= depth``; else :class:`ConfigError` ending with ``fix``)."""
    if stage_layers is not None:
        return check_stage_layers(stage_layers, num_layers, depth, name=name, total=total)
    _refuse_unfilled(num_layers, depth, total or f"{num_layers} layers", fix)
    return even_layers(num_layers, depth)


def layer_counts_arg(text: str) -> tuple[int, ...]:
    """argparse type of a layers-per-stage flag: ``"2,3,3"`` -> ``(2, 3, 3)``; the counts are
    checked against the layout later (:func:`check_stage_layers`)."""
    try:
        return tuple(int(item) for item in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers such as 2,3,3,2, got {text!r}"
        ) from None
