"""Run-length expansion on the host: per-run tables (``k`` entries) -> per-position arrays.

Every per-position index of a plan is piecewise ``+1`` over *runs* of consecutive positions (a slot, a CP chunk
of a slot, its real tokens, its padding). The per-run arithmetic is numpy on ``k``-entry tables; one expansion
(``count_up``: one ``repeat`` and one add, no loop over runs) then gives the positions.
"""

from __future__ import annotations

import numpy as np

# 0, 1, 2, ... per dtype, grown to the longest expansion asked for (up to _KEPT_COUNTS entries) and read through
# views: every expansion adds it, and writing it anew each time was a third of an expansion's time.
_COUNTS: dict[np.dtype, np.ndarray] = {}
_KEPT_COUNTS = 1 << 24  # 128 MB of int64 at most; a longer expansion gets a table of its own


def counting(size: int, dtype: type = np.int64) -> np.ndarray:
    """``np.arange(size, dtype=dtype)``, read-only: a view of a table kept between calls."""
    key = np.dtype(dtype)
    counts = _COUNTS.get(key)
    if counts is None or counts.size < size:
        counts = np.arange(max(size, min(2 * (0 if counts is None else counts.size), _KEPT_COUNTS)), dtype=key)
        counts.flags.writeable = False
        if counts.size <= _KEPT_COUNTS:
            _COUNTS[key] = counts
    return counts[:size]


def run_offsets(lengths: np.ndarray) -> np.ndarray:
    """``lengths`` [k] -> [k+1] where each run begins, then the total (``cu_seqlens`` of the lengths)."""
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    lengths.cumsum(out=offsets[1:])
    return offsets


def run_starts(lengths: np.ndarray) -> np.ndarray:
    """``lengths`` [k] -> [k] position where each run begins."""
    return lengths.cumsum() - lengths


def count_up(
    first: np.ndarray, lengths: np.ndarray, dtype: type = np.int64, *, starts: np.ndarray | None = None
) -> np.ndarray:
    """Run ``k`` counts up by one from ``first[k]`` over ``lengths[k]`` positions -> [lengths.sum()] of ``dtype`` (the
    values must fit it). Zero-length runs are allowed. ``starts``: ``run_starts(lengths)``, where the caller has it."""
    starts = run_starts(lengths) if starts is None else starts
    base = (first - starts).astype(dtype, copy=False)  # [k] value at position 0 of the count
    values = base.repeat(lengths)
    values += counting(values.size, base.dtype)
    return values
