"""When a rank posts its receives, and what the hop then costs (the simulator's two readings).

``early`` is what :func:`megatron_prt.sim.simulate.simulate` (through
:func:`megatron_prt.core.replay.replay`) assumes: a remote input is ready one hop after its
producer ends, the receive having been posted before that, so the transfer overlaps
whatever the consumer's rank computes meanwhile. The runtime posts so on gloo and shared
memory (``recv_lookahead``) and on NCCL with ``early_recvs`` (one compute ahead, where
:mod:`megatron_prt.runtime.ordered` proves it deadlock-free; a receive it leaves in place
is modelled optimistically).

``at_need`` models NCCL without ``early_recvs`` (``recv_lookahead`` 0): a receive is posted
once its rank has finished the compute before its consumer, so the input is ready one hop
after the later of its producer's end and that rank's previous compute end: the hop never
hides behind the rank's own compute. ``one_ahead`` models NCCL with ``early_recvs`` where
every receive moves: posted once the rank has finished the compute two before its consumer,
so the hop hides behind one compute at most.
"""

from __future__ import annotations

from ..core.deps import producers
from ..core.plan import Plan
from .cost import CostModel

POSTINGS = ("early", "one_ahead", "at_need")


def compute_makespan(plan: Plan, cost: CostModel | None = None, posting: str = "early") -> float:
    """End of the last compute action of ``plan`` when receives are posted as ``posting``
    says (module docstring); without the ``bi`` replica-gradient sum. Raises ``ValueError``
    for an unknown ``posting`` or a plan whose ranks wait on each other forever."""
    if posting not in POSTINGS:
        raise ValueError(f"posting must be one of {', '.join(POSTINGS)}, got {posting!r}")
    cost = cost or CostModel()
    placement, split = plan.placement, plan.split_backward
    # [Note: the split form's own costs] in sim/layer_cost.py, as simulate prices it
    times = (cost.split_form() if split else cost).stage_times(placement)
    streams = [plan.compute_actions(rank) for rank in range(placement.ranks)]
    pos, free, end = [0] * len(streams), [0.0] * len(streams), {}
    before = [0.0] * len(streams)  # per rank: end of the compute before its latest
    moved = True
    while moved:
        moved = False
        for rank, stream in enumerate(streams):
            while pos[rank] < len(stream):
                action = stream[pos[rank]]
                inputs = producers(action, placement, split)
                if any(p not in end for p in inputs):
                    break
                start = free[rank]
                for p in inputs:
                    if placement.rank_of(p.stage) == rank:
                        start = max(start, end[p])
                        continue
                    hop = times.cut_hop(p.stage, action.stage)
                    if posting == "early":
                        start = max(start, end[p] + hop)
                    else:
                        posted = free[rank] if posting == "at_need" else before[rank]
                        start = max(start, max(end[p], posted) + hop)
                before[rank] = free[rank]
                end[action] = free[rank] = start + times.busy(action, placement)
                pos[rank] += 1
                moved = True
    if any(p < len(s) for p, s in zip(pos, streams, strict=True)):
        raise ValueError(f"plan deadlocks: ranks stop at steps {pos} of {list(map(len, streams))}")
    return max(free, default=0.0)
