"""Run-length expansion on the host: per-run tables (``k`` entries) -> per-position arrays.

Every per-position index of a plan is piecewise ``+1`` over *runs* of consecutive positions (a slot, a CP chunk
of a slot, its real tokens, its padding). The per-run arithmetic is numpy on ``k``-entry tables; one expansion
(``count_up``: one ``repeat`` and one add, no loop over runs) then gives the positions.
"""

from __future__ import annotations

import numpy as np


def run_offsets(lengths: np.ndarray) -> np.ndarray:
    """``lengths`` [k] -> [k+1] where each run begins, then the total (``cu_seqlens`` of the lengths)."""
    offsets = np.empty(len(lengths) + 1, dtype=np.int64)
    offsets[0] = 0
    np.asarray(lengths).cumsum(out=offsets[1:])
    return offsets


def run_starts(lengths: np.ndarray) -> np.ndarray:
    """``lengths`` [k] -> [k] position where each run begins."""
    return run_offsets(lengths)[:-1]


def count_up(
    first: np.ndarray, lengths: np.ndarray, out: np.ndarray | None = None, dtype: type = np.int64
) -> np.ndarray:
    """Run ``k`` counts up by one from ``first[k]`` over ``lengths[k]`` positions -> [lengths.sum()] of ``dtype`` (into
    ``out`` if given, whose dtype the values must fit). Zero-length runs are allowed."""
    offsets = run_offsets(lengths)
    total = int(offsets[-1])
    target = np.dtype(dtype if out is None else out.dtype)
    values = np.repeat((np.asarray(first, np.int64) - offsets[:-1]).astype(target, copy=False), lengths)
    values += np.arange(total, dtype=target)
    if out is None:
        return values
    out[:] = values
    return out
