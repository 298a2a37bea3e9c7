"""A few integers from every rank of a group, through the group's store, not a collective.

[Note: start-up checks leave nothing in flight]
The checks before a runtime's first message (same plan, same placement) wait a bounded time
for every rank. A collective waited with a timeout raises in time but stays in flight: the
process group's worker still holds it, and the process cannot exit until the missing peer
joins (or the group's own timeout, 30 minutes by default, passes), so a launcher such as
torchrun never learns that the rank failed. Through the group's store each rank writes its
row under its own key and waits for the others' keys; a wait that times out leaves nothing
behind, the rank raises and exits, and the launcher stops the job. The store is the group's
rendezvous store on any backend, so the bound holds on NCCL too, and the GPU is not touched.

Torch versions without ``ProcessGroup.get_group_store`` fall back to one all_gather of the
rows (waited with the timeout on gloo), with the hang described above.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from .errors import collective, is_wait_failure, peer_failed
from .p2p import wire_device

_PREFIX = "megatron_prt/exchange/"
_SLICE_S = 0.5  # each blocking wait on the store; the failure board is read between them


def gather_ints(
    values: Sequence[int], what: str, group, timeout_s: float | None, device="cpu"
) -> list[list[int]]:
    """Every rank's ``values`` (same length on every rank), by group rank. Collective over
    ``group`` (None: the default group): every rank calls it, in the same order of ``what``.
    ``what`` names the check in errors and keys; ``timeout_s`` bounds the wait for the other
    ranks (None: the process group's timeout); ``device``: where this rank computes (the
    all_gather fallback's tensors, for NCCL). Raises :class:`PipelineError` naming the ranks
    that did not arrive in time (see [Note: start-up checks leave nothing in flight])."""
    group = group or dist.group.WORLD
    store = _group_store(group)
    if store is None:
        return _all_gather(values, what, group, timeout_s, device)
    rows = _store_rows([str(int(v)) for v in values], what, group, timeout_s, store)
    return [[int(v) for v in row] for row in rows]


def gather_words(words: Sequence[str], what: str, group, timeout_s: float) -> list[list[str]]:
    """:func:`gather_ints` for words (no commas: a host name, a number as text). Without a
    group store: all_gather_object, waited without a bound."""
    group = group or dist.group.WORLD
    store = _group_store(group)
    if store is None:
        rows: list = [None] * dist.get_world_size(group)
        with collective(what, group):
            dist.all_gather_object(rows, list(words), group)
        return rows
    return _store_rows(list(words), what, group, timeout_s, store)


def _store_rows(words: list[str], what: str, group, timeout_s, store) -> list[list[str]]:
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    # this rank's n-th exchange of `what` meets the others' n-th: a counter per rank
    call = store.add(f"{_PREFIX}{what}/calls/{rank}", 1)
    keys = [f"{_PREFIX}{what}/{call}/{r}" for r in range(world)]
    store.set(keys[rank], ",".join(words))
    with collective(what, group):
        _wait(store, keys, what, group, timeout_s)
    rows = [store.get(key).decode() for key in keys]
    _delete_previous_row(store, what, call, rank)
    return [row.split(",") if row else [] for row in rows]


def _delete_previous_row(store, what: str, call: int, rank: int) -> None:
    """Delete this rank's row of call ``call - 1``, so the store holds at most one row per
    rank and check, however many checks a job runs. Safe once call ``call`` has every row:
    a rank writes its call-``call`` row only after its call ``call - 1`` read every row (or
    raised, and reads nothing more). Stores without ``delete_key`` keep the rows."""
    if call > 1:
        try:
            store.delete_key(f"{_PREFIX}{what}/{call - 1}/{rank}")
        except (AttributeError, NotImplementedError, RuntimeError):
            pass


def _wait(store, keys: list[str], what: str, group, timeout_s: float | None) -> None:
    """Until every rank's key is written; raises when ``timeout_s`` passes or another rank
    posts an error to the failure board meanwhile (a peer that raised before reaching this
    check does not keep the others waiting; a killed one cannot post, so its peers wait
    ``timeout_s``; a report of an earlier runtime whose error was caught is not this
    check's: [Note: reports of an earlier runtime] in errors.py). Waits in blocking slices
    on the store server, so a thousand waiting ranks cost it a few calls a second each."""
    if timeout_s is None:
        store.wait(keys)
        return
    start = time.monotonic()
    while True:
        left = timeout_s - (time.monotonic() - start)
        try:
            store.wait(keys, timedelta(seconds=max(min(_SLICE_S, left), 0.001)))
            return
        except Exception as exc:  # a slice timed out (DistStoreError), or the store failed
            if not is_wait_failure(exc):
                raise
        missing = _missing(store, keys)
        if not missing:
            return
        if peer_failed(group):
            raise ConnectionAbortedError(f"rank(s) {missing} did not reach {what}")
        if time.monotonic() - start >= timeout_s:
            raise TimeoutError(f"rank(s) {missing} did not reach {what} within {timeout_s} s")


def _missing(store, keys: list[str]) -> list[int]:
    return [r for r, key in enumerate(keys) if not store.check([key])]


def _group_store(group):
    """The group's store, or None on torch without ``ProcessGroup.get_group_store``."""
    getter = getattr(group, "get_group_store", None)
    return None if getter is None else getter()


def _all_gather(values, what, group, timeout_s, device) -> list[list[int]]:
    mine = torch.tensor(list(values), dtype=torch.int64, device=wire_device(group, device))
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    wait = () if timeout_s is None or dist.get_backend(group) == "nccl" else (timeout_s,)
    with collective(what, group):
        work = dist.all_gather(gathered, mine, group=group, async_op=True)
        work.wait(*(timedelta(seconds=s) for s in wait))
    return [[int(v) for v in t] for t in gathered]
