"""A quick yes for a well-formed plan: every action where it may be, every compute action
the plan needs there exactly once.

:func:`megatron_prt.core.validate.validate` asks this first; only when the answer is no do
its action-by-action checks run, to find and name the fault. The checks here work on the
distinct (stage, op, rank) kinds and on whole columns (stages, micro-batches), so a plan of
half a million actions costs a few set and map passes, not a Python step per action.
"""

from __future__ import annotations

from itertools import compress, repeat
from operator import floordiv, itemgetter

from .actions import Op
from .plan import Plan

_STAGE, _OP, _MB = itemgetter(0), itemgetter(1), itemgetter(2)
_COMPUTE = frozenset(op for op in Op if op.is_compute)
_BACKWARD = frozenset({Op.B, Op.I, Op.W})


def looks_complete(plan: Plan) -> bool:
    """True when: the plan has its placement's ranks and a pipeline per micro-batch; every
    action names a stage and a micro-batch of the plan, of the same pipeline, and runs on
    its stage's rank (a SEND names the sending stage, a RECV the receiving one);
    communication appears only in a lowered plan; and the compute actions are exactly F, B
    (or F, I, W, or F alone) of every stage of every micro-batch's pipeline, each once.
    False says only that a closer look is needed."""
    placement, m = plan.placement, plan.num_microbatches
    if len(plan.ranks) != placement.ranks or len(plan.mb_pipeline) != m:
        return False
    compute_ops: set[Op] = set()
    computes = 0
    unique: set = set()  # the compute actions
    for rank, acts in enumerate(plan.ranks):
        if not acts:
            continue
        stages, ops, mbs = list(map(_STAGE, acts)), list(map(_OP, acts)), list(map(_MB, acts))
        if not (0 <= min(stages) and max(stages) < placement.num_stages):
            return False
        if not (0 <= min(mbs) and max(mbs) < m):
            return False
        kinds_of_op = set(ops)
        if not plan.lowered and not kinds_of_op <= _COMPUTE:
            return False
        if kinds_of_op <= _COMPUTE:
            compute, compute_stages = acts, stages
        else:
            mask = list(map(_COMPUTE.__contains__, ops))
            compute, compute_stages = compress(acts, mask), list(compress(stages, mask))
        if set(map(placement.stage_to_rank.__getitem__, stages)) - {rank}:
            return False
        if placement.num_pipelines > 1 and not _same_pipeline(plan, stages, mbs):
            return False
        compute_ops |= kinds_of_op & _COMPUTE
        computes += len(compute_stages)
        unique.update(compute)
    if Op.I in compute_ops:
        ops_needed = {Op.F, Op.I, Op.W}
    else:
        ops_needed = {Op.F, Op.B} if compute_ops & _BACKWARD else {Op.F}
    expected = m * placement.depth * len(ops_needed)
    return compute_ops <= ops_needed and computes == expected == len(unique)


def _same_pipeline(plan: Plan, stages: list[int], mbs: list[int]) -> bool:
    pipelines = map(floordiv, stages, repeat(plan.placement.depth))
    pairs = set(zip(pipelines, map(plan.mb_pipeline.__getitem__, mbs), strict=True))
    return all(stage_pipe == mb_pipe for stage_pipe, mb_pipe in pairs)
