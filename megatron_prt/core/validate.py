"""Plan validation: exactly-once, right rank, dependency order, no deadlock.

For a lowered plan it also replays the SEND/RECV streams with *blocking rendezvous*
semantics (a SEND waits for the peer's matching RECV and vice versa), the strictest model a
runtime can face; a plan that passes cannot deadlock under buffered or async p2p either.

Two checkers, one verdict: :func:`megatron_prt.core.flatcheck.passes` re-derives every
condition from the actions and the dependency rule on flat integer lists (linear, mostly
C-level list passes; see [Note: flat check]); only when it says no does
:func:`check_closely` go action by action, to name the fault in a :class:`PlanError` (or
find that the plan is valid after all: the flat check may refuse more than it must).

A plan its producer made valid by construction (:func:`megatron_prt.core.plan.vouch`: the
list scheduler's plans, the lowering of a valid plan) skips the checks unless ``full``;
``full=True`` checks it anyway, trusting no mark. A plan that passes is vouched for, so
validating it again costs nothing. :func:`validate_lowering` gives the verdicts of the full
validation of a plan and of its lowering together, for little more than the lowering's check
(:func:`megatron_prt.core.flatcheck.lowering_passes`).
"""

from __future__ import annotations

from collections import Counter

from .actions import Action, Op
from .census import looks_complete
from .flatcheck import lowering_passes, passes
from .gcpause import without_gc
from .grid import format_grid
from .lower import message_ends
from .plan import Plan, vouch, vouched
from .rendezvous import stuck_ranks
from .replay import PlanError, compiled


@without_gc
def validate(plan: Plan, full: bool = False) -> None:
    """Raise :class:`PlanError` (with the grid around the first failure) or return None.

    A vouched plan returns at once unless ``full``; otherwise the flat check
    (:func:`~megatron_prt.core.flatcheck.passes`) decides, and :func:`check_closely` names
    the fault when it says no (or finds the plan valid after all)."""
    if vouched(plan) and not full:
        return
    if not passes(plan):
        check_closely(plan)
    vouch(plan)


@without_gc
def validate_lowering(plan: Plan, lowered: Plan) -> None:
    """``validate(plan, full=True)`` and ``validate(lowered, full=True)`` in one: the same
    verdicts and errors, trusting no mark. When ``lowered`` holds ``plan``'s own compute
    actions (``lower(plan)`` does) the check of ``lowered`` proves ``plan`` valid too and
    ``plan`` costs one comparison (:func:`~megatron_prt.core.flatcheck.lowering_passes`,
    [Note: a lowering's check covers its plan]); else each is checked on its own. Both are
    vouched for when they pass."""
    if lowering_passes(plan, lowered):
        vouch(plan)
        vouch(lowered)
        return
    validate(plan, full=True)
    validate(lowered, full=True)


@without_gc
def check_closely(plan: Plan) -> None:
    """The action-by-action checks: raise :class:`PlanError` naming rank, step and action,
    or return None when ``plan`` is valid. Keeps the compiled replay with the plan."""
    if not looks_complete(plan):
        _check_shape(plan)
        _check_exactly_once(plan)
    compiled(plan, fresh=True)  # dependency order, no deadlock; kept for lowering, replays
    if plan.lowered:
        _check_rendezvous(plan)


def _fail(plan: Plan, rank: int, step: int, why: str) -> PlanError:
    action = plan.ranks[rank][step]
    return PlanError(
        f"rank {rank}, step {step}: {action} (stage {action.stage}, mb {action.mb}): {why}\n"
        + format_grid(plan.ranks, {rank: step})
    )


def _check_shape(plan: Plan) -> None:
    placement = plan.placement
    if len(plan.ranks) != placement.ranks:
        raise PlanError(f"plan has {len(plan.ranks)} ranks, its placement {placement.ranks}")
    if len(plan.mb_pipeline) != plan.num_microbatches:
        raise PlanError("mb_pipeline must name a pipeline for every micro-batch")
    for rank, acts in enumerate(plan.ranks):
        for step, action in enumerate(acts):
            if not 0 <= action.stage < placement.num_stages:
                raise _fail(plan, rank, step, f"no such stage (plan has {placement.num_stages})")
            if not 0 <= action.mb < plan.num_microbatches:
                raise _fail(plan, rank, step, f"no such micro-batch (m={plan.num_microbatches})")
            if action.op.is_comm and not plan.lowered:
                raise _fail(plan, rank, step, "communication in a plan not marked lowered")
            if placement.rank_of(action.stage) != rank:  # a SEND/RECV names a stage here too
                raise _fail(
                    plan,
                    rank,
                    step,
                    f"stage {action.stage} lives on rank {placement.rank_of(action.stage)}",
                )
            if placement.pipeline_of(action.stage) != plan.mb_pipeline[action.mb]:
                raise _fail(
                    plan,
                    rank,
                    step,
                    f"mb {action.mb} runs on pipeline {plan.mb_pipeline[action.mb]}, stage "
                    f"{action.stage} belongs to pipeline {placement.pipeline_of(action.stage)}",
                )


def _check_exactly_once(plan: Plan) -> None:
    seen = Counter(a for acts in plan.ranks for a in acts if a.op.is_compute)
    split = any(a.op is Op.I or a.op is Op.W for a in seen)  # W alone: its I is missing
    ops = (Op.F, Op.I, Op.W) if split else (Op.F, Op.B) if plan.has_backward else (Op.F,)
    for rank, acts in enumerate(plan.ranks):
        for step, action in enumerate(acts):
            if seen.get(action, 0) > 1:
                raise _fail(plan, rank, step, f"runs {seen[action]} times, expected once")
            if action.op.is_compute and action.op not in ops:
                raise _fail(plan, rank, step, "mixes B with split I/W backward")
    for mb in range(plan.num_microbatches):
        for stage in plan.stages_of_mb(mb):
            for op in ops:
                action = Action(stage, op, mb)
                if action not in seen:
                    rank = plan.placement.rank_of(stage)
                    raise PlanError(
                        f"rank {rank}: {action} (stage {stage}, mb {mb}) is missing from the plan"
                        f"\n{format_grid(plan.ranks, {}, radius=4)}"
                    )


def _check_rendezvous(plan: Plan) -> None:
    """Blocking replay (:func:`~megatron_prt.core.rendezvous.stuck_ranks`): compute needs
    local producers done and remote ones received; a SEND needs its producer done; SEND and
    RECV complete together when both ranks stand at the matching pair."""
    streams = plan.ranks
    stuck = stuck_ranks(plan)
    if stuck:
        rank, step = next(iter(stuck.items()))
        lines = [f"lowered plan deadlocks under blocking send/recv at rank {rank}, step {step}:"]
        for r, p in stuck.items():
            lines.append(f"  rank {r} blocked at step {p}: {streams[r][p]}")
        _check_send_after_producer(plan, stuck)  # else a wait on the other ranks
        raise PlanError("\n".join(lines) + "\n" + format_grid(streams, stuck))


def _check_send_after_producer(plan: Plan, stuck: dict[int, int]) -> None:
    """Name a stuck SEND that stands before the compute making its tensor (the runtime
    would send a tensor not made yet); the replay only sees that the rank stops there."""
    for rank, step in stuck.items():
        action = plan.ranks[rank][step]
        if action.op not in (Op.SEND_F, Op.SEND_B):
            continue
        producer = message_ends(action, plan.placement, plan.split_backward)[0]
        at = [i for i, a in enumerate(plan.ranks[rank]) if a == producer]
        if at and at[0] < step:
            continue  # made: the SEND waits for its receiver
        later = at
        where = f"later, at step {later[0]}" if later else "nowhere on this rank"
        raise _fail(plan, rank, step, f"sends the output of {producer}, which runs {where}")
