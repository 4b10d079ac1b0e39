"""Block copies (``core.blocks``) move exactly what a row-by-row loop moves, for any pieces and block size."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verl_cppack.core.blocks import block_copy

CPU = torch.device("cpu")


def loop_oracle(rows, firsts, lengths, has_target):
    """Position by position: piece k's i-th position reads row firsts[k] + i, or is zero without a target."""
    out = []
    for first, length, target in zip(firsts, lengths, has_target):
        for i in range(length):
            out.append(rows[first + i] if target else torch.zeros_like(rows[0]))
    return torch.stack(out)


@st.composite
def pieces_and_source(draw):
    source_rows = draw(st.integers(1, 300))
    pieces = []
    for _ in range(draw(st.integers(1, 12))):
        length = draw(st.integers(0, min(source_rows, 70)))
        target = draw(st.booleans())
        # targets anywhere in range; often right at the end of the source (clamped tails)
        last_first = source_rows - length
        first = draw(st.one_of(st.integers(0, last_first), st.just(last_first))) if target else draw(st.integers(-5, 5))
        pieces.append((first, length, target))
    if sum(length for _, length, _ in pieces) == 0:
        pieces.append((0, 1, True))
    block = draw(st.sampled_from([1, 2, 3, 8, 32, 64]).filter(lambda b: b <= source_rows))
    return source_rows, pieces, block


@settings(max_examples=300, deadline=None)
@given(pieces_and_source(), st.sampled_from([(), (3,)]), st.sampled_from([torch.int32, torch.int64]))
def test_block_copy_equals_a_loop(case, trailing, dtype):
    source_rows, pieces, block = case
    firsts, lengths, has_target = (np.array(column) for column in zip(*pieces))
    rows = torch.randn(source_rows, *trailing)
    gather = block_copy(
        firsts.astype(np.int64), lengths.astype(np.int64), has_target.astype(bool), block, source_rows, CPU, dtype
    )
    assert gather.windows.dtype == (dtype if block == 1 else torch.int64)
    assert torch.equal(gather.gather(rows), loop_oracle(rows, firsts, lengths, has_target))
    if block == 1:
        assert gather.fix_positions.numel() == 0
    # fix-ups are few: under one block per piece start, plus the clamped tail at the end of the source
    assert gather.fix_positions.numel() <= len(pieces) * (block - 1) + 2 * block


@settings(max_examples=200, deadline=None)
@given(pieces_and_source())
def test_blocks_of_pieces_without_target_can_read_a_zero_block(case):
    """With ``zero_rows`` (``block`` zero rows after the source) the blocks owned by pieces without a target read
    zeros and only those pieces' positions inside other blocks are zeroed one by one: the same copy."""
    source_rows, pieces, block = case
    firsts, lengths, has_target = (np.array(column) for column in zip(*pieces))
    rows = torch.cat([torch.randn(source_rows, 2), torch.zeros(block, 2)])
    gather = block_copy(
        firsts.astype(np.int64),
        lengths.astype(np.int64),
        has_target.astype(bool),
        block,
        source_rows + block,
        CPU,
        zero_rows=source_rows,
    )
    assert torch.equal(gather.gather(rows), loop_oracle(rows, firsts, lengths, has_target))
    if block > 1:  # fills are only heads: under one block per piece
        assert gather.fill_positions.numel() <= len(pieces) * (block - 1)


def test_windows_of_a_strided_source():
    """A non-contiguous source (every other row of a transposed tensor, from row 0 or 1 of its storage) is read
    through its strides and storage offset."""
    base = torch.arange(400.0).reshape(2, 200).t()  # [200, 2], strides (1, 200)
    firsts, lengths, has_target = np.array([5, 0, 59]), np.array([40, 7, 40]), np.array([True, False, True])
    for rows in (base[::2], base[1::2]):  # [100, 2], strides (2, 200), storage offset 0 / 1
        gather = block_copy(firsts, lengths, has_target, 32, rows.shape[0], CPU, torch.int32)
        assert torch.equal(gather.gather(rows), loop_oracle(rows, firsts, lengths, has_target))


def test_block_larger_than_the_source_is_refused():
    with pytest.raises(ValueError, match="block must be between 1 and the 4 source rows"):
        block_copy(np.array([0]), np.array([3]), np.array([True]), 8, 4, CPU)


def test_gradient_of_a_block_copy_adds_the_output_gradient_back_to_each_row():
    """Backward through the overlapping windows view: every source row gets the gradient of the positions that
    copied it (and nothing from padding), checked numerically and against an index_add_ of the oracle index."""
    firsts, lengths, has_target = (
        np.array([3, 0, 40, 90]),
        np.array([37, 5, 20, 10]),
        np.array([True, False, True, True]),
    )
    gather = block_copy(firsts, lengths, has_target, 8, 100, CPU)
    rows = torch.randn(100, 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(gather.gather, (rows,))
    weights = torch.randn(int(lengths.sum()), 2, dtype=torch.float64)
    (gather.gather(rows) * weights).sum().backward()
    expected = torch.zeros(100, 2, dtype=torch.float64)
    position = 0
    for first, length, target in zip(firsts, lengths, has_target):
        if target:
            expected[first : first + length] += weights[position : position + length]
        position += length
    assert torch.equal(rows.grad, expected)
