"""The plans of paper_scale's split-backward rows (:mod:`.zb`): our split-backward planner
(:func:`megatron_prt.core.build_plan` with ``"zb"``) and torch's own schedules, read into our
plan IR (:mod:`megatron_prt.runtime.peers`; torch loads on the first torch row)."""

from __future__ import annotations

from functools import cache

from ...core import Placement, build_plan
from ...core.plan import Plan
from ...sim.cost import CostModel

TORCH = "torch:"  # schedule prefix of a torch row: "torch:ScheduleInterleaved1F1B"


def split_plans(placement: Placement, microbatches: int, schedule: str, cost: CostModel):
    """``[(name, plan)]`` for a split-backward row: ``schedule`` ``"zb"`` plans for the real
    stage times under 1F1B's activation memory; a torch row's order does not depend on the
    costs. Raises :class:`megatron_prt.core.ConfigError` where torch refuses."""
    if schedule.startswith(TORCH):
        name = schedule.removeprefix(TORCH)
        return [("torch", torch_plan(name, placement.ranks, placement.reuse, microbatches))]
    return [
        (
            "split backward",
            build_plan(placement, microbatches, schedule, cost.split_form().stage_times(placement)),
        )
    ]


@cache
def torch_plan(name: str, ranks: int, reuse: int, microbatches: int) -> Plan:
    """torch's ``name`` schedule (a class of torch.distributed.pipelining) as our plan."""
    from ...runtime.peers import PEERS, peer_plan

    peer = next(p for p in PEERS if p.name == name)
    return peer_plan(peer, ranks, microbatches, reuse)
