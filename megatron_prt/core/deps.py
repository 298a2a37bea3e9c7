"""THE dependency rule: what a compute action waits on.

Every generator, the validator, the comm-lowering pass, the simulator and the runtime call
:func:`producers` (or :func:`consumers`, its inverse); nothing else encodes data flow. For
a stage ``s`` of micro-batch ``mb``:

* ``F(s)`` waits on ``F(prev(s))`` (the activation), nothing on a pipeline's first stage;
* ``B(s)`` / ``I(s)`` wait on ``F(s)`` (saved activations) and on the input-gradient of
  ``next(s)`` (``B`` or, with split backward, ``I``), only ``F(s)`` on the last stage;
* ``W(s)`` waits on ``I(s)``.

An edge between two stages carries a tensor (activation or gradient); across ranks it
becomes a SEND/RECV pair when a plan is lowered, on one rank it is handed over directly.
The rule is the same for every micro-batch: ``mb`` passes through unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import lru_cache

from .actions import Action, Op
from .placement import Placement


def producers(action: Action, placement: Placement, split: bool = False) -> tuple[Action, ...]:
    """Compute actions ``action`` needs done first. ``split``: backward is I + W, not B."""
    stage, op, mb = action
    if op is Op.F:
        prev = placement.prev_stage(stage)
        return () if prev is None else (Action(prev, Op.F, mb),)
    if op is Op.B or op is Op.I:
        nxt = placement.next_stage(stage)
        own = Action(stage, Op.F, mb)
        if nxt is None:
            return (own,)
        return (own, Action(nxt, Op.I if split else Op.B, mb))
    if op is Op.W:
        return (Action(stage, Op.I, mb),)
    raise ValueError(f"{action}: only compute actions have producers")


def consumers_map(
    actions: Iterable[Action], placement: Placement, split: bool = False
) -> dict[Action, list[Action]]:
    """Inverse of :func:`producers` over ``actions`` (derived, so the rule stays single)."""
    out: dict[Action, list[Action]] = {}
    for action in actions:
        out.setdefault(action, [])
        for dep in producers(action, placement, split):
            out.setdefault(dep, []).append(action)
    return out


def consumers(action: Action, placement: Placement, split: bool = False) -> tuple[Action, ...]:
    """Compute actions that wait on ``action``: :func:`consumers_map` of one micro-batch's
    actions, cached per placement (the rule does not depend on the micro-batch)."""
    stage, op, mb = action
    waiting = _consumer_table(placement, split).get((stage, op))
    if waiting is None:
        kind = "a split (F, I, W)" if split else "an F/B"
        raise ValueError(f"{action}: not a compute action of {kind} plan")
    return tuple(Action(s, o, mb) for s, o in waiting)


@lru_cache(maxsize=32)
def _consumer_table(placement: Placement, split: bool) -> dict[tuple, tuple[tuple, ...]]:
    ops = (Op.F, Op.I, Op.W) if split else (Op.F, Op.B)
    template = [Action(stage, op, 0) for stage in range(placement.num_stages) for op in ops]
    table = consumers_map(template, placement, split)
    return {(a.stage, a.op): tuple((c.stage, c.op) for c in table[a]) for a in template}


def carries_tensor(producer: Action, consumer: Action) -> bool:
    """Whether the edge moves a tensor between stages (activation or gradient)."""
    return producer.stage != consumer.stage


def comm_ops(producer: Action) -> tuple[Op, Op]:
    """(send op, recv op) for a tensor produced by ``producer``."""
    return (Op.SEND_F, Op.RECV_F) if producer.op is Op.F else (Op.SEND_B, Op.RECV_B)
