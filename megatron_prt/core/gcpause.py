"""Pause Python's cyclic garbage collector while the planner builds large plans.

A plan of P=64, R=8, m=512 holds half a million actions, each a small tuple; every few
hundred allocations the collector would walk all live containers, which costs more than
building the plan. Plans hold no reference cycles, so reference counting frees them."""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable
from typing import TypeVar

F = TypeVar("F", bound=Callable)


def without_gc(fn: F) -> F:
    """Run ``fn`` with the cyclic collector paused (restored afterwards, also on error;
    nested calls leave it to the outermost)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if not gc.isenabled():
            return fn(*args, **kwargs)
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            gc.enable()

    return wrapper  # type: ignore[return-value]
