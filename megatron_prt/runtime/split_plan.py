"""F/I/W plans from F/B plans, until the core generators emit them: each ``B`` becomes ``I``
and its ``W`` follows ``w_delay`` compute actions later on the same rank (0: at once; None:
at the end of the rank's order). Valid for every delay under the dependency rule
(:mod:`megatron_prt.core.deps`): ``I`` waits on what ``B`` waited on (with ``I`` in place of
``B`` downstream), nothing waits on ``W``, and ``W`` runs after its own ``I``."""

from __future__ import annotations

from dataclasses import replace

from ..core.actions import Action, Op
from ..core.plan import Plan


def split_backward_plan(plan: Plan, w_delay: int | None = 0) -> Plan:
    """``plan`` (compute only, with ``B`` actions) with every ``B`` split into ``I`` and a
    ``W`` placed ``w_delay`` compute actions later (None: last); a split plan is returned
    as is."""
    if plan.split_backward:
        return plan
    if plan.lowered:
        plan = plan.compute_only()
    if w_delay is not None and w_delay < 0:
        raise ValueError(f"w_delay must be >= 0 or None, got {w_delay}")
    return replace(plan, ranks=tuple(_split_rank(acts, w_delay) for acts in plan.ranks))


def _split_rank(actions: tuple[Action, ...], w_delay: int | None) -> tuple[Action, ...]:
    out: list[Action] = []
    waiting: list[tuple[int, Action]] = []  # (actions still to pass, W)
    for action in actions:
        if action.op is not Op.B:
            out.append(action)
            waiting = _count_down(waiting, out)
            continue
        out.append(Action(action.stage, Op.I, action.mb))
        waiting = _count_down(waiting, out)
        weight = Action(action.stage, Op.W, action.mb)
        if w_delay == 0:
            out.append(weight)
        else:
            waiting.append((w_delay, weight))
    out.extend(w for _, w in waiting)
    return tuple(out)


def _count_down(waiting: list[tuple[int, Action]], out: list[Action]) -> list[tuple[int, Action]]:
    """One more compute action passed: W's whose delay ran out go next, in order."""
    left = []
    for delay, weight in waiting:
        if delay is None:
            left.append((None, weight))
        elif delay <= 1:
            out.append(weight)
        else:
            left.append((delay - 1, weight))
    return left
