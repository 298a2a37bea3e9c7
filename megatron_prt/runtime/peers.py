"""torch.distributed.pipelining's schedules as megatron-prt plans, to simulate beside ours.

Each peer is built by torch itself (no process group: the constructors only read a few
attributes of their stage objects, which :class:`_StandInStage` provides) and converted
action by action, never re-typed:

* ``F`` -> F, ``B`` (FULL_BACKWARD) -> B, ``I`` (BACKWARD_INPUT) -> I, ``W`` (BACKWARD_WEIGHT)
  -> W; a plan that splits any backward runs every backward split, so a ``B`` there becomes
  ``I`` then ``W`` (our IR does not mix the two forms; the simulator times I + W as B);
* DualPipeV's ``OVERLAP_F_B`` becomes its sub-actions in order (the simulator runs them one
  after the other, so the overlap's saving is not credited);
* ``None`` bubbles, SEND/RECV, REDUCE_GRAD and (UN)RESHARD are dropped: our lowering re-adds
  the communication.

Placement: torch's ``loop`` is our ``loop``; its ``v`` (rank r holds stages r and 2P-1-r) is
our ``wave`` with R=2. :func:`peer_plan` checks torch's own stage -> rank map against it.

``Schedule1F1B`` is the one single-stage class: its ``pipeline_order`` is only a drawing (in
torch 2.13 it starts the last rank at micro-batch 1 and ends it at ``m``), and what it runs is
the loop in ``_step_microbatches``; that loop is recorded here, calls and all, instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.pipelining import schedules as torch_schedules

from ..core.actions import Action, Op
from ..core.placement import ConfigError, Placement
from ..core.plan import Plan

WRITTEN_FOR = "2.13"  # the torch whose private schedule layout this module reads


@dataclass(frozen=True)
class Peer:
    """One torch schedule: ``name`` its class, ``label`` a compare row, ``placement`` our
    name for its stage placement, ``reuse`` its stages per rank (``None``: the caller's R),
    ``split_backward`` whether its order splits the backward into I and W."""

    name: str
    label: str
    placement: str
    reuse: int | None
    split_backward: bool = False

    def stages_per_rank(self, reuse: int) -> int:
        return self.reuse if self.reuse is not None else reuse


PEERS = (
    Peer("Schedule1F1B", "torch 1F1B", "loop", 1),
    Peer("ScheduleInterleaved1F1B", "torch interleaved", "loop", None),
    Peer("ScheduleInterleavedZeroBubble", "torch ZB1P", "loop", None, split_backward=True),
    Peer("ScheduleZBVZeroBubble", "torch ZBV", "wave", 2, split_backward=True),
    Peer("ScheduleDualPipeV", "torch DualPipeV", "wave", 2, split_backward=True),
)


class PeerRefusedError(ConfigError):
    """torch refuses the configuration (its own message included)."""


class PeerLayoutError(RuntimeError):
    """torch's private schedule layout is not the one this module was written against."""


class _StandInStage:
    """What the schedule constructors read of a pipeline stage, and (for the single-stage
    1F1B loop) a stage whose compute calls are recorded and whose p2p lists are empty."""

    def __init__(self, stage_index: int, num_stages: int, group_size: int, group_rank: int):
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.group_size = group_size
        self.group_rank = group_rank
        self.submod = None  # not an nn.Module: the torch.compile check skips it
        self.is_first = stage_index == 0
        self.is_last = stage_index == num_stages - 1
        self.has_backward = True
        self.calls: list[Action] = []

    def forward_one_chunk(self, mb: int, *args, **kwargs) -> None:
        self.calls.append(Action(self.stage_index, Op.F, mb))

    def backward_one_chunk(self, mb: int, *args, **kwargs) -> None:
        self.calls.append(Action(self.stage_index, Op.B, mb))

    def _no_ops(self, *args, **kwargs) -> list:
        return []

    get_fwd_recv_ops = get_fwd_send_ops = get_bwd_recv_ops = get_bwd_send_ops = _no_ops

    def clear_runtime_states(self) -> None:
        pass

    def perform_reduce_grad(self, *args, **kwargs) -> None:
        pass


def peer_placement(peer: Peer, pp: int, reuse: int = 2) -> Placement:
    """Our placement of ``peer``'s stages on ``pp`` ranks."""
    return Placement(pp, peer.stages_per_rank(reuse), peer.placement)


def peer_plan(peer: Peer, pp: int, microbatches: int, reuse: int = 2) -> Plan:
    """``peer``'s order for ``pp`` ranks and ``microbatches`` micro-batches as a compute-only
    plan. Raises :class:`PeerRefusedError` when torch refuses the configuration and
    :class:`PeerLayoutError` when torch's private layout changed."""
    placement = peer_placement(peer, pp, reuse)
    try:
        if peer.name == "Schedule1F1B":
            orders = _recorded_1f1b(pp, microbatches)
        else:
            orders = _multi_stage_order(peer, placement, microbatches)
    except ValueError as exc:  # torch's own refusals
        raise PeerRefusedError(
            f"torch {peer.name} refuses P={pp} m={microbatches} "
            f"({placement.reuse} stages per rank): {exc}"
        ) from exc
    except (AttributeError, TypeError, KeyError) as exc:
        raise _layout_error(peer, exc) from exc
    ranks = tuple(_converted(orders.get(rank, [])) for rank in range(pp))
    if any(a.op is Op.I for actions in ranks for a in actions):
        ranks = tuple(tuple(x for a in actions for x in _split(a)) for actions in ranks)
    return Plan(placement, microbatches, ranks, schedule=f"torch.{peer.name}")


def peer_plans(pp: int, microbatches: int, reuse: int = 2) -> list[tuple[Peer, Plan | None, str]]:
    """Every :data:`PEERS` entry as ``(peer, plan, "")`` or ``(peer, None, why torch refused)``."""
    rows: list[tuple[Peer, Plan | None, str]] = []
    for peer in PEERS:
        try:
            rows.append((peer, peer_plan(peer, pp, microbatches, reuse), ""))
        except PeerRefusedError as exc:
            rows.append((peer, None, str(exc)))
    return rows


def _layout_error(peer: Peer, exc: Exception) -> PeerLayoutError:
    return PeerLayoutError(
        f"torch {torch.__version__}: building {peer.name} without a process group failed "
        f"({type(exc).__name__}: {exc}); megatron_prt.runtime.peers reads the private "
        f"schedule layout of torch {WRITTEN_FOR}: update its stand-in stage for this torch"
    )


def _multi_stage_order(peer: Peer, placement: Placement, microbatches: int) -> dict[int, list]:
    """torch's ``pipeline_order`` (rank -> actions), built on behalf of rank 0 (every rank
    computes the whole order); its stage -> rank map must be ``placement``'s."""
    schedule_class = getattr(torch_schedules, peer.name)
    num_stages = placement.num_stages
    stages = [
        _StandInStage(stage, num_stages, placement.ranks, 0) for stage in placement.rank_stages[0]
    ]
    schedule = schedule_class(stages, microbatches, loss_fn=_ignore)
    theirs = tuple(schedule.stage_index_to_group_rank[s] for s in range(num_stages))
    if theirs != placement.stage_to_rank:
        raise PeerLayoutError(
            f"torch {torch.__version__} {peer.name} puts stages on ranks {theirs}, "
            f"not {placement.placement}'s {placement.stage_to_rank}; its placement changed"
        )
    return schedule.pipeline_order


def _recorded_1f1b(pp: int, microbatches: int) -> dict[int, list[Action]]:
    """The compute calls ``Schedule1F1B._step_microbatches`` makes on each rank."""
    orders = {}
    for rank in range(pp):
        stage = _StandInStage(rank, pp, pp, rank)
        schedule = torch_schedules.Schedule1F1B(stage, microbatches)  # no loss: no tensors
        schedule._initialize_stage = _ignore  # shape inference needs real tensors
        schedule._step_microbatches()
        orders[rank] = stage.calls
    return orders


def _ignore(*args, **kwargs) -> None:
    """Stands in for a loss function and for the 1F1B loop's stage set-up."""


_OPS = {"F": (Op.F,), "B": (Op.B,), "I": (Op.I,), "W": (Op.W,)}
_DROPPED = {"SEND_F", "RECV_F", "SEND_B", "RECV_B", "REDUCE_GRAD", "UNSHARD", "RESHARD"}


def _converted(order: list) -> tuple[Action, ...]:
    """One rank's torch actions (or recorded :class:`Action` s) as compute actions."""
    out: list[Action] = []
    for item in order:
        if item is None:
            continue
        if isinstance(item, Action):
            out.append(item)
            continue
        kind = item.computation_type.value
        if kind == "OVERLAP_F_B":
            out += _converted(list(item.sub_actions or ()))
        elif kind in _OPS:
            out += [Action(item.stage_index, op, item.microbatch_index) for op in _OPS[kind]]
        elif kind not in _DROPPED:
            raise PeerLayoutError(
                f"torch {torch.__version__}: unknown action {item!r} (type {kind}); "
                f"megatron_prt.runtime.peers knows torch {WRITTEN_FOR}'s action types"
            )
    return tuple(out)


def _split(action: Action) -> tuple[Action, ...]:
    """``B`` as ``I`` then ``W`` (a plan that splits one backward splits them all)."""
    if action.op is not Op.B:
        return (action,)
    return (Action(action.stage, Op.I, action.mb), Action(action.stage, Op.W, action.mb))
