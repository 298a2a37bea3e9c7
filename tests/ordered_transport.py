"""A CPU transport with NCCL's stream order, for tests: it wraps the gloo
:class:`~megatron_prt.runtime.p2p.TorchTransport` so that each rank's batches run one after
the other on a communication thread, in the order posted, a batch completing once all its
operations have. As on NCCL, a receive posted early then holds back every later send of its
rank until its sender reaches it, so a program that relies on gloo's independent messages
deadlocks here (the wait times out). Gloo's sends may still complete before their receive is
posted, which NCCL's do not: :func:`megatron_prt.runtime.ordered.nccl_stuck` checks that
part. A first message on an edge (its shape header) is received on the host once the
stream has run everything posted before it, as NCCL's in-order stream does."""

from __future__ import annotations

import queue
import threading
from datetime import timedelta

from megatron_prt.runtime.p2p import TorchTransport


class _BatchWork:
    """The completion of the batch an operation belongs to."""

    def __init__(self) -> None:
        self.done, self.error = threading.Event(), None

    def is_completed(self) -> bool:
        return self.done.is_set()

    def wait(self, timeout: timedelta) -> None:
        if not self.done.wait(timeout.total_seconds()):
            raise TimeoutError("a batch on the ordered stream did not complete (deadlock?)")
        if self.error is not None:
            raise self.error


class StreamOrderedTransport:
    """Wraps a gloo ``TorchTransport`` (``inner``); the executor's interface unchanged."""

    def __init__(self, inner: TorchTransport) -> None:
        self.inner, self.closed = inner, False
        self.batches = 0  # batches run through the ordered stream
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def knows(self, key: tuple) -> bool:
        return self.inner.knows(key)

    def send(self, key, tensor):
        return self.inner.send(key, tensor)

    def recv(self, key):
        if not self.inner.knows(key):  # its header is received on the host: after the stream
            self.flush()
            drained = _BatchWork()
            self._queue.put(([], drained))
            drained.wait(self.inner.timeout)
        return self.inner.recv(key)

    def flush(self) -> None:
        inner = self.inner
        if not inner._ops:
            return
        work = _BatchWork()
        for handle in inner._handles:
            handle.work = work
        self._queue.put((inner._ops, work))
        inner._ops, inner._handles = [], []

    def is_completed(self, handle) -> bool:
        return handle.work.is_completed()

    def wait(self, handle):
        handle.work.wait(self.inner.timeout)
        return handle.tensor

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()
        self.closed = True

    def _serve(self) -> None:
        while (item := self._queue.get()) is not None:
            ops, work = item
            try:
                for started in [self.inner._start(*op) for op in ops]:
                    started.wait(self.inner.timeout)
            except Exception as exc:  # handed to the waiting compute
                work.error = exc
            self.batches += 1
            work.done.set()
