"""Which transport a runtime talks through, and shared-memory rings sized from the messages
they carry.

One ring joins each (sender, receiver) pair of ranks (:class:`ShmTransport`). By default
(``shm_capacity=None``) a runtime that is to use shared memory runs its first step over
``torch.distributed`` (each edge's shape and dtype travel in a header, so any dtype crosses
as on shared memory), which tells every rank the bytes of each message it receives. Then,
collectively, each ring gets its pair's largest message times the messages the pair carries
in one step (the lowered plan's count): what a step can have in flight on it, so a sender
does not wait for room while its receiver computes. :data:`RING_BOUND` bounds that room, and
a ring always holds its largest message (plus :data:`RING_FLOOR` for the replica gradient
sums of ``bi``, which go in quarter-ring chunks). The free-space check then uses these
sizes: ``auto`` stays on ``torch.distributed`` with one warning line when /dev/shm cannot
hold them, ``shm`` raises. ``shm_capacity=N`` makes every ring N bytes from the start
instead (no sizing step): for micro-batches whose later messages are larger than the first
step's (``variable_shapes``), where a message larger than its sized ring raises naming
``shm_capacity``.
"""

from __future__ import annotations

import logging
import numbers
import platform
import socket
from collections import Counter

import torch.distributed as dist

from ..core.actions import Op
from ..core.lower import comm_key
from .errors import PipelineError
from .exchange import gather_ints, gather_words
from .p2p import (
    ShmTransport,
    TorchTransport,
    message_bytes,
    ring_bytes,
    shm_free_bytes,
    shm_too_small,
)
from .replicas import replica_peers

RING_BOUND = 32 << 20  # bytes of in-flight room a sized ring gets at most
RING_FLOOR = 64 << 10  # bytes a sized ring gets at least
_TSO_MACHINES = ("x86_64", "AMD64", "i686")
_log = logging.getLogger(__name__)


def ring_traffic(runtime, rank: int) -> tuple[Counter, set[int]]:
    """``(messages per step from each sender, receivers)`` of ``rank``'s rings, over both
    programs (the larger count) and, for ``bi``, the replica gradient sums (both ways)."""
    placement, split = runtime.plan.placement, runtime.plan.split_backward
    counts, receivers = Counter(), set()
    for lowered, _, _ in runtime._programs.values():
        program = Counter()
        for a in lowered.ranks[rank]:
            if a.op in (Op.RECV_F, Op.RECV_B):
                program[placement.rank_of(comm_key(a, placement, split)[1])] += 1
            elif a.op in (Op.SEND_F, Op.SEND_B):
                receivers.add(placement.rank_of(comm_key(a, placement, split)[2]))
        counts |= program  # the larger count per sender
    mirrors = replica_peers(placement, rank)
    counts.update({peer: 0 for peer in mirrors})
    return counts, receivers | mirrors


def make_transport(runtime, kind: str, shm_capacity: int | None):
    """The transport ``runtime`` starts with, and the kind to size rings for after its
    first step (None: no sizing). ``torch``: torch.distributed p2p. ``shm``: shared memory
    between ranks on one host. ``auto``: shm when every rank is on this x86 host and either
    computes on the CPU or shares GPUs over gloo (which has no CUDA send/recv), else torch.
    With ``shm_capacity`` the free-space check runs here: an explicit ``shm`` without room
    raises before any segment is created (a full /dev/shm kills with SIGBUS), ``auto``
    falls back to torch with one warning line. Reads ``runtime``'s rank, group, plan,
    programs, device, dtype, timeout_s and variable_shapes."""
    if kind not in ("auto", "torch", "shm"):
        raise ValueError(f"{runtime.who}: transport must be auto, torch or shm, got {kind!r}")
    smallest = message_bytes(0)
    if shm_capacity is not None and (
        isinstance(shm_capacity, bool)
        or not isinstance(shm_capacity, numbers.Integral)
        or shm_capacity < smallest
    ):
        raise ValueError(
            f"{runtime.who}: shm_capacity must be None (rings sized from the messages) "
            f"or a whole number of bytes >= {smallest}, got {shm_capacity!r}"
        )
    shm_capacity = None if shm_capacity is None else int(shm_capacity)
    group, placement = runtime.group, runtime.plan.placement
    if kind != "torch":  # through the store: bounded by timeout_s, a failed peer said
        mine = [socket.gethostname(), str(shm_free_bytes())]
        rows = gather_words(mine, "the transport set-up", group, runtime.timeout_s)
        hosts = [(host, int(free)) for host, free in rows]
        # The ring publishes a message with a plain store after the copy; only x86's
        # store order makes that safe without a fence, so elsewhere auto means torch.
        names = sorted({h for h, _ in hosts})
        same_host = len(names) == 1 and platform.machine() in _TSO_MACHINES
        if kind == "shm" and not same_host:
            raise PipelineError(_no_shm_here(runtime.who, names))
    if kind == "auto":
        staged = runtime.device.type == "cpu" or dist.get_backend(group) == "gloo"
        kind = "auto" if staged and same_host else "torch"
    if kind == "torch":
        return _torch(runtime, runtime.dtype), None
    if shm_capacity is None:  # sized after the first step (see the module's docstring)
        return _torch(runtime, None), kind
    inbound = [ring_traffic(runtime, r)[0] for r in range(placement.ranks)]
    need = sum(len(senders) for senders in inbound) * ring_bytes(shm_capacity)
    free = min(f for _, f in hosts)
    if need <= free:
        return _shm(runtime, shm_capacity), None
    if kind == "shm":
        raise PipelineError(shm_too_small(runtime.who, need, free, shm_capacity))
    _fall_back(runtime.rank, need, free)
    return _torch(runtime, runtime.dtype), None


def _no_shm_here(who: str, hosts: list[str]) -> str:
    """Why an explicit ``transport='shm'`` cannot run: ranks on several hosts (no segment
    to attach: an unclear FileNotFoundError), or a host whose stores may be seen out of
    order (the ring could hand out a message before its bytes: silently wrong data)."""
    if len(hosts) > 1:
        why = f"every rank on one host; the ranks run on {len(hosts)} hosts ({', '.join(hosts)})"
    else:
        why = (
            f"an x86 host (its rings rely on x86's store order); this host is {platform.machine()}"
        )
    return f"{who}: transport='shm' needs {why}: pass transport='auto' or 'torch'"


def sized_shm(runtime, kind: str):
    """After the first step over ``runtime.transport`` (a sizing :class:`TorchTransport`):
    shared-memory rings of the measured sizes, or (``auto`` without room for them) that
    transport, kept. Called before any step (a replica sum first), a ring whose messages
    are unknown gets :data:`RING_BOUND`. Collective."""
    placement, group = runtime.plan.placement, runtime.group
    largest = _largest_by_sender(runtime.transport, placement, runtime.rank)
    counts, _ = ring_traffic(runtime, runtime.rank)
    mirrors = replica_peers(placement, runtime.rank)
    sums = min(RING_BOUND, 2 * _replica_grad_bytes(runtime))  # two chunks of a half
    sizes = {}
    for src, count in counts.items():
        if count and src not in largest:  # sized before any step: its messages are unknown
            sizes[src] = RING_BOUND
            continue
        one = message_bytes(largest.get(src, 0))
        sizes[src] = max(min(RING_BOUND, one * count), one, sums * (src in mirrors), RING_FLOOR)
    mine = (sum(map(ring_bytes, sizes.values())), shm_free_bytes())
    gathered = gather_ints(mine, "the shared-memory ring sizing", group, runtime.timeout_s)
    need, free = sum(n for n, _ in gathered), min(f for _, f in gathered)
    if need > free:
        if kind == "shm":
            raise PipelineError(shm_too_small(runtime.who, need, free, None))
        _fall_back(runtime.rank, need, free)
        return _torch(runtime, runtime.dtype)  # every rank decides alike: safe to rebuild
    return _shm(runtime, sizes, runtime.transport.shapes)


def _largest_by_sender(transport: TorchTransport, placement, rank: int) -> dict[int, int]:
    """Bytes of the largest message each rank sent ``rank`` in the sizing step; a gradient
    not seen (a forward-only step) is as large as the activation it answers."""
    largest: dict[int, int] = {}
    for (kind, src, dst), nbytes in transport.largest.items():
        if kind == "act" and placement.rank_of(src) == rank:  # the gradient it gets back
            src, dst = dst, src
        if placement.rank_of(dst) == rank:
            peer = placement.rank_of(src)
            largest[peer] = max(largest.get(peer, 0), nbytes)
    return largest


def _replica_grad_bytes(runtime) -> int:
    """Gradient bytes of this rank's largest stage (direction ``bi`` sums them between
    replicas; 0 for ``uni``). At least 4 bytes an element: main_grad may be float32."""
    if runtime.plan.placement.direction != "bi":
        return 0
    return max(
        (
            sum(p.numel() * max(p.element_size(), 4) for p in m.parameters() if p.requires_grad)
            for m in runtime.stages.values()
        ),
        default=0,
    )


def _fall_back(rank: int, need: int, free: int) -> None:
    if rank == 0:
        _log.warning(
            "megatron_prt: /dev/shm has %d bytes free, the shared-memory rings need %d: "
            "using the torch transport (docker run --shm-size=1g or --ipc=host gives the "
            "faster one)",
            free,
            need,
        )


def _torch(runtime, dtype) -> TorchTransport:
    placement = runtime.plan.placement
    return TorchTransport(
        runtime.group,
        placement.rank_of,
        runtime.device,
        dtype,
        runtime.timeout_s,
        runtime.variable_shapes,
    )


def _shm(runtime, capacity, shapes=None) -> ShmTransport:
    """Rings of ``capacity``; ``shapes``: each edge's first shape (the sizing step's)."""
    placement = runtime.plan.placement
    counts, receivers = ring_traffic(runtime, runtime.rank)
    return ShmTransport(
        runtime.group,
        placement.rank_of,
        (set(counts), receivers),
        runtime.timeout_s,
        capacity,
        runtime.device,
        runtime.variable_shapes,
        shapes,
    )
