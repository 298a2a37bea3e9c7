"""Direction ``bi``: every model stage k has two weight replicas, stage k (pipeline 0) on
rank(k) and stage D+k (pipeline 1) on the mirrored rank. These helpers keep them equal.

* :func:`sync_replicas` copies pipeline 0's weights onto pipeline 1's replica (call once
  after building the model, before training).
* :func:`reduce_replica_grads` sums the two replicas' gradients after a step, so both hold
  the gradient of the whole batch and identical optimizer steps keep them identical.

Each rank issues all its transfers as one batch, so no pair order can deadlock.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from datetime import timedelta

import torch
import torch.distributed as dist

from ..core.placement import DIRECTIONS, PLACEMENTS, Placement
from .errors import PipelineError, collective, rank_label
from .exchange import gather_ints
from .p2p import wire_device


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors]) if tensors else torch.empty(0)


def _unflat(flat: torch.Tensor, tensors) -> None:
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()


def _bytes(tensors) -> torch.Tensor:
    """``tensors``' bytes, one after another (uint8): a copy carries every dtype exactly,
    where one cat would promote an integer buffer to the parameters' dtype (BatchNorm's
    ``num_batches_tracked`` 257 became 256 in bf16)."""
    parts = [t.detach().contiguous().view(-1).view(torch.uint8) for t in tensors]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)


def _unbytes(flat: torch.Tensor, tensors) -> None:
    """Inverse of :func:`_bytes`: copy each tensor's bytes back (clone: a slice's offset
    need not be aligned for the tensor's dtype)."""
    offset = 0
    for t in tensors:
        size = t.numel() * t.element_size()
        t.copy_(flat[offset : offset + size].clone().view(t.dtype).view_as(t))
        offset += size


def exchange_pairs(
    pairs, rank_of, group, payload, apply, both_ways: bool, timeout_s: float | None = None
) -> None:
    """For every ``(a, b)`` stage pair: ``b`` receives ``payload(a)`` and, ``both_ways``,
    ``a`` receives ``payload(b)``; then ``apply(stage, received, own_payload)`` on the receiver.
    Pairs on one rank exchange in place; the rest go as one batch per rank (no pair order
    to deadlock on). ``rank_of`` maps a stage to its rank in ``group``; ``timeout_s`` bounds
    the wait for the peers on gloo (None, and NCCL: the process group's own timeout)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    beyond = sorted({s for pair in pairs for s in pair if rank_of(s) >= world})
    if beyond:  # a send to a rank the group lacks waits forever, on every backend
        needed = 1 + max(rank_of(s) for s in beyond)
        raise PipelineError(
            f"{rank_label(rank, group)}: stage(s) {beyond} sit on ranks "
            f"{sorted({rank_of(s) for s in beyond})}, the group has {world} rank(s): the "
            f"placement is for {needed} pipeline ranks; "
            f"launch one process per pipeline rank (torchrun --nproc-per-node {needed}) or "
            f"pass group= a group of {needed} ranks"
        )
    ops, pending = [], []
    for a, b in pairs:
        if rank_of(a) == rank_of(b) == rank:
            mine, theirs = payload(a).clone(), payload(b).clone()  # payloads may be views
            apply(b, mine, theirs)
            if both_ways:
                apply(a, theirs, mine)
            continue
        for here, there, sends in ((a, b, True), (b, a, both_ways)):
            if rank_of(here) != rank:
                continue
            peer = rank_of(there)
            peer_global = peer if group is None else dist.get_global_rank(group, peer)
            own = payload(here)
            if not own.numel():  # a frozen or parameterless stage: its replica's is empty too
                continue  # (its empty CPU payload set NCCL's wire to the host for the rest)
            flat = own.to(wire_device(group, own.device))
            if sends:
                ops.append(dist.P2POp(dist.isend, flat, peer_global, group))
            if here == b or both_ways:
                buf = torch.empty_like(flat)
                ops.append(dist.P2POp(dist.irecv, buf, peer_global, group))
                pending.append((here, buf, own))
    for work in dist.batch_isend_irecv(ops) if ops else []:
        work.wait(*wait_args(timeout_s, group))
    for stage, received, own in pending:
        apply(stage, received.to(own.device), own)


def wait_args(timeout_s: float | None, group) -> tuple:
    """``Work.wait``'s arguments: ``timeout_s`` on gloo; none on NCCL, where a timeout
    makes the host thread wait for the GPU (without one only the stream waits; the process
    group's watchdog bounds it)."""
    if timeout_s is None or dist.get_backend(group) == "nccl":
        return ()
    return (timedelta(seconds=timeout_s),)


def copy_stages(
    pairs, rank_of, stages: Mapping[int, torch.nn.Module], group=None, timeout_s=None
) -> None:
    """For every ``(a, b)`` stage pair, stage ``b`` takes stage ``a``'s parameters and buffers
    (same structure). Collective over ``group``; ``stages`` holds this rank's stages."""

    def tensors(stage):
        return [t.detach() for t in (*stages[stage].parameters(), *stages[stage].buffers())]

    def apply(stage, received, _own):
        with torch.no_grad():
            _unbytes(received, tensors(stage))

    exchange_pairs(
        pairs, rank_of, group, lambda stage: _bytes(tensors(stage)), apply, False, timeout_s
    )


def sync_replicas(
    placement: Placement,
    stages: Mapping[int, torch.nn.Module],
    group=None,
    timeout_s: float = 60.0,
) -> None:
    """Pipeline-1 replicas take pipeline 0's parameters (and buffers). Collective over
    ``group`` for every direction (a no-op copy for ``uni``): it first checks that every rank
    holds the same placement, so ranks that disagree (e.g. ``uni`` against ``bi``) fail here
    with the difference named instead of a timeout. A peer that does not answer within
    ``timeout_s`` seconds (each wait) makes it raise :class:`PipelineError` naming it."""
    check_pipeline_group(placement, group, "sync_replicas")
    tensors = [t for module in stages.values() for t in (*module.parameters(), *module.buffers())]
    check_same_placement(placement, group, tensors[0].device if tensors else "cpu", timeout_s)
    with collective("sync_replicas", group):
        copy_stages(placement.replica_pairs(), placement.rank_of, stages, group, timeout_s)


def warn_running_statistics(placement: Placement, stages: Mapping[int, torch.nn.Module]) -> None:
    """Under ``bi`` say which stages keep running statistics (BatchNorm's): each replica
    updates its own from its pipeline's micro-batches and :func:`reduce_replica_grads`
    reduces gradients only, so the replicas' statistics drift apart while their weights
    stay equal, and the two copies of a stage evaluate differently."""
    if placement.direction != "bi":
        return
    kept = [
        stage
        for stage, module in sorted(stages.items())
        if any(getattr(m, "track_running_stats", False) for m in module.modules())
    ]
    if kept:
        warnings.warn(
            f"stage(s) {kept} keep BatchNorm running statistics: under direction bi each "
            "replica updates its own from its pipeline's micro-batches, so they drift apart "
            "while the weights stay equal; call sync_replicas(placement, stages) before "
            "evaluating or saving (it copies pipeline 0's), or use LayerNorm / GroupNorm",
            stacklevel=4,
        )


class BufferWatch:
    """Under ``bi``, says once which of the stages' buffers the first training step changed
    (counters, moving averages: anything but BatchNorm's running statistics, which
    :func:`warn_running_statistics` names at construction): each replica updates its own
    from its pipeline's micro-batches and nothing reduces buffers, so the two copies of a
    stage drift apart without a word."""

    @classmethod
    def of(cls, placement: Placement, stages: Mapping[int, torch.nn.Module]) -> BufferWatch | None:
        """A watch of the ``bi`` stages' buffers, or None (``uni``, or no buffer to watch);
        stages keeping running statistics are named now (:func:`warn_running_statistics`)."""
        if placement.direction != "bi":
            return None
        warn_running_statistics(placement, stages)
        watched = [
            (stage, module, name)
            for stage, module in sorted(stages.items())
            for name in _persistent_buffers(module)
            if not _running_statistic(module, name)
        ]
        return cls(watched) if watched else None

    def __init__(self, watched: list[tuple[int, torch.nn.Module, str]]) -> None:
        self.watched, self.before = watched, []

    def begin(self) -> None:
        """Copy the buffers, right before the first training step (not at construction:
        evaluation and caches built on a first forward would count)."""
        self.before = [(s, m, n, m.get_buffer(n).detach().clone()) for s, m, n in self.watched]

    def check(self) -> None:
        """Warn naming the stages and buffers the step changed (read anew: a buffer may have
        been replaced rather than changed in place)."""
        changed = [
            f"stage {stage} {name}"
            for stage, module, name, old in self.before
            if not _same(module.get_buffer(name), old)
        ]
        if changed:
            warnings.warn(
                f"{', '.join(changed[:4])}{' and more' if len(changed) > 4 else ''} changed in "
                "the step: under direction bi each replica of a stage updates its own buffers "
                "from its pipeline's micro-batches and they are not reduced, so the copies "
                "drift apart; call sync_replicas(placement, stages) before evaluating or "
                "saving (it copies pipeline 0's)",
                stacklevel=3,
            )


def _persistent_buffers(module: torch.nn.Module) -> list[str]:
    """Names of the buffers ``module`` saves (a non-persistent one is a cache, rebuilt)."""
    saved = set(module.state_dict(keep_vars=True))
    return [name for name, _ in module.named_buffers() if name in saved]


def _running_statistic(module: torch.nn.Module, name: str) -> bool:
    """Whether buffer ``name`` (dotted) belongs to a module that keeps running statistics."""
    owner = module.get_submodule(name.rpartition(".")[0])
    return bool(getattr(owner, "track_running_stats", False))


def _same(now: torch.Tensor, before: torch.Tensor) -> bool:
    return now.shape == before.shape and bool(torch.equal(now.detach(), before))


def check_same_placement(
    placement: Placement, group=None, device="cpu", timeout_s: float | None = None
) -> None:
    """Raise on every rank unless all ranks of ``group`` hold ``placement`` (four integers
    through the group's store, :func:`~megatron_prt.runtime.exchange.gather_ints`;
    ``device``: where this rank computes; ``timeout_s``: the wait, None for the process
    group's own timeout)."""
    codes = [
        placement.ranks,
        placement.reuse,
        PLACEMENTS.index(placement.placement),
        DIRECTIONS.index(placement.direction),
    ]
    rows = gather_ints(codes, "the placement check of sync_replicas", group, timeout_s, device)
    held = [Placement(p, r, PLACEMENTS[k], DIRECTIONS[d]) for p, r, k, d in rows]
    if len(set(held)) > 1:
        rank = dist.get_rank(group)
        holders: dict[Placement, list[int]] = {}
        for r, p in enumerate(held):
            holders.setdefault(p, []).append(r)
        what = "; ".join(f"ranks {r} hold {_describe(p)}" for p, r in holders.items())
        raise PipelineError(
            f"{rank_label(rank, group)}: ranks disagree on the placement ({what}); every rank "
            "must pass the same P, reuse, placement and direction (--direction uni|bi)"
        )


def check_pipeline_group(placement: Placement, group: dist.ProcessGroup | None, what: str) -> None:
    """Refuse a ``group`` of more ranks than a ``bi`` placement's P: in a job of several
    pipelines (data parallelism) the default group holds them all, and the ranks past P
    held no stage of the placement's and exchanged nothing, without a word (``uni`` has
    nothing to exchange; fewer ranks than P: :func:`exchange_pairs` names the processes to
    launch)."""
    world = dist.get_world_size(group)
    if world > placement.ranks and placement.replica_pairs():
        raise PipelineError(
            f"rank {dist.get_rank(group)}: {what} over a group of {world} ranks, but the "
            f"placement has {placement.ranks} pipeline ranks; pass group= this rank's pipeline "
            "group (dist.new_group of its P ranks, as PipelineRuntime(..., group=) takes)"
        )


def _describe(p: Placement) -> str:
    return f"P={p.ranks} R={p.reuse} {p.placement} {p.direction}"


def reduce_replica_grads(
    placement: Placement,
    stages: Mapping[int, torch.nn.Module],
    group=None,
    grad_attr: str = "grad",
    timeout_s: float | None = None,
) -> None:
    """Both replicas of every model stage end with the sum of their gradients, read from and
    written to each parameter's ``grad_attr`` (``main_grad`` under megatron-core's DDP);
    ``timeout_s`` bounds the wait for the peers on gloo (None, and NCCL: the process group's
    own timeout). It sums what it finds: once per accumulation, after its last step (called
    after every step, earlier sums count again); :meth:`PipelineRuntime.reduce_replica_grads`
    may also be called after every step ([Note: replica sums accumulate])."""
    grads = _replica_grads(placement, stages, grad_attr)

    def apply(stage, received, own):
        _unflat(own + received, grads(stage))

    check_pipeline_group(placement, group, "reduce_replica_grads")
    with collective("reduce_replica_grads", group):
        exchange_pairs(
            placement.replica_pairs(),
            placement.rank_of,
            group,
            lambda stage: _flat(grads(stage)),
            apply,
            both_ways=True,
            timeout_s=timeout_s,
        )


def replica_params(
    placement: Placement, stages: Mapping[int, torch.nn.Module]
) -> dict[int, list[torch.nn.Parameter]]:
    """Per stage of this rank in a replica pair, its parameters that need a gradient, each
    parameter in one stage only. A parameter two stages of this rank share (a tied weight:
    wave puts the first and the last stage on rank 0; loop under bi puts pipeline 0's first
    and pipeline 1's last there) holds both stages' gradients already; it goes with the
    first replica pair that holds it, so the sum adds it once (summed per pair, it came out
    twice) and the first step after a sum zeroes it where that pair's pipeline-1 stage is
    ([Note: replica sums accumulate]). The peer holds the mirror image of the tie and
    leaves out the same parameter."""
    seen: set[int] = set()
    params: dict[int, list] = {}
    for pair in placement.replica_pairs():
        for stage in (s for s in pair if s in stages):
            own = [p for p in stages[stage].parameters() if p.requires_grad]
            params[stage] = [p for p in own if id(p) not in seen]
            seen.update(map(id, own))
    return params


def _replica_grads(placement: Placement, stages: Mapping[int, torch.nn.Module], grad_attr: str):
    """``grads(stage)``: the ``grad_attr`` of :func:`replica_params`' parameters of the
    stage (zeros where none yet)."""
    params = replica_params(placement, stages)

    def grads(stage):
        for p in params[stage]:
            if getattr(p, grad_attr, None) is None:
                setattr(p, grad_attr, torch.zeros_like(p))
        return [getattr(p, grad_attr) for p in params[stage]]

    return grads


def replica_peers(placement: Placement, rank: int) -> set[int]:
    """Ranks holding a replica of a stage on ``rank`` (empty for ``uni``)."""
    peers = set()
    for a, b in placement.replica_pairs():
        ranks = {placement.rank_of(a), placement.rank_of(b)}
        if rank in ranks:
            peers |= ranks - {rank}
    return peers


def reduce_replica_grads_shm(
    placement: Placement,
    stages: Mapping[int, torch.nn.Module],
    transport,
    rank: int,
    grad_attr: str = "grad",
) -> None:
    """:func:`reduce_replica_grads` through a shared-memory transport whose rings include
    the replica peers (:func:`replica_peers`): a memcpy each way instead of a trip through
    the network stack. Both sides walk the replica pairs in the same order and send each
    pair's flat gradient in chunks of at most a quarter ring, one chunk ahead of their
    receive, so neither ring can fill while its reader waits. ``rank``: this process's
    pipeline rank."""

    grads = _replica_grads(placement, stages, grad_attr)
    with collective("reduce_replica_grads", None):
        for a, b in placement.replica_pairs():
            _reduce_pair_shm(placement, transport, rank, a, b, grads)


def _reduce_pair_shm(placement: Placement, transport, rank: int, a: int, b: int, grads) -> None:
    """Sum the gradients of replica pair ``(a, b)`` where ``rank`` holds one or both."""
    here = [s for s in (a, b) if placement.rank_of(s) == rank]
    if len(here) == 2:
        mine, theirs = _flat(grads(a)), _flat(grads(b))
        total = mine + theirs
        _unflat(total, grads(a))
        _unflat(total, grads(b))
    elif here:
        mine_stage = here[0]
        peer_stage = b if mine_stage == a else a
        own = _flat(grads(mine_stage))
        _unflat(own + _exchange_flat(transport, own, mine_stage, peer_stage), grads(mine_stage))


def _exchange_flat(transport, flat: torch.Tensor, mine: int, peer: int) -> torch.Tensor:
    """Send ``flat`` from stage ``mine`` to stage ``peer``'s rank and receive the peer's
    equally long tensor, chunk by chunk (keys ``("R", from, to, chunk)``)."""
    ring = transport.pair_bytes(transport.rank_of_stage(peer))  # the same on both ranks
    chunk = max(1, ring // 4 // flat.element_size())
    received = torch.empty_like(flat)
    for index, start in enumerate(range(0, flat.numel(), chunk)):
        piece = flat[start : start + chunk]
        transport.send(("R", mine, peer, index), piece)
        handle = transport.recv(("R", peer, mine, index))
        received[start : start + piece.numel()] = transport.wait(handle)
    return received
