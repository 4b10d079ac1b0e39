"""The per-position indices of a plan, computed on the host from per-run tables (no loop over sequences).

A pack reads ``out[p] = rows[index[p]]``, a copy back writes ``out[index[p]] = stream[p]``; either index counts up
by one along each *run* of the layout (a slot, or a CP chunk of one): one expansion (``core.runs.count_up``) of a
``k``-entry table. ``pack_index``: runs read from the source rows, ``shift`` places ahead inside each sequence, and
the positions with no token to read (int32 unless a table is too long: half int64's memory traffic);
``with_sinks``: that index at ``shift=0`` as the copy back's scatter index; ``token_index``: what a jagged copy back
reads (it holds only tokens: one op and a smaller index than writing every position).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from verl_cppack.core.checks import MAX_STREAM_POSITIONS
from verl_cppack.core.layouts import Runs
from verl_cppack.core.runs import count_up, counting, run_starts

_INT32_LIMIT = MAX_STREAM_POSITIONS - 1  # an int32 index holds values below this


def index_dtype(largest_value: int) -> type:
    """int32 when every value fits, else int64."""
    return np.int32 if largest_value < _INT32_LIMIT else np.int64


def pack_index(
    runs: Runs,
    first_value: np.ndarray,  # [n] row of each sequence's first token in what is read
    seqlens: np.ndarray,  # [n] tokens per sequence
    rows: int,  # rows of what is read (indices stay below)
    *,
    shift: int = 0,
    wrap: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """``(index [runs.total], zero_positions [Z] int64)``: position ``p`` of the runs reads row ``index[p]``, the
    token ``shift`` places after the one it holds in the same sequence (``wrap``: counted round the sequence); the
    positions whose target is no token (padding, past the sequence end) read an in-range row and are listed in
    ``zero_positions``."""
    seqlen, length = runs.per_run(seqlens), runs.length
    reach = runs.offset + (shift % np.maximum(seqlen, 1) if wrap else shift)  # [k] the token each run's start reads
    ahead = np.minimum(np.maximum(seqlen - reach, 0), length)  # positions with a target in order
    used = np.minimum(np.maximum(seqlen - runs.offset, 0), length) if wrap else ahead  # ... or wrapped round
    first = runs.per_run(first_value) + reach
    ends = first + length  # [k] past the last value each run reads (padding counts past the last token)
    top = int(ends.max(initial=0))
    starts = run_starts(length)
    index = count_up(first, length, dtype=index_dtype(max(top, rows)), starts=starts)
    if wrap:
        wrapped = used - ahead
        if wrapped.any():  # those positions read seqlen rows back
            index[count_up(starts + ahead, wrapped)] -= seqlen.repeat(wrapped).astype(index.dtype)
    if top > rows:
        # padding reads past the last row: clamp from the first run that does on (rows in range stay as they are)
        tail = index[int(starts[(ends > rows).argmax()]) :]
        np.minimum(tail, rows - 1, out=tail)
    if int(used.sum()) == runs.total:  # every position holds a target: nothing to zero
        return index, np.empty(0, np.int64)
    return index, count_up(starts + used, length - used)


def with_sinks(index: np.ndarray, padding: np.ndarray, rows: int) -> np.ndarray:
    """``pack_index``'s ``(index, zero_positions)`` at ``shift=0`` as the copy back's scatter index (int64, a new
    array): each position writes back the row it reads, and each position without a token a row of its own from
    ``rows`` on (dropped after the scatter), so no two positions share a row and the scatter stays deterministic."""
    index = index.astype(np.int64)
    if padding.size:
        index[padding] = counting(padding.size) + rows
    return index


def token_index(
    runs_of_all_ranks: Runs,  # every rank's local stream as runs, rank 0 first
    first_token: np.ndarray,  # [n] place of each sequence's first token among the N tokens (cu_seqlens[:-1])
    seqlens: np.ndarray,  # [n] tokens per sequence
) -> np.ndarray:
    """``index [N]``: the rank-major position of each token, tokens in sequence order (what a jagged copy back reads).
    Each run's tokens open it and are in order; the runs sorted by their first token are the tokens in order."""
    runs = runs_of_all_ranks
    tokens = np.minimum(np.maximum(runs.per_run(seqlens) - runs.offset, 0), runs.length)  # [k] tokens in each run
    first = runs.per_run(first_token) + runs.offset  # [k] place of each run's first token
    start = run_starts(runs.length)  # [k] its rank-major position
    if first.size > 1 and (first[1:] < first[:-1]).any():
        order = np.argsort(first, kind="stable")
        first, start, tokens = first[order], start[order], tokens[order]
    return count_up(start, tokens, dtype=index_dtype(runs.total))


@functools.cache
def compiled_kernels() -> Any:
    """``packing.compiled`` (the common case's indices in one compiled call each), or None where numba is not
    installed or cannot set up here (no directory to cache in...): the numpy functions above then build them."""
    try:
        from verl_cppack.packing import compiled
    except (ImportError, RuntimeError):
        return None
    return compiled
