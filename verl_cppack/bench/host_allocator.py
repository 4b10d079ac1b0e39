"""Keep freed host memory in the process while benchmarking on the CPU (glibc ``mallopt``).

By default glibc hands large freed buffers back to the operating system (``mmap`` chunks, heap trimming), so
the next micro-batch's buffers of the same size are fresh pages, and first-touch page faults (about a
microsecond per 4 KiB page on a VM) land on whichever allocation the heuristics pick that run: identical runs
then move by up to 2x. On GPUs the caching allocator keeps memory for both implementations; this does the same
for the host heap. It applies to every implementation in the process alike.
"""

from __future__ import annotations

import ctypes
import ctypes.util

_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3


def keep_freed_memory() -> bool:
    """Raise glibc's trim and mmap thresholds (to 1 GiB and its 32 MiB maximum); ``False`` without glibc."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        mallopt = libc.mallopt if libc is not None else None
    except (OSError, AttributeError):
        return False
    if mallopt is None:
        return False
    settings = ((_M_MMAP_THRESHOLD, 32 << 20), (_M_TRIM_THRESHOLD, 1 << 30), (_M_TOP_PAD, 64 << 20))
    return all(mallopt(option, value) == 1 for option, value in settings)
