"""A CPU mask's plan tables and pack index in one compiled call (numba): what ``builders`` otherwise computes with ~60
numpy calls (``mask_rows.MaskRows.scan``, ``Alignment.pad``, ``indices.pack_index``), whose fixed cost is most of a
small micro-batch's packing, and at large B a faster mask scan (a word of 8 columns at a time to each row's first and
last token, then the tokens between summed in a vectorised loop). The loops over rows and runs are compiled code's.

It covers the common case and declines the rest (``None``: the numpy path then handles or refuses it): rows whose
tokens form one run, the zigzag cut (any layout at CP=1), int32 indices. Its results are the numpy path's, value for
value (``tests/test_compiled_plan.py``). Imported only where numba is (``builders``); compiled once per process and
mask dtype, the machine code cached on disk where numba can write (``NUMBA_CACHE_DIR``, else beside this module).
"""

from __future__ import annotations

import numba
import numpy as np

from verl_cppack.core.alignment import Alignment, pad_lengths
from verl_cppack.core.checks import MAX_STREAM_POSITIONS
from verl_cppack.packing.mask_rows import check_values

_INT32_LIMIT = MAX_STREAM_POSITIONS - 1  # an int32 index holds values below this (as ``indices.index_dtype``)
_pad_lengths = numba.njit(cache=True, nogil=True)(pad_lengths)  # the one padding formula, compiled


@numba.njit(cache=True, nogil=True)
def _token_span(values: np.ndarray, words: np.ndarray) -> tuple[int, int]:
    """``(first, last)`` token column of one row (``first > last``: none), 8 columns at a time through ``words``
    (the row as 64-bit words, or empty)."""
    first, last = 0, values.size - 1
    if words.size:
        word = 0
        while word < words.size and words[word] == 0:
            word += 1
        if word == words.size:
            return 0, -1
        first, word = word * 8, words.size - 1
        while words[word] == 0:
            word -= 1
        last = word * 8 + 7
    while first <= last and values[first] == 0:
        first += 1
    while last >= first and values[last] == 0:
        last -= 1
    return first, last


@numba.njit(cache=True, nogil=True)
def _tokens(span: np.ndarray, trusted: bool) -> tuple[int, int]:
    """``(tokens, entries neither 0 nor 1)`` of one row's columns ``span`` (a 1-D view: a loop over a view's own
    positions is vectorised, one over a row's columns from a variable start is not: 8x slower, measured);
    ``trusted``: 0/1 bytes (bool), summed into a 32-bit count."""
    if trusted:
        total = np.uint32(0)
        for column in range(span.size):
            total += span[column]
        return np.int64(total), 0
    count, bad = 0, 0
    for column in range(span.size):
        value = span[column]
        count += value != 0
        bad += (value < 0) | (value > 1)
    return count, bad


@numba.njit(cache=True, nogil=True)
def _count_up(out: np.ndarray, first: int, most: int) -> None:
    """``out[p] = min(first + p, most)``: one run of the pack index, a vector at a time."""
    for p in range(out.size):
        out[p] = min(first + p, most)


@numba.njit(cache=True, nogil=True)
def _run(slot_length: int, cp_size: int, rank: int, part: int) -> tuple[int, int]:
    """``(offset, length)`` of a slot's ``part`` on ``rank``: the slot at CP=1, else zigzag chunk ``rank`` (part 0)
    or ``2*CP-1-rank`` (part 1)."""
    if cp_size == 1:
        return 0, slot_length
    chunk = slot_length // (2 * cp_size)
    return (rank if part == 0 else 2 * cp_size - 1 - rank) * chunk, chunk


@numba.njit(cache=True, nogil=True)
def _plan_kernel(values, words, trusted, slot_multiple, stream_multiple, min_slot, min_stream, cp_size, cp_rank):
    """``mask_plan_tables``' work: ``(planned, bad entries, seqlens, seqlens_padded, cu_seqlens, cu_seqlens_padded,
    sequence_start, index [T/CP] int32, zero_positions [Z] int64)``; the arrays empty unless planned."""
    rows, columns = values.shape
    seqlens, start = np.zeros(rows, np.int64), np.zeros(rows, np.int64)
    none32, none64 = np.empty(0, np.int32), np.empty(0, np.int64)
    declined = (False, 0, none64, none64, none64, none64, none64, none32, none64)
    bad = 0
    for row in range(rows):
        first, last = _token_span(values[row], words[row])
        start[row] = row * columns + (first if first <= last else 0)  # an empty row: column 0, as argmax answers
        seqlens[row], wrong = _tokens(values[row, first : last + 1], trusted)
        bad += wrong
        if first <= last and seqlens[row] != last - first + 1 and not bad:  # a row with gaps
            return declined
    if bad:
        return (False, bad, none64, none64, none64, none64, none64, none32, none64)
    padded = _pad_lengths(seqlens, slot_multiple, stream_multiple, min_slot, min_stream)  # Alignment.pad's formula
    stream = padded.sum()
    cu_seqlens, cu_padded = np.zeros(rows + 1, np.int64), np.zeros(rows + 1, np.int64)
    cu_seqlens[1:], cu_padded[1:] = np.cumsum(seqlens), np.cumsum(padded)
    source_rows, parts = rows * columns, 2 if cp_size > 1 else 1  # runs per slot
    if cu_seqlens[rows] == 0 or stream >= _INT32_LIMIT or source_rows >= _INT32_LIMIT:
        return declined  # nothing to pack, or a stream or an index past int32: the numpy path refuses or handles it
    top, zeros = 0, 0  # the largest value read, the positions to zero
    for row in range(rows):
        for part in range(parts):
            offset, chunk = _run(padded[row], cp_size, cp_rank, part)
            top = max(top, start[row] + offset + chunk)
            zeros += chunk - min(max(seqlens[row] - offset, 0), chunk)
    if top >= _INT32_LIMIT:
        return declined
    index, zero_positions = np.empty(stream // cp_size, np.int32), np.empty(zeros, np.int64)
    position, zeroed, clamping = 0, 0, False
    for row in range(rows):  # the runs in stream order
        for part in range(parts):
            offset, chunk = _run(padded[row], cp_size, cp_rank, part)
            clamping = clamping or start[row] + offset + chunk > source_rows  # from the first run reading past the end
            _count_up(index[position : position + chunk], start[row] + offset, source_rows - 1 if clamping else top)
            for p in range(position + min(max(seqlens[row] - offset, 0), chunk), position + chunk):
                zero_positions[zeroed] = p
                zeroed += 1
            position += chunk
    return (True, 0, seqlens, padded, cu_seqlens, cu_padded, start, index, zero_positions)


@numba.njit(cache=True, nogil=True)
def _copy_back_kernel(seqlens, padded, start, source_rows, cp_size):
    """``copy_back_index``' work: every rank's zigzag runs in rank order, tokens to their rows, padding to sinks."""
    index = np.empty(padded.sum(), np.int64)
    parts, position, sink = 2 if cp_size > 1 else 1, 0, source_rows
    for rank in range(cp_size):
        for row in range(seqlens.size):
            for part in range(parts):
                offset, chunk = _run(padded[row], cp_size, rank, part)
                used = min(max(seqlens[row] - offset, 0), chunk)
                _count_up(index[position : position + used], start[row] + offset, source_rows)
                for p in range(position + used, position + chunk):
                    index[p] = sink
                    sink += 1
                position += chunk
    return index


def copy_back_index(
    seqlens: np.ndarray, seqlens_padded: np.ndarray, sequence_start: np.ndarray, source_rows: int, cp_size: int
) -> np.ndarray:
    """``[T]`` int64: the row each position of the rank-major zigzag stream (every rank's local stream, rank 0 first)
    is written on: its token's source row, or, for padding, a sink row of its own from ``source_rows`` on, in
    position order (``indices.with_sinks`` of ``indices.pack_index`` of every rank's runs, in one call). The tables
    are a plan's (``plan.SequenceTables``)."""
    return _copy_back_kernel(seqlens, seqlens_padded, sequence_start, source_rows, cp_size)


def mask_plan_tables(
    values: np.ndarray, alignment: Alignment, cp_size: int, cp_rank: int
) -> tuple[np.ndarray, ...] | None:
    """``values`` [B, S]: a CPU mask's memory (``core.host.host_memory``) -> ``(seqlens, seqlens_padded, cu_seqlens,
    cu_seqlens_padded, sequence_start, index, zero_positions)``, the tables of ``packing.plan.SequenceTables`` and
    ``indices.pack_index`` of this rank's zigzag runs at shift 0; ``None`` where it declines (see the module
    docstring). ``ValueError`` for mask values other than 0/1, as ``MaskRows.scan``."""
    trusted = values.dtype == np.bool_
    if trusted:
        values = values.view(np.uint8)
    contiguous_words = values.itemsize == 1 and values.shape[1] % 8 == 0 and values.flags.c_contiguous
    words = values.view(np.uint64) if contiguous_words else np.empty((values.shape[0], 0), np.uint64)
    policy = alignment.slot_multiple, alignment.stream_multiple, alignment.min_slot_length, alignment.min_stream_length
    planned, bad, *tables = _plan_kernel(values, words, trusted, *policy, cp_size, cp_rank)
    check_values(bad)
    return tuple(tables) if planned else None
