"""The per-position indices (``packing.indices``) against a per-position loop, and at the int32 boundary."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from verl_cppack.core.layouts import Runs
from verl_cppack.packing.indices import pack_index, token_index, with_sinks


def _runs(slot, offset, length) -> Runs:
    slot, offset, length = (np.asarray(a, np.int64) for a in (slot, offset, length))
    return Runs(slot, offset, length, int(length.sum()))


@st.composite
def sequences_and_runs(draw):
    """Sequences of random lengths laid out one after another in the source, and runs cutting their slots."""
    seqlens = np.array(draw(st.lists(st.integers(0, 9), min_size=1, max_size=5)), np.int64)
    slot_lengths = seqlens + np.array(draw(st.lists(st.integers(0, 4), min_size=seqlens.size, max_size=seqlens.size)))
    gaps = np.array(draw(st.lists(st.integers(0, 3), min_size=seqlens.size, max_size=seqlens.size)), np.int64)
    first = np.cumsum(gaps) + np.concatenate([[0], np.cumsum(seqlens)[:-1]])  # in order, disjoint
    rows = max(1, int(first[-1] + seqlens[-1]) + draw(st.integers(0, 3)))  # plans refuse batches without tokens
    pieces = []  # every slot cut at one random point, the parts in a random order
    for slot, length in enumerate(slot_lengths):
        cut = draw(st.integers(0, int(length)))
        pieces += [(slot, 0, cut), (slot, cut, int(length) - cut)]
    order = draw(st.permutations(range(len(pieces))))
    return seqlens, first, rows, _runs(*zip(*[pieces[i] for i in order]))


@settings(max_examples=200, deadline=None)
@given(sequences_and_runs(), st.integers(0, 4), st.booleans())
def test_pack_index_reads_the_token_shift_places_ahead_in_the_same_sequence(case, shift, wrap):
    seqlens, first, rows, runs = case
    index, zero_positions = pack_index(runs, first, seqlens, rows, shift=shift, wrap=wrap)
    expected, zeros, position = [], [], 0
    for slot, offset, length in zip(runs.slot, runs.offset, runs.length):
        for k in range(offset, offset + length):
            n = int(seqlens[slot])
            target = (k + shift) % n if wrap and k < n else k + shift
            expected.append(int(first[slot]) + target if target < n else None)
            if target >= n:
                zeros.append(position)
            position += 1
    assert zero_positions.tolist() == zeros
    assert all(0 <= value < rows for value in index.tolist())  # every position reads a row that exists
    assert [v for v, e in zip(index.tolist(), expected) if e is not None] == [e for e in expected if e is not None]


@settings(max_examples=200, deadline=None)
@given(sequences_and_runs())
def test_the_copy_back_puts_every_token_on_its_row_and_each_padding_position_on_a_row_of_its_own(case):
    seqlens, first, rows, runs = case
    read, padding = pack_index(runs, first, seqlens, rows)
    kept = read.copy()
    index, sinks = with_sinks(read, padding, rows), padding.size
    expected, sunk = [], 0  # per position, in the runs' order
    for slot, offset, length in zip(runs.slot, runs.offset, runs.length):
        for k in range(offset, offset + length):
            if k < seqlens[slot]:
                expected.append(int(first[slot]) + k)
            else:
                expected.append(rows + sunk)  # past the output, the next unused row
                sunk += 1
    assert index.dtype == np.int64 and index.tolist() == expected and sinks == sunk
    assert np.array_equal(read, kept)  # pack's own index is left as it was


@settings(max_examples=200, deadline=None)
@given(sequences_and_runs())
def test_token_index_reads_every_token_in_sequence_order_where_the_runs_put_it(case):
    seqlens, _, _, runs = case
    first_token = np.concatenate([[0], np.cumsum(seqlens)[:-1]])  # the tokens one after another
    stream_position, position = {}, 0  # (sequence, token) -> position in the runs' order
    for slot, offset, length in zip(runs.slot, runs.offset, runs.length):
        for k in range(offset, offset + length):
            stream_position[(slot, k)] = position
            position += 1
    expected = [stream_position[(slot, k)] for slot, n in enumerate(seqlens) for k in range(int(n))]
    assert token_index(runs, first_token, seqlens).tolist() == expected


def test_indices_past_int32_are_int64_not_wrapped():
    rows = 2**31 - 2  # a source this long is hypothetical, but its index must not wrap round
    runs = _runs([0], [0], [8])  # one slot of 8 positions, 3 tokens starting 5 rows before the end
    index, zero_positions = pack_index(runs, np.array([rows - 5]), np.array([3]), rows)
    assert index.dtype == np.int64
    assert index[:3].tolist() == [rows - 5, rows - 4, rows - 3] and zero_positions.tolist() == [3, 4, 5, 6, 7]
    assert index.min() >= 0 and index.max() < rows
