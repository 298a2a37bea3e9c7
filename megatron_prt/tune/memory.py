"""The partitioner's memory model: a rank's peak activation bytes as the largest of a few
in-flight count vectors dotted with its stages' activation sizes.

The plan fixes the order of every rank's actions, so it fixes which (stage, micro-batch)
activations are alive after every forward whatever the partition: the vectors follow the
simulator's rule (:func:`megatron_prt.sim.simulate.held_activations`: all of an activation
from F until B, or until I and then W's share until W) once per plan, and each candidate
partition only changes the sizes they are dotted with.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

from ..core.actions import Op
from ..core.plan import Plan


def dot(counts: Sequence[float], sizes: Sequence[float]) -> float:
    return sum(n * s for n, s in zip(counts, sizes, strict=True) if n)


def inflight_vectors(plan: Plan, rank: int) -> list[tuple[int, ...]]:
    """Activations alive on ``rank`` right after each action that can raise its bytes, per
    slot (the rank's stages in chunk order), keeping only vectors no other one dominates.
    Under split backward each slot counts twice: whole activations (F until I) and the
    parts W keeps (I until W), priced apart (:func:`peak_activation`'s ``sizes``: every
    slot's activation bytes, then every slot's kept bytes), since the kept share depends on
    the split and I raises the bytes where it is above 1. Counted in plan order, which
    :func:`~megatron_prt.sim.simulate.held_activations` documents as the time order (so the
    peaks equal the simulator's)."""
    slot_of = {stage: i for i, stage in enumerate(plan.placement.rank_stages[rank])}
    n = len(slot_of)
    alive = [0] * (2 * n if plan.split_backward else n)
    moves = {Op.F: ((0, 1),), Op.B: ((0, -1),), Op.I: ((0, -1), (n, 1)), Op.W: ((n, -1),)}
    seen: set[tuple[int, ...]] = set()
    for action in plan.compute_actions(rank):
        slot = slot_of[action.stage]
        for offset, change in moves[action.op]:
            alive[offset + slot] += change
        if action.op in (Op.F, Op.I):
            seen.add(tuple(alive))
    kept: list[tuple[int, ...]] = []
    for v in sorted(seen, key=lambda v: (-sum(v), v)):  # a dominating vector comes first
        if not any(all(a >= b for a, b in zip(k, v, strict=True)) for k in kept):
            kept.append(v)
    return kept


def peak_activation(vectors: Sequence[Sequence[int]], sizes: Sequence[float]) -> float:
    """Peak activation bytes of a rank with in-flight ``vectors`` and slot ``sizes``."""
    return max((dot(v, sizes) for v in vectors), default=0.0)


_UNITS = {"": 1, "b": 1, "k": 2**10, "kib": 2**10, "kb": 10**3, "m": 2**20, "mib": 2**20,
          "mb": 10**6, "g": 2**30, "gib": 2**30, "gb": 10**9, "t": 2**40, "tib": 2**40,
          "tb": 10**12}  # fmt: skip
_BYTES = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str) -> float:
    """A byte count > 0 as people write it: ``24GiB``, ``24G`` (both 2**30-based), ``24GB``
    (10**9), ``512MiB``, ``2.5e10``. :class:`ValueError` naming the text otherwise (the flags
    that take one wrap it for argparse)."""
    match = _BYTES.match(text)
    unit = match.group(2).lower() if match else None
    value = float(match.group(1)) * _UNITS[unit] if unit in _UNITS else math.nan
    if not 0 < value < math.inf:
        raise ValueError(f"expected bytes > 0 such as 24GiB, 512MiB, 24GB or 2.5e10, got {text!r}")
    return value


def format_bytes(value: float) -> str:
    """``value`` bytes in binary units, 3 significant digits: ``'47.3 GiB'``."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(value) >= size:
            return f"{value / size:.3g} {unit}"
    return f"{value:.3g} B"
