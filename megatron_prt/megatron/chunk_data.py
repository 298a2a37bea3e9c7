"""Each model chunk's batches, by micro-batch: what megatron's ``forward_step_func`` draws
from the chunk's data iterator when the plan runs that chunk's forward (micro-batches reach
a chunk in plan order, not always in index order)."""

from __future__ import annotations

from collections.abc import Iterator


class ChunkData:
    """Batches of one chunk's iterator by micro-batch. ``for_mb(mb)`` is an iterator whose
    single ``next`` returns batch ``mb``, reading ahead (and keeping) what lies between."""

    def __init__(self, source: Iterator | None, chunk: int) -> None:
        self.source, self.chunk = source, chunk
        self.read = 0  # batches taken from ``source`` this iteration
        self.ahead: dict[int, object] = {}

    def for_mb(self, mb: int) -> Iterator:
        data = self

        class _One:
            used = False

            def __iter__(self):
                return self

            def __next__(self):
                if self.used:
                    raise RuntimeError(
                        f"forward_step_func drew a second batch for micro-batch {mb} of chunk "
                        f"{data.chunk}; each call must draw at most one"
                    )
                self.used = True
                return data.take(mb)

        return _One()

    def take(self, mb: int):
        if self.source is None:
            raise RuntimeError(f"chunk {self.chunk} has no data iterator")
        while self.read <= mb:
            self.ahead[self.read] = next(self.source)
            self.read += 1
        if mb not in self.ahead:
            raise RuntimeError(f"batch of micro-batch {mb} was already used (chunk {self.chunk})")
        return self.ahead.pop(mb)

    def finish(self, num_microbatches: int) -> None:
        """A chunk that drew data ends the iteration at batch ``m`` (``bi`` chunks draw every
        other batch); one that drew none leaves its iterator alone."""
        while 0 < self.read < num_microbatches:
            next(self.source)
            self.read += 1
        self.read, self.ahead = 0, {}


def chunk_data(data_iterator, chunks: int) -> list[ChunkData]:
    """One :class:`ChunkData` per chunk; refuses a list of the wrong length or one iterator
    shared by several chunks."""
    if not isinstance(data_iterator, list):
        data_iterator = [data_iterator] * chunks if chunks == 1 else data_iterator
    if not isinstance(data_iterator, list) or len(data_iterator) != chunks:
        raise ValueError(f"data_iterator must be a list of {chunks} iterators, one per chunk")
    shared = [it for it in data_iterator if it is not None]
    if len({id(it) for it in shared}) != len(shared):
        raise ValueError(
            "each model chunk needs its own data iterator (megatron builds one per chunk); "
            "the same iterator object was given for several chunks"
        )
    return [ChunkData(it, c) for c, it in enumerate(data_iterator)]
