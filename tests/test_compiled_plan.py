"""A CPU mask's compiled plan build (``packing.compiled``) is the numpy build, value for value: every per-sequence
table, the padded offsets sent to the device, this rank's pack index and positions to zero, what ``pack`` returns,
the copy back's scatter index (every rank's positions, padding on sink rows), and every error (same type, same message) — for random masks of one run per row or with gaps, every mask dtype
``require_mask`` takes, strided masks, widths on and off the 8-column words, CP 1-4 on every rank, TP 1-2, both
layouts, verl's default, FP8 and explicit alignments with minimum lengths."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verl_cppack import ParallelContext
from verl_cppack.core.alignment import Alignment
from verl_cppack.packing.builders import plan_from_checked_mask
from verl_cppack.packing.indices import compiled_kernels

pytest.importorskip("numba")

MASK_DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64]
TABLES = ("seqlens", "seqlens_padded", "cu_seqlens", "cu_seqlens_padded", "sequence_start")
SCALARS = ("batch_size", "source_shape", "max_seqlen", "max_seqlen_padded", "num_valid_tokens", "total_length")


@st.composite
def masks(draw) -> np.ndarray:
    """[B, S] 0/1: rows of one run (left, right, middle padding), empty, full, or scattered (gaps)."""
    width = draw(st.one_of(st.integers(1, 20), st.sampled_from([8, 16, 64, 72])))
    rows = []
    for _ in range(draw(st.integers(1, 6))):
        kind = draw(st.sampled_from(["run", "run", "run", "empty", "full", "scattered"]))
        row = np.zeros(width, np.int64)
        if kind == "full":
            row[:] = 1
        elif kind == "scattered":
            row[:] = draw(st.lists(st.integers(0, 1), min_size=width, max_size=width))
        elif kind == "run":
            first = draw(st.integers(0, width))
            row[first : draw(st.integers(first, width))] = 1
        rows.append(row)
    return np.stack(rows)


@st.composite
def policies(draw) -> tuple[ParallelContext, str, Alignment | None, bool]:
    cp_size, tp_size = draw(st.sampled_from([1, 2, 3, 4])), draw(st.sampled_from([1, 2]))
    ctx = ParallelContext(tp_size, cp_size, draw(st.integers(0, cp_size - 1)))
    base = ctx.default_slot_multiple
    kind = draw(st.sampled_from(["default", "fp8", "explicit"]))
    alignment = None
    if kind == "explicit":
        slot = base * draw(st.integers(1, 3))
        alignment = Alignment(
            slot_multiple=slot,
            stream_multiple=slot * cp_size * draw(st.integers(1, 3)),
            min_stream_length=draw(st.integers(0, 60)),
            min_slot_length=slot * draw(st.integers(0, 2)),
        )
    return ctx, draw(st.sampled_from(["zigzag", "contiguous"])), alignment, kind == "fp8"


def _build(mask: torch.Tensor, policy: tuple, compiled: bool):
    ctx, layout, alignment, fp8 = policy
    try:
        return plan_from_checked_mask(mask, ctx, layout, alignment, fp8, compiled=compiled)
    except ValueError as error:
        return error


@settings(max_examples=300, deadline=None)
@given(
    mask=masks(),
    dtype=st.sampled_from(MASK_DTYPES),
    strided=st.booleans(),
    bad_entry=st.sampled_from([None, 2, -1]),
    policy=policies(),
)
def test_the_compiled_build_is_the_numpy_build(mask, dtype, strided, bad_entry, policy):
    tensor = torch.from_numpy(mask).to(dtype)
    if bad_entry is not None and dtype != torch.bool:  # (uint8 reads -1 as 255)
        tensor[-1, -1] = bad_entry
    if strided:  # every other column of a twice-as-wide mask: the mask's memory is read as a strided view
        tensor = torch.stack([tensor, torch.zeros_like(tensor)], dim=2).flatten(1)[:, ::2]
    compiled, numpy_built = _build(tensor, policy, True), _build(tensor, policy, False)
    if isinstance(numpy_built, ValueError):
        assert isinstance(compiled, ValueError) and str(compiled) == str(numpy_built)
        return
    assert not isinstance(compiled, ValueError), compiled
    for name in TABLES:
        ours, expected = getattr(compiled.tables, name), getattr(numpy_built.tables, name)
        assert ours.dtype == expected.dtype and np.array_equal(ours, expected), name
    for name in SCALARS:
        assert getattr(compiled, name) == getattr(numpy_built, name), name
    assert torch.equal(compiled.cu_seqlens_padded, numpy_built.cu_seqlens_padded)
    for ours, expected in zip(compiled._pack_index(0, False), numpy_built._pack_index(0, False)):
        assert ours.dtype == expected.dtype and np.array_equal(ours, expected)
    ids = torch.arange(1, tensor.numel() + 1).view(tensor.shape)
    assert torch.equal(compiled.pack(ids), numpy_built.pack(ids))
    ctx, layout = policy[0], policy[1]
    if numpy_built.token_rows is None and (ctx.cp_size == 1 or layout == "zigzag"):  # the copy back's scatter index
        expected = numpy_built._rows_written(numpy_built._stream_read)
        tables = numpy_built.tables
        ours = compiled_kernels().copy_back_index(
            tables.seqlens, tables.seqlens_padded, tables.sequence_start, numpy_built.source_rows, ctx.cp_size
        )
        assert ours.dtype == np.int64 and np.array_equal(ours, expected.numpy())


def test_numba_is_there_so_cpu_masks_take_the_compiled_build():
    assert compiled_kernels() is not None


def test_rows_with_gaps_and_empty_batches_are_left_to_the_numpy_build():
    kernel = compiled_kernels()
    alignment = Alignment.per_slot(2)
    assert kernel.mask_plan_tables(np.array([[1, 0, 1, 0]], np.bool_), alignment, 1, 0) is None  # gaps
    assert kernel.mask_plan_tables(np.zeros((2, 8), np.bool_), alignment, 1, 0) is None  # nothing to pack
    seqlens, *_, index, zero_positions = kernel.mask_plan_tables(np.array([[0, 1, 1, 1]], np.bool_), alignment, 1, 0)
    assert seqlens.tolist() == [3] and index.tolist() == [1, 2, 3, 3] and zero_positions.tolist() == [3]


def test_mask_values_other_than_0_and_1_are_refused_by_the_compiled_build():
    kernel = compiled_kernels()
    with pytest.raises(ValueError, match="attention_mask values must be 0 or 1; found 2 offending entries"):
        kernel.mask_plan_tables(np.array([[0, 1, 2], [-1, 1, 0]], np.int64), Alignment.per_slot(1), 1, 0)
