"""CPU-only tuning for pipeline runs.

Training frees and reallocates the same large buffers (activations, gradients) every
micro-batch. glibc returns large blocks to the OS (mmap'd chunks, heap trimming), so every
reallocation page-faults again: on a small CPU machine that costs more than a pipeline
bubble. :func:`keep_freed_memory` asks glibc to keep freed memory for reuse instead.
"""

from __future__ import annotations

import ctypes
import ctypes.util

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_MAX = 32 << 20  # glibc's upper limit for M_MMAP_THRESHOLD on 64-bit


def keep_freed_memory() -> bool:
    """Serve blocks up to 32 MiB from the heap and never trim it (process-wide, glibc only).

    Returns whether glibc accepted both settings; a no-op returning False elsewhere. Peak
    resident memory stays at its high-water mark, which a training process reaches anyway.
    """
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    ok = mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX) == 1
    return ok and mallopt(_M_TRIM_THRESHOLD, 1 << 30) == 1
