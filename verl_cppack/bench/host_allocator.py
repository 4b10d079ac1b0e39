"""Keep freed host memory in the process while benchmarking on the CPU (glibc ``mallopt``).

glibc returns large freed buffers to the OS, so first-touch page faults land on whichever allocation its heuristics
pick and identical runs differ; this keeps the heap as a GPU caching allocator would, for every implementation alike."""

from __future__ import annotations

import ctypes
import ctypes.util

_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3


def keep_freed_memory() -> bool:
    """Raise glibc's trim and mmap thresholds (to 1 GiB and its 32 MiB maximum); ``False`` without glibc."""
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt if name else None
    except (OSError, AttributeError):
        mallopt = None
    if mallopt is None:
        return False
    settings = ((_M_MMAP_THRESHOLD, 32 << 20), (_M_TRIM_THRESHOLD, 1 << 30), (_M_TOP_PAD, 64 << 20))
    return all(mallopt(option, value) == 1 for option, value in settings)
