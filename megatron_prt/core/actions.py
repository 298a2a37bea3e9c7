"""The action IR: one pipeline step as a small immutable value with a text form.

An action is ``<stage><op><mb>``, e.g. ``5F2`` (stage 5, forward, micro-batch 2) or
``3SEND_B1`` (stage 3 sends the input-gradient of micro-batch 1 upstream). ``str`` and
:func:`parse` are exact inverses, so plans round-trip through CSV and JSON.

Compute ops: ``F`` forward, ``B`` full backward; ``I`` (input-grad) and ``W`` (weight-grad)
are reserved for split backward. Comm ops are inserted by :mod:`megatron_prt.core.lower`:
``SEND_F``/``RECV_F`` carry an activation from stage s to s+1 of the same pipeline (the
action names the sending / receiving stage respectively), ``SEND_B``/``RECV_B`` carry a
gradient from stage s to s-1.
"""

from __future__ import annotations

import re
from enum import Enum
from typing import NamedTuple


class Op(str, Enum):
    F = "F"
    B = "B"
    I = "I"  # noqa: E741 - the op's established name (input-grad half of B)
    W = "W"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"

    def __str__(self) -> str:
        return self.value

    @property
    def is_compute(self) -> bool:
        return self in _COMPUTE

    @property
    def is_comm(self) -> bool:
        return not self.is_compute


_COMPUTE = frozenset({Op.F, Op.B, Op.I, Op.W})
# Longest names first so that "SEND_F" is not read as stage "SEND_" + op "F".
_ACTION_RE = re.compile(
    r"^(\d+)(" + "|".join(sorted((o.value for o in Op), key=len, reverse=True)) + r")(\d+)$"
)


class Action(NamedTuple):
    """One step of a rank's plan. ``stage`` is a global stage id, ``mb`` a global micro-batch id."""

    stage: int
    op: Op
    mb: int

    def __str__(self) -> str:
        return f"{self.stage}{self.op.value}{self.mb}"

    def __repr__(self) -> str:
        return str(self)


def parse(text: str) -> Action:
    """Inverse of ``str(action)``; raises ``ValueError`` naming the bad string."""
    match = _ACTION_RE.match(text.strip())
    if match is None:
        raise ValueError(
            f"not an action: {text!r} (expected <stage><op><mb> with op in "
            f"{', '.join(o.value for o in Op)}, e.g. '5F2')"
        )
    stage, op, mb = match.groups()
    return Action(int(stage), Op(op), int(mb))


def F(stage: int, mb: int) -> Action:  # noqa: N802 - reads like the notation
    return Action(stage, Op.F, mb)


def B(stage: int, mb: int) -> Action:  # noqa: N802
    return Action(stage, Op.B, mb)
