"""What every rank checks before its runtime's first message: the group has the plan's P
ranks, each rank was given the stages the plan places there, and all ranks hold the same plan
and settings. A mismatch is refused on every rank, naming the ranks that differ."""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist

from ..core.placement import DIRECTIONS, PLACEMENTS
from ..core.plan import Plan
from .errors import (
    PipelineError,
    digest,
    rank_label,
    refuse_disagreement,
    setting_code,
    setting_text,
    start_generation,
)
from .exchange import gather_ints
from .replicas import replica_params
from .stages import layer_split_of


def check_same_plan(
    plan: Plan,
    group,
    device: torch.device,
    timeout_s: float,
    stages: Mapping[int, torch.nn.Module] | None = None,
    settings: Mapping[str, object] | None = None,
) -> None:
    """Refuse to start unless the group has the plan's P ranks (checked locally, before any
    communication), every rank was given the stages the plan places there, and every rank
    holds the same plan and the same ``settings`` (e.g. ``dtype``): one exchange of hashes
    through the group's store (:func:`~megatron_prt.runtime.exchange.gather_ints`: a rank that
    does not arrive within ``timeout_s`` leaves nothing in flight), after which every rank
    raises, naming the ranks that differ. Under ``bi`` a second exchange refuses replica
    pairs whose gradient payloads differ in size (:func:`_refuse_unequal_replicas`)."""
    start_generation()  # reports posted before are not this runtime's
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    who = rank_label(rank, group)
    placement = plan.placement
    if world != placement.ranks:
        raise PipelineError(
            f"{who}: the plan is for P = {placement.ranks} pipeline ranks, the group has "
            f"{world}; build the plan for Placement({world}, ...) or pass group= a group of "
            f"{placement.ranks} ranks"
        )
    if not timeout_s > 0:  # also refuses NaN
        raise ValueError(f"{who}: timeout_s={timeout_s!r}; pass a positive number of seconds")
    settings = dict(settings or {})
    expected = sorted(placement.rank_stages[rank])
    given = None if stages is None else sorted(stages)
    split = None if stages is None else layer_split_of(stages)
    values = [digest(plan.fingerprint()), int(given not in (None, expected)), *_plan_fields(plan)]
    values += [setting_code(v) for v in settings.values()]
    values.append(0 if split is None else digest(repr(split)))
    rows = gather_ints(values, "the plan check at start-up", group, timeout_s, device)
    if given not in (None, expected):
        raise ValueError(f"{who}: stages {given} given, the plan places {expected} here")
    wrong = [r for r, row in enumerate(rows) if row[1]]
    if wrong:
        raise PipelineError(
            f"{who}: rank(s) {wrong} were given other stages than the plan places there "
            "(see their errors); pass each rank the stages of build_stages(plan.placement, rank, "
            "...)"
        )
    described = {row[0]: _plan_text(row[2 : 2 + _FIELDS]) for row in rows}
    columns = {"plan": 0, **{name: 2 + _FIELDS + i for i, name in enumerate(settings)}}
    for name, column in columns.items():
        show = (lambda code: f"{code:016x} ({described[code]})") if name == "plan" else setting_text
        refuse_disagreement(who, name, [row[column] for row in rows], show)
    _refuse_other_splits(who, split, [row[-1] for row in rows])
    if placement.direction == "bi":  # the plans agree (checked above): every rank is here
        mine = _replica_bytes(placement, stages)
        sizes = gather_ints(mine, "the replica check at start-up", group, timeout_s, device)
        _refuse_unequal_replicas(who, placement, sizes)


def _refuse_other_splits(who: str, split: tuple | None, codes: list[int]) -> None:
    """Raise on every rank, those whose stages record no split (0) too, unless all ranks
    that record one hold the same ([Note: every rank builds the same layer split] in
    runtime/stages.py)."""
    if len({code for code in codes if code}) <= 1:
        return
    mine = 0 if split is None else digest(repr(split))
    others = [r for r, code in enumerate(codes) if code not in (0, mine)]
    said = "no split" if split is None else f"{','.join(map(str, split))} layers per model stage"
    raise PipelineError(
        f"{who}: ranks {others} built their stages with another layer split than "
        f"this rank's ({said}), so layers would be left out or run twice; pass every rank "
        "the same num_layers and stage_layers (a plan file's: load_plan(path).stage_layers; "
        "megatron: the same --pipeline-reuse-plan / --pipeline-reuse-stage-layers)"
    )


def _replica_bytes(placement, stages: Mapping[int, torch.nn.Module] | None) -> list[int]:
    """Per stage (``placement.num_stages`` values, both pipelines'): 1 + the bytes of its
    parameters that the bi replica sum carries (:func:`.replicas.replica_params`) where this
    rank holds it, else 0 (no stages given: all 0)."""
    sizes = [0] * placement.num_stages
    if stages is None:
        return sizes
    for stage, params in replica_params(placement, stages).items():
        sizes[stage] = 1 + sum(p.numel() * p.element_size() for p in params)
    return sizes


def _refuse_unequal_replicas(who: str, placement, sizes: list[list[int]]) -> None:
    """Raise on every rank when the two replicas of a model stage would sum gradients of
    different sizes (one side's parameters frozen, or built differently): the sum would wait
    for bytes that never come, or add mismatched tensors. ``sizes``: per rank, as
    :func:`_replica_bytes` gives them."""
    for a, b in placement.replica_pairs():
        ra, rb = placement.rank_of(a), placement.rank_of(b)
        got_a, got_b = sizes[ra][a], sizes[rb][b]
        if got_a and got_b and got_a != got_b:
            raise PipelineError(
                f"{who}: model stage {a} (rank {ra}) and its bi replica, stage {b} (rank "
                f"{rb}), hold {got_a - 1} and {got_b - 1} bytes of parameters that need a "
                "gradient: their gradient sum needs the same on both; build both replicas "
                "alike and freeze (requires_grad=False) the same parameters on both, before "
                "the runtime is built"
            )


_FIELDS = 5  # R, placement, direction, m, split backward: what a message names of a plan


def _plan_fields(plan: Plan) -> list[int]:
    placement = plan.placement
    return [
        placement.reuse,
        PLACEMENTS.index(placement.placement),
        DIRECTIONS.index(placement.direction),
        plan.num_microbatches,
        int(plan.split_backward),
    ]


def _plan_text(fields: list[int]) -> str:
    reuse, where, direction, m, split = fields
    text = f"R={reuse} {PLACEMENTS[where]}/{DIRECTIONS[direction]}, {m} micro-batches"
    return text + (", split backward" if split else "")
