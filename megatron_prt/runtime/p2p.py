"""Point-to-point transports between explicit pipeline ranks.

Every message is one tensor identified by :func:`megatron_prt.core.lower.message_key`
``(kind, from_stage, to_stage, mb)``. Both transports deliver the messages of one sender
to one receiver in the order the lowered plan sends them (which is the order it receives
them), so they need no tags.

* :class:`TorchTransport` uses ``torch.distributed`` isend/irecv (gloo on CPU, NCCL on
  CUDA; ranks computing on a GPU under gloo stage each message through the host); on NCCL
  each group of consecutive comm actions is one batch. Shapes are exchanged
  once: the first message on an edge ``(kind, from, to)`` is preceded by an int64 header
  with its shape (every message, with ``variable_shapes``; such receives wait for their
  header where the plan receives, the position the plan's deadlock check proves safe).
  The sender refuses, naming the flag, a message whose dtype is not the runtime's
  ``dtype`` or whose shape differs from its edge's first without ``variable_shapes``:
  the receiver would read it into a buffer of the wrong size (a wrong result, or gloo
  aborting the process). With ``dtype=None`` (the first step of a runtime that then
  sizes its shared-memory rings) the header also carries the edge's dtype, and the
  transport records each edge's largest message.
* :class:`ShmTransport` (ranks on one x86 host) copies through one shared-memory ring
  per (sender, receiver) pair: a message costs two memcpys instead of a trip through the
  kernel's TCP stack, which on a few busy cores costs more than the bubble reuse saves.
  Each ring's size is chosen by its receiver (:mod:`megatron_prt.runtime.rings`) and
  written into the ring for its sender. A rank that waits empties its inbound rings, so
  two ranks waiting for room in each other's full ring cannot deadlock.
  Ranks whose tensors live on a GPU stage each message through host memory (a device to
  host copy on send, host to device on receive): the way several ranks share one GPU,
  where NCCL refuses two ranks on the same device and gloo has no CUDA send/recv.
  Set-up checks that /dev/shm has room for every ring (a full tmpfs kills a rank with
  SIGBUS on first touch), removes segments a killed job left behind, and unlinks each
  segment (mode 0600, random name) as soon as both ends have it mapped. A wait on a peer
  also checks that the peer's process still runs, so a dead peer fails it within 0.1 s.

The executor sees only ``send``/``recv`` (returning handles with ``is_completed``/``wait``)
and ``flush`` (issue what was queued).
"""

from __future__ import annotations

import contextlib
import os
import re
import struct
import time
import uuid
from collections import deque
from collections.abc import Callable, Mapping
from datetime import timedelta
from multiprocessing import resource_tracker, shared_memory

import torch
import torch.distributed as dist

from .messages import check_edge_shape, message_not_sendable, other_step

_HEADER_LEN = 9  # ndim (and dtype code << 8) + up to 8 dims
_DTYPES = [  # dtypes a message may carry, by code (headers, ring messages)
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
]


def wire_device(group: dist.ProcessGroup | None, device: torch.device) -> torch.device:
    """Where ``group``'s collectives and p2p take tensors for ranks computing on ``device``:
    the host under gloo (it has no CUDA send/recv or all_gather), else ``device``."""
    return torch.device("cpu") if dist.get_backend(group) == "gloo" else torch.device(device)


class _Handle:
    """Completion of one message; ``tensor`` is the received data (recv handles)."""

    __slots__ = ("keep", "peer", "stamp", "tensor", "work")

    def __init__(self, tensor: torch.Tensor | None = None, keep: object = None):
        self.tensor, self.keep, self.work = tensor, keep, None
        self.peer: int | None = None  # shared memory: the rank a receive drains from
        self.stamp = 0  # shared memory: the step stamp a receive takes


class TorchTransport:
    """torch.distributed p2p; ``rank_of_stage`` maps stage -> pipeline-group rank."""

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        rank_of_stage: Callable[[int], int],
        device: torch.device,
        dtype: torch.dtype | None,
        timeout_s: float,
        variable_shapes: bool = False,
    ) -> None:
        self.group = group
        self.variable_shapes = variable_shapes
        self.rank_of_stage = rank_of_stage
        self.device = device
        # Where messages travel: the host under gloo, which has no CUDA send/recv (ranks
        # sharing a GPU stage each message through host memory, as on shared memory).
        self.wire = wire_device(group, device)
        self._staged = self.wire != torch.device(device)
        # None: each edge's dtype travels in its shape header, as on shared memory (the
        # first step of a runtime that then sizes its rings, which records ``largest``)
        self.dtype = dtype
        self.shapes: dict[tuple, torch.Size] = {}  # edge -> shape
        self.dtypes: dict[tuple, torch.dtype] = {}  # edge -> dtype
        self.largest: dict[tuple, int] | None = {} if dtype is None else None  # edge -> bytes
        self.timeout = timedelta(seconds=timeout_s)
        self._global: dict[int, int] = {}
        # queued messages: (is_send, tensor, peer's rank in ``group``), and their handles
        self._ops: list[tuple[bool, torch.Tensor, int]] = []
        self._handles: list[_Handle] = []
        # NCCL needs a batch to progress a group of sends and receives together; gloo's
        # p2p is asynchronous already, and its coalescing path does not mix safely with the
        # plain receive that learns a new edge's shape.
        self._batched = dist.get_backend(group) == "nccl"
        # Unbatched messages go straight to the process group's send/recv: dist.isend and
        # dist.irecv redo their argument checks and group look-ups on every call, a few
        # microseconds a message on the critical path of every hop.
        self._pg = dist.group.WORLD if group is None else group
        self.closed = False
        self.stamp = 0  # the running step's ([Note: every message carries its step])

    def _global_rank(self, rank: int) -> int:
        """The global rank of ``group``'s ``rank`` (what dist.P2POp and dist.irecv take)."""
        if rank not in self._global:
            self._global[rank] = (
                rank if self.group is None else dist.get_global_rank(self.group, rank)
            )
        return self._global[rank]

    def knows(self, key: tuple) -> bool:
        """Whether the message's shape is known, so a receive can be posted without waiting."""
        return key[:3] in self.shapes and not self.variable_shapes

    def send(self, key: tuple, tensor: torch.Tensor) -> _Handle:
        edge = key[:3]
        dtype = self.dtype if self.dtype is not None else self.dtypes.get(edge)
        if not isinstance(tensor, torch.Tensor) or (dtype is not None and tensor.dtype != dtype):
            raise message_not_sendable(key, tensor, dtype)
        if not self.variable_shapes:
            check_edge_shape(self.shapes, key, tensor)
        peer = self.rank_of_stage(key[2])
        header = None
        if not self.knows(key):
            self._learn(edge, tensor.shape, tensor.dtype)
            header = _Handle(keep=self._header(tensor.shape, tensor.dtype))
            self._queue(True, header.keep, peer, header)
        payload = (tensor.to(self.wire) if self._staged else tensor).contiguous()
        # The handle keeps the payload (and the shape header) alive until the send is done.
        handle = _Handle(keep=payload if header is None else (payload, header))
        self._queue(True, payload, peer, handle)
        return handle

    def recv(self, key: tuple) -> _Handle:
        peer = self.rank_of_stage(key[1])
        edge = key[:3]
        if not self.knows(key):  # first message on this edge (or any, if shapes vary)
            self.flush()
            header = torch.empty(_HEADER_LEN, dtype=torch.int64, device=self.wire)
            peer_rank = self._global_rank(peer)
            dist.irecv(header, peer_rank, self.group, tag=self.stamp).wait(self.timeout)
            ndim, code = int(header[0]) & 0xFF, int(header[0]) >> 8
            shape = torch.Size(int(d) for d in header[1 : 1 + ndim])
            self._learn(edge, shape, _DTYPES[code] if self.dtype is None else self.dtype)
        buf = torch.empty(self.shapes[edge], dtype=self.dtypes[edge], device=self.wire)
        handle = _Handle(tensor=buf)
        self._queue(False, buf, peer, handle)
        return handle

    def _learn(self, edge: tuple, shape: torch.Size, dtype: torch.dtype) -> None:
        """Record an edge's shape and dtype from a header sent or received."""
        self.shapes[edge], self.dtypes[edge] = shape, dtype
        if self.largest is not None:
            nbytes = shape.numel() * dtype.itemsize
            self.largest[edge] = max(nbytes, self.largest.get(edge, 0))

    def flush(self) -> None:
        if not self._ops:
            return
        if self._batched:
            ops = [
                dist.P2POp(
                    dist.isend if is_send else dist.irecv,
                    tensor,
                    self._global_rank(peer),
                    self.group,
                    tag,
                )
                for is_send, tensor, peer, tag in self._ops
            ]
            works = dist.batch_isend_irecv(ops)
            if len(works) != len(ops):  # coalesced: one work for the whole batch
                works = [works[-1]] * len(ops)
        else:
            works = [self._start(*op) for op in self._ops]
        for work, handle in zip(works, self._handles, strict=True):
            handle.work = work
        self._ops, self._handles = [], []

    def _start(self, is_send: bool, tensor: torch.Tensor, peer: int, tag: int) -> dist.Work:
        """Post one queued message (unbatched) on the process group; its tag is its step's
        stamp ([Note: every message carries its step] in :mod:`.messages`)."""
        if tensor.is_complex():  # as dist.isend / dist.irecv pass it
            tensor = torch.view_as_real(tensor)
        return (self._pg.send if is_send else self._pg.recv)([tensor], peer, tag)

    def is_completed(self, handle: _Handle) -> bool:
        return handle.work.is_completed()

    def wait(self, handle: _Handle) -> torch.Tensor | None:
        handle.work.wait(self.timeout)
        if self._staged and handle.tensor is not None:
            return handle.tensor.to(self.device)
        return handle.tensor

    def close(self) -> None:
        self.closed = True

    def _queue(self, is_send: bool, tensor: torch.Tensor, peer: int, handle: _Handle) -> None:
        """Queue a message to or from ``peer`` (its rank in ``group``) for :meth:`flush`."""
        self._ops.append((is_send, tensor, peer, self.stamp))
        self._handles.append(handle)

    def _header(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        if len(shape) > _HEADER_LEN - 1:
            raise ValueError(f"pipeline tensors may have at most {_HEADER_LEN - 1} dims: {shape}")
        if self.dtype is None and dtype not in _DTYPES:
            raise TypeError(
                f"{dtype} cannot cross the shared-memory transport; pass transport='torch', "
                f"dtype={dtype}"
            )
        code = _DTYPES.index(dtype) if self.dtype is None else 0
        values = [len(shape) | code << 8, *shape] + [0] * (_HEADER_LEN - 1 - len(shape))
        return torch.tensor(values, dtype=torch.int64, device=self.wire)


# -- shared memory ---------------------------------------------------------------------------
SHM_DIR = "/dev/shm"
# Free bytes to assume in /dev/shm instead of asking statvfs: for tests, and for hosts whose
# tmpfs reports more than its memory limit really allows.
SHM_FREE_ENV = "MEGATRON_PRT_SHM_FREE_BYTES"
_SEGMENT = re.compile(r"prt[0-9a-f]{12}_(\d+)_\d+_\d+")  # prt<run>_<creator pid>_<src>_<dst>
_PAGE = 4096


def shm_free_bytes() -> int:
    """Bytes free in /dev/shm (or ``$MEGATRON_PRT_SHM_FREE_BYTES``)."""
    override = os.environ.get(SHM_FREE_ENV)
    if override:
        return int(override)
    stat = os.statvfs(SHM_DIR)
    return stat.f_bavail * stat.f_frsize


def ring_bytes(capacity: int) -> int:
    """Shared memory one ring of ``capacity`` data bytes occupies (whole pages)."""
    return (_DATA + capacity + _PAGE - 1) // _PAGE * _PAGE


def shm_too_small(who: str, need: int, free: int, capacity: int | None) -> str:
    """The error (or ``auto``'s warning) for rings that do not fit ``free`` bytes; ``who``:
    the rank's name (errors.rank_label); ``capacity``: ``shm_capacity=`` if given (every
    ring that size), else None (sized)."""
    rings = (
        f"rings of shm_capacity={capacity} bytes"
        if capacity
        else "rings sized from the first step's messages"
    )
    return (
        f"{who}: transport='shm' needs {need} bytes in {SHM_DIR} ({rings}), {free} are "
        "free; give the container more shared memory (docker run --shm-size=1g, or "
        "--ipc=host), pass a smaller shm_capacity= (bytes of every ring, at least the largest "
        "message), or use transport='torch' (a full /dev/shm kills the ranks with SIGBUS)"
    )


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie does not); True where /proc cannot tell."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return not os.path.isdir("/proc/self")
    except OSError:
        return True


def remove_stale_segments() -> list[str]:
    """Unlink this user's ring segments whose creator died before unlinking them (a job
    killed during set-up); returns their names."""
    removed = []
    with contextlib.suppress(OSError):
        for name in os.listdir(SHM_DIR):
            match = _SEGMENT.fullmatch(name)
            path = os.path.join(SHM_DIR, name)
            if match and not _alive(int(match.group(1))):
                with contextlib.suppress(OSError):
                    if os.stat(path).st_uid == os.getuid():
                        os.unlink(path)
                        removed.append(name)
    return removed


_MSG = struct.Struct("<12q")  # payload bytes, dtype code, ndim, 8 dims, step stamp
_CURSORS = struct.Struct("<2q")  # write, read
_CURSOR = struct.Struct("<q")
_CAPACITY_AT = 16  # the ring's data bytes, written by its creator (the receiver)
_DATA = 64  # ring data starts after the cursors and the capacity, cache-line aligned


class _Ring:
    """Single-producer single-consumer byte ring in shared memory. Cursors grow forever;
    ``write`` publishes a message by advancing the write cursor after the bytes are in place
    (x86 keeps stores in order). Copies go through memoryviews: one memcpy each, no torch op
    overhead on the per-message path."""

    def __init__(self, shm: shared_memory.SharedMemory, capacity: int | None = None) -> None:
        """``capacity``: create the ring (the receiver), else attach and read it."""
        self.shm = shm
        self.buf = shm.buf
        if capacity is None:
            (capacity,) = _CURSOR.unpack_from(self.buf, _CAPACITY_AT)
        else:
            _CURSORS.pack_into(self.buf, 0, 0, 0)
            _CURSOR.pack_into(self.buf, _CAPACITY_AT, capacity)
        self.capacity = capacity
        # Touch every page now: first-touch page faults would otherwise cost more than the
        # copy itself on every message of the ring's first lap.
        torch.frombuffer(self.buf, dtype=torch.uint8)[_DATA::4096].fill_(0)

    def cursors(self) -> tuple[int, int]:
        return _CURSORS.unpack_from(self.buf, 0)

    def _copy_in(self, pos: int, data: memoryview) -> None:
        start = pos % self.capacity
        first = min(len(data), self.capacity - start)
        self.buf[_DATA + start : _DATA + start + first] = data[:first]
        if first < len(data):
            self.buf[_DATA : _DATA + len(data) - first] = data[first:]

    def _copy_out(self, pos: int, out: memoryview) -> None:
        start = pos % self.capacity
        first = min(len(out), self.capacity - start)
        out[:first] = self.buf[_DATA + start : _DATA + start + first]
        if first < len(out):
            out[first:] = self.buf[_DATA : _DATA + len(out) - first]

    def free_space(self) -> int:
        write, read = self.cursors()
        return self.capacity - (write - read)

    def available(self) -> bool:
        write, read = self.cursors()
        return write > read

    def write(self, header: bytes, payload: memoryview) -> None:
        pos = self.cursors()[0]
        self._copy_in(pos, memoryview(header))
        self._copy_in(pos + len(header), payload)
        _CURSOR.pack_into(self.buf, 0, pos + message_bytes(len(payload)))

    def read(self) -> tuple[int, torch.Tensor]:
        """The next message: (its step stamp, its tensor)."""
        pos = self.cursors()[1]
        header = bytearray(_MSG.size)
        self._copy_out(pos, memoryview(header))
        nbytes, code, ndim, *dims, stamp = _MSG.unpack(header)
        out = torch.empty(nbytes, dtype=torch.uint8)
        self._copy_out(pos + _MSG.size, memoryview(out.numpy()))
        _CURSOR.pack_into(self.buf, 8, pos + message_bytes(nbytes))
        return stamp, out.view(_DTYPES[code]).view(dims[:ndim])


def message_bytes(payload: int) -> int:
    """Ring bytes one message of ``payload`` bytes takes (header, 8-byte aligned data)."""
    return _MSG.size + (payload + 7) // 8 * 8


def _own(src: int, stamp: int, tensor: torch.Tensor, handle: _Handle) -> torch.Tensor:
    """``tensor`` for ``handle``'s receive, unless its step is another ([Note: every message
    carries its step] in :mod:`.messages`)."""
    if stamp != handle.stamp:
        raise other_step(src, stamp, handle.stamp)
    return tensor


class ShmTransport:
    """Same-host transport. Collective to build: every rank of ``group`` calls it.
    Received tensors are on ``device`` (messages cross through host memory).
    ``capacity``: data bytes of every ring, or, by sender rank, of the rings this rank
    receives from (:mod:`megatron_prt.runtime.rings` sizes them from the messages; a sender
    reads a ring's size from the ring)."""

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        rank_of_stage: Callable[[int], int],
        peers: tuple[set[int], set[int]],
        timeout_s: float,
        capacity: int | Mapping[int, int] = 32 << 20,
        device: torch.device | str = "cpu",
        variable_shapes: bool = False,
        shapes: Mapping[tuple, torch.Size] | None = None,
    ) -> None:
        self.rank_of_stage = rank_of_stage
        self.variable_shapes = variable_shapes
        self.shapes = dict(shapes or {})  # edge -> its first message's shape (a sizing step's)
        self.timeout_s = timeout_s
        self.shm_capacity = capacity if isinstance(capacity, int) else None  # for errors
        self.device = torch.device(device)
        self.closed = False
        self.stamp = 0  # the running step's ([Note: every message carries its step])
        me = dist.get_rank(group)
        senders, receivers = peers
        sizes = {src: capacity if isinstance(capacity, int) else capacity[src] for src in senders}
        # One exchange settles the run's segment names, every rank's pid (a peer that dies
        # is noticed by its pid, not only by a timeout) and whether the rings fit.
        from .exchange import gather_ints  # exchange imports this module

        def meet(values, what):  # through the store: bounded by timeout_s, failures said
            return gather_ints(values, f"the shared-memory {what}", group, timeout_s)

        inbound = sum(map(ring_bytes, sizes.values()))
        mine = (int(uuid.uuid4().hex[:12], 16), os.getpid(), shm_free_bytes(), inbound)
        infos = meet(mine, "set-up")
        run = f"{infos[0][0]:012x}"
        self.pids = [pid for _, pid, _, _ in infos]
        need = sum(nbytes for *_, nbytes in infos)
        free = min(free for _, _, free, _ in infos)
        if need > free:
            raise RuntimeError(shm_too_small(f"rank {me}", need, free, self.shm_capacity))
        remove_stale_segments()
        self._owned = []
        # sender -> (ring, posted receives in order, messages drained before their receive)
        self._in: dict[int, tuple[_Ring, deque, deque]] = {}
        for src in sorted(senders):  # the receiver creates each inbound ring (mode 0600)
            shm = shared_memory.SharedMemory(
                name=f"prt{run}_{os.getpid()}_{src}_{me}", create=True, size=_DATA + sizes[src]
            )
            self._owned.append(shm)
            self._in[src] = (_Ring(shm, sizes[src]), deque(), deque())
        meet((), "rings' creation")
        self._out: dict[int, _Ring] = {}
        for dst in sorted(receivers):
            shm = shared_memory.SharedMemory(name=f"prt{run}_{self.pids[dst]}_{me}_{dst}")
            resource_tracker.unregister(shm._name, "shared_memory")  # the creator owns it
            self._out[dst] = _Ring(shm)
        meet((), "rings' attachment")
        for shm in self._owned:  # all attached: the names can go, the memory stays mapped
            shm.unlink()

    def pair_bytes(self, peer: int) -> int:
        """Data bytes of the smaller of the two rings between this rank and ``peer`` (the
        same number on both ranks)."""
        return min(self._out[peer].capacity, self._in[peer][0].capacity)

    def knows(self, key: tuple) -> bool:
        return True  # every message carries its shape

    def send(self, key: tuple, tensor: torch.Tensor) -> _Handle:
        if not isinstance(tensor, torch.Tensor):
            raise message_not_sendable(key, tensor, None)
        if tensor.dtype not in _DTYPES:
            raise TypeError(
                f"stage {key[1]}, mb {key[3]}: {tensor.dtype} cannot cross the shared-memory "
                "transport; pass transport='torch'"
            )
        if key[0] in ("act", "grad") and not self.variable_shapes:
            check_edge_shape(self.shapes, key, tensor)
            self.shapes.setdefault(key[:3], tensor.shape)
        dst = self.rank_of_stage(key[2])
        ring = self._out[dst]
        flat = tensor.detach().contiguous().view(-1).view(torch.uint8)
        payload = memoryview(flat.cpu().numpy())  # .cpu(): a GPU tensor's copy to the host
        need = message_bytes(len(payload))
        if need > ring.capacity:
            sized = (
                f"shm_capacity={self.shm_capacity}"
                if self.shm_capacity
                else "sized from the first step's messages"
            )
            raise ValueError(
                f"stage {key[1]}, mb {key[3]}: a message of {len(payload)} bytes exceeds the "
                f"shared-memory ring to rank {dst} ({ring.capacity} bytes, {sized}); pass "
                f"shm_capacity= of at least {need} (every ring that size)"
            )
        self._spin(lambda: ring.free_space() >= need, f"rank {dst} to make room", dst)
        dims = list(tensor.shape) + [0] * (8 - tensor.dim())
        code = _DTYPES.index(tensor.dtype)
        header = _MSG.pack(len(payload), code, tensor.dim(), *dims, self.stamp)
        ring.write(header, payload)
        return _Handle(keep=None)

    def recv(self, key: tuple) -> _Handle:
        src = self.rank_of_stage(key[1])
        handle = _Handle()
        handle.peer, handle.stamp = src, self.stamp
        _, pending, early = self._in[src]
        if early:  # drained while this rank waited (then no receive was pending)
            handle.tensor = _own(src, *early.popleft(), handle)
            return handle
        pending.append(handle)
        self._drain(src)
        return handle

    def flush(self) -> None:
        for src in self._in:
            self._drain(src)

    def is_completed(self, handle: _Handle) -> bool:
        if handle.peer is None:  # a send: done once written
            return True
        self._drain(handle.peer)
        return handle.tensor is not None

    def wait(self, handle: _Handle) -> torch.Tensor | None:
        self._spin(
            lambda: self.is_completed(handle), f"a message from rank {handle.peer}", handle.peer
        )
        return handle.tensor

    def close(self) -> None:
        self.closed = True
        rings, self._out, self._in = (
            [*self._out.values(), *(r for r, _, _ in self._in.values())],
            {},
            {},
        )
        for ring in rings:
            ring.buf = None  # drop our view first: shm.close() refuses while views exist
            ring.shm.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def _drain(self, src: int, every: bool = False) -> None:
        """Copy out every message already in the ring for which a receive is posted
        (``every``: all of them, the rest kept for their receives)."""
        ring, pending, early = self._in[src]
        while (pending or every) and ring.available():
            stamp, tensor = ring.read()
            if pending:
                handle = pending.popleft()
                handle.tensor = _own(src, stamp, tensor.to(self.device), handle)
            else:
                early.append((stamp, tensor.to(self.device)))

    def _spin(self, ready: Callable[[], bool], what: str, peer: int) -> None:
        """Poll ``ready``: yield the core for the first ~2 ms (a rank waiting for a peer has
        nothing else to do, and sleeping would add a timer tick to every hop), then back off
        with growing sleeps so a long wait costs no CPU, until ``timeout_s``. Every 0.1 s
        of a long wait checks that ``peer``'s process still runs."""
        if ready():
            return
        start = time.monotonic()
        deadline = start + self.timeout_s
        pause, check_at = 1e-5, start + 0.1
        while not ready():
            # A rank that waits empties its inbound rings: a peer that waits for room in
            # one of them may be what this wait depends on (rings hold what a step sends,
            # up to a bound, so a sender can get ahead of a receiver by more).
            for src in self._in:
                self._drain(src, every=True)
            now = time.monotonic()
            if now - start < 2e-3:
                os.sched_yield()
                continue
            if now > deadline:
                raise TimeoutError(f"timed out after {self.timeout_s:g} s waiting for {what}")
            if now > check_at:
                if not _alive(self.pids[peer]):
                    raise ConnectionError(
                        f"rank {peer} (pid {self.pids[peer]}) exited while this rank waited "
                        f"for {what}"
                    )
                check_at = now + 0.1
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)
