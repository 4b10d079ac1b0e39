"""The per-position indices of a plan, computed on the host from per-run tables (no loop over sequences).

Every copy a plan makes reads ``out[p] = rows[index[p]]``; the index counts up by one along each *run* of the
layout (a slot, or a CP chunk of one), so it is one expansion (``core.runs.count_up``) of a ``k``-entry table:

- ``pack_index``: this rank's local stream read from the source rows, ``shift`` places ahead inside each sequence
  (``wrap``: round inside it); the positions whose target is no token are listed to be zeroed after the copy;
- ``unpack_index``: the source rows read from the rank-major stream (every rank's local stream, rank 0 first)
  followed by one zero row, where every row without a token reads (after a clamp; an output whose rows are all
  tokens reads no zero row).

Indices are int32 (half the memory traffic of int64, and ``index_select`` takes them) unless a table is too long.
"""

from __future__ import annotations

import numpy as np

from verl_cppack.core.layouts import Runs
from verl_cppack.core.runs import count_up, run_starts

_INT32_LIMIT = 2**31 - 1


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


def unpack_index(
    runs_of_all_ranks: Runs,  # every rank's local stream as runs, rank 0 first
    first_value: np.ndarray,  # [n] row of each sequence's first token in the output (non-decreasing)
    seqlens: np.ndarray,  # [n] tokens per sequence
    rows: int,  # rows of the output
    zero_row: int,  # the rank-major stream's zero row (its length)
) -> np.ndarray:
    """``index [rows]``: output row ``q`` reads rank-major row ``index[q]``; rows without a token read ``zero_row``
    once clamped to it (they count up from it: the caller clamps the index where it is used, one vectorised pass on
    the device; numpy's clamp of an int32 table is ~10x slower here). The chunks of each sequence are found where
    the layout put them; sequences' tokens are disjoint and in order in the output, so the chunks sorted by their
    first output row are the output in order."""
    runs = runs_of_all_ranks
    tokens = np.minimum(np.maximum(runs.per_run(seqlens) - runs.offset, 0), runs.length)  # [k] tokens in each run
    chunks = tokens > 0
    first = (runs.per_run(first_value) + runs.offset)[chunks]  # output row of each chunk's first token
    start, length = run_starts(runs.length)[chunks], tokens[chunks]  # its rank-major position, its tokens
    if first.size > 1 and (first[1:] < first[:-1]).any():
        order = np.argsort(first, kind="stable")
        first, start, length = first[order], start[order], length[order]
    firsts, lengths = np.empty((2, 2 * first.size + 1), np.int64)  # runs: a gap before each chunk, the chunk; a gap
    firsts.fill(zero_row)
    firsts[1::2], lengths[1::2] = start, length
    lengths[:-1:2], lengths[-1] = first, rows  # each gap ends where the next chunk (or the output) begins ...
    lengths[2::2] -= first + length  # ... and starts where the chunk before it ends
    return count_up(firsts, lengths, dtype=index_dtype(zero_row + rows))
