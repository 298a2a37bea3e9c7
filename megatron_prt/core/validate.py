"""Plan validation: exactly-once, right rank, dependency order, no deadlock.

For a lowered plan it also replays the SEND/RECV streams with *blocking rendezvous*
semantics (a SEND waits for the peer's matching RECV and vice versa), the strictest model a
runtime can face; a plan that passes cannot deadlock under buffered or async p2p either.
"""

from __future__ import annotations

from collections import Counter

from .actions import Action, Op
from .deps import producers
from .grid import format_grid
from .lower import comm_key, message_ends, message_key
from .plan import Plan
from .replay import PlanError, replay


def validate(plan: Plan) -> None:
    """Raise :class:`PlanError` (with the grid around the first failure) or return None."""
    _check_shape(plan)
    _check_exactly_once(plan)
    replay(plan)
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
            if action.op.is_compute and placement.rank_of(action.stage) != rank:
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
    split = plan.split_backward
    ops = (Op.F, Op.I, Op.W) if split else (Op.F, Op.B) if plan.has_backward else (Op.F,)
    seen = Counter(a for acts in plan.ranks for a in acts if a.op.is_compute)
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
    """Blocking replay: compute needs local producers done and remote ones received;
    SEND and RECV complete together when both ranks stand at the matching pair."""
    placement = plan.placement
    split = plan.split_backward
    streams = plan.ranks
    pos = [0] * len(streams)
    done: set[Action] = set()
    received: set[tuple] = set()
    progress = True
    while progress:
        progress = False
        for rank, acts in enumerate(streams):
            while pos[rank] < len(acts):
                action = acts[pos[rank]]
                if action.op.is_compute:
                    if not _inputs_ready(action, rank, placement, split, done, received):
                        break
                    done.add(action)
                elif action.op in (Op.SEND_F, Op.SEND_B):
                    key, peer = _matching_recv(plan, action, pos, split)
                    if peer is None:
                        break
                    received.add(key)
                    pos[peer] += 1
                else:  # a RECV completes only together with its SEND
                    break
                pos[rank] += 1
                progress = True
    stuck = {r: p for r, p in enumerate(pos) if p < len(streams[r])}
    if stuck:
        rank, step = next(iter(stuck.items()))
        lines = [f"lowered plan deadlocks under blocking send/recv at rank {rank}, step {step}:"]
        for r, p in stuck.items():
            lines.append(f"  rank {r} blocked at step {p}: {streams[r][p]}")
        raise PlanError("\n".join(lines) + "\n" + format_grid(streams, stuck))


def _inputs_ready(action, rank, placement, split, done, received) -> bool:
    for dep in producers(action, placement, split):
        if placement.rank_of(dep.stage) == rank:
            if dep not in done:
                return False
        elif message_key(dep, action) not in received:
            return False
    return True


def _matching_recv(plan: Plan, send: Action, pos: list[int], split: bool):
    """(message key, peer rank) when the peer stands at the RECV matching ``send``; else
    (key, None)."""
    producer, consumer = message_ends(send, plan.placement, split)
    key = message_key(producer, consumer)
    peer = plan.placement.rank_of(consumer.stage)
    if pos[peer] < len(plan.ranks[peer]):
        head = plan.ranks[peer][pos[peer]]
        if head.op in (Op.RECV_F, Op.RECV_B) and comm_key(head, plan.placement, split) == key:
            return key, peer
    return key, None
