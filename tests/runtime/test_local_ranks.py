"""run_local's forked ranks start without the parent's garbage (collected in a child, in the
middle of its timed steps, it stalled `megatron-prt profile --recompute-granularity
selective`'s comm timing until the deadline), and leave no process of theirs behind."""

from __future__ import annotations

import gc
import os

import pytest

from megatron_prt.runtime.local import all_ok, run_local

FINALISED_IN: list[int] = []  # pids whose collector finalised a _Cycle


class _Cycle:
    def __init__(self) -> None:
        self.me = self  # reference counting never frees it: only the collector

    def __del__(self) -> None:
        FINALISED_IN.append(os.getpid())


def _finalised_here(rank, world):
    gc.collect()
    return os.getpid() in FINALISED_IN


def test_a_child_does_not_collect_the_parents_garbage():
    enabled = gc.isenabled()
    gc.disable()  # the cycle stays uncollected until run_local forks
    try:
        _Cycle()
        finalised = all_ok(run_local(2, _finalised_here, deadline_s=60))
    finally:
        if enabled:
            gc.enable()
    assert finalised == [False, False]


def test_a_killed_rank_is_named_as_killed():
    """A rank killed at the deadline read "rank 0: None"."""
    with pytest.raises(RuntimeError, match=r"^rank 0: killed: it did not finish by the deadline$"):
        all_ok([("killed", None), ("ok", 1)])


def _start_a_child(rank, world):
    """A rank that starts a process of its own, as megatron's checkpoint writer does on each
    rank that saves (a rank is daemonic, which multiprocessing checks at start only)."""
    import multiprocessing
    import time

    multiprocessing.current_process().daemon = False
    child = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(120,))
    child.start()
    return child.pid


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_a_rank_leaves_no_process_behind():
    """A rank exits by os._exit, which skips multiprocessing's finalizers: every save of a
    megatron checkpoint in a test left its writer's Manager server (some 270 MB) running."""
    pids = all_ok(run_local(2, _start_a_child, deadline_s=120))
    assert not [pid for pid in pids if _alive(pid)], pids


def _late_and_later(rank, world):
    import time

    time.sleep(3 if rank == 0 else 7.5)  # rank 1 reports past the 6 s deadline
    return rank


def test_the_deadline_bounds_the_whole_run():
    """Each report got the whole deadline: rank 1, reporting 1.5 s past a 6 s deadline but
    within 6 s of rank 0's report, was taken as finished (up to world x the deadline)."""
    results = run_local(2, _late_and_later, deadline_s=6)
    assert results == [("ok", 0), ("killed", None)]
