"""run_local's forked ranks start without the parent's garbage: collected in a child, in the
middle of its timed steps, it stalled `megatron-prt profile --recompute-granularity
selective`'s comm timing until the deadline."""

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
