"""Extreme magnitudes and every dtype: the right result or a clear ValueError/TypeError, never a wrapped value.

THD offsets are int32, so every length, multiple and stream total must stay below 2**31; values past that are
refused before any arithmetic (int64 would wrap silently). Copies move the bytes of any dtype.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests import oracle
from verl_cppack import Alignment, ParallelContext, pack_documents, plan_from_lengths, plan_from_mask, zigzag_indices

LIMIT = 2**31  # THD offsets are int32
huge = st.integers(LIMIT, 2**64)  # beyond int32 offsets, some beyond int64 too


@settings(max_examples=30, deadline=None)
@given(lengths=st.lists(st.integers(0, 2**20), min_size=1, max_size=4), multiple=st.integers(1, 2**31 - 1))
def test_large_lengths_and_multiples_give_the_oracle_offsets_or_a_clear_error(lengths, multiple):
    expected = oracle.offsets(oracle.padded_lengths(lengths, multiple, multiple))
    if sum(lengths) == 0:
        with pytest.raises(ValueError, match="zero valid tokens"):
            plan_from_lengths(lengths, alignment=multiple)
    elif expected[-1] >= LIMIT:
        with pytest.raises(ValueError, match="int32"):
            plan_from_lengths(lengths, alignment=multiple)
    else:
        plan = plan_from_lengths(lengths, alignment=multiple)
        assert plan.cu_seqlens_padded.tolist() == expected
        assert plan.total_length == expected[-1]


@settings(max_examples=20, deadline=None)
@given(length=huge, count=st.integers(1, 4), as_tensor=st.booleans())
def test_a_sequence_longer_than_an_int32_stream_is_refused(length, count, as_tensor):
    seqlens = [min(length, 2**63 - 1)] * count if as_tensor else [length] * count
    with pytest.raises(ValueError, match="cannot be packed: THD offsets are int32"):
        plan_from_lengths(torch.tensor(seqlens) if as_tensor else seqlens)


@settings(max_examples=20, deadline=None)
@given(multiple=huge)
def test_an_alignment_past_int32_is_refused(multiple):
    mask = torch.ones(4, 6, dtype=torch.bool)
    with pytest.raises(ValueError, match="alignment must be < 2\\*\\*31"):
        plan_from_mask(mask, alignment=multiple)
    for field in ("slot_multiple", "stream_multiple", "min_stream_length"):
        with pytest.raises(ValueError, match=f"{field} must be < 2\\*\\*31"):
            Alignment(**{field: multiple})


def test_the_issue_examples_no_longer_wrap_to_an_empty_stream():
    with pytest.raises(ValueError):
        plan_from_mask(torch.ones(4, 6, dtype=torch.bool), alignment=2**62)
    with pytest.raises(ValueError):
        plan_from_lengths([2**62] * 4)
    # the largest stream that fits is still planned exactly
    plan = plan_from_lengths([1, 1], alignment=2**30 - 1)
    assert plan.total_length == 2 * (2**30 - 1)


@settings(max_examples=20, deadline=None)
@given(shift=huge)
def test_a_shift_past_int32_is_refused(shift):
    plan = plan_from_lengths([3, 2])
    with pytest.raises(ValueError, match="shift must be < 2\\*\\*31"):
        plan.pack(torch.nested.nested_tensor([torch.ones(3), torch.ones(2)], layout=torch.jagged), shift=shift)
    with pytest.raises(ValueError, match="shift must be < 2\\*\\*31"):
        plan.target_mask(shift)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.bool, torch.float32])
def test_cu_seqlens_must_be_int32_or_int64(dtype):
    """A narrow dtype wraps (uint8 [0, 200, 100] looked non-decreasing): refused, whatever the values."""
    with pytest.raises(TypeError, match="int32 or int64"):
        zigzag_indices(torch.tensor([0, 4, 8]).to(dtype), 2, 0)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_decreasing_offsets_are_found_in_every_accepted_dtype(dtype):
    info = torch.iinfo(dtype)
    with pytest.raises(ValueError, match="non-decreasing"):
        zigzag_indices(torch.tensor([0, 200, 100], dtype=dtype), 2, 0)
    for outside in ([0, info.max - info.max % 4, info.min], [0, 4, info.min]):  # differences that overflow the dtype
        with pytest.raises(ValueError, match=r"must lie in \[0, 2\*\*31\)"):
            zigzag_indices(torch.tensor(outside, dtype=dtype), 2, 0)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64])
def test_token_ids_the_tokens_cannot_hold_are_refused(dtype):
    info = torch.iinfo(dtype)
    tokens = torch.tensor([[1, 2, 3, 3]], dtype=dtype)
    for outside in (info.max + 1, info.min - 1, info.max + 4):  # info.max + 4 wraps to 3 in uint8
        with pytest.raises(ValueError, match="does not fit the tokens' dtype"):
            pack_documents(tokens, eod_id=outside, pad_id=0)
        with pytest.raises(ValueError, match="does not fit the tokens' dtype"):
            pack_documents(tokens, eod_id=3, pad_id=outside)
    docs = pack_documents(tokens, eod_id=3, pad_id=info.max)  # the extreme ids themselves are fine
    assert docs.cu_seqlens.tolist() == [0, 3, 4]


ALL_DTYPES = [
    getattr(torch, name)
    for name in (
        "bool",
        "uint8",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint16",
        "uint32",
        "uint64",
        "float16",
        "bfloat16",
        "float32",
        "float64",
        "complex64",
        "complex128",
        "float8_e4m3fn",
        "float8_e5m2",
        "float8_e4m3fnuz",
        "float8_e5m2fnuz",
        "float8_e8m0fnu",
    )
    if isinstance(getattr(torch, name, None), torch.dtype)
]


def _bytes_of(x: torch.Tensor) -> torch.Tensor:
    """Element-wise bytes, so values of any dtype (NaN payloads included) compare exactly."""
    return x.contiguous().view(torch.uint8).view(*x.shape, x.element_size())


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@settings(max_examples=8, deadline=None)
@given(
    mask=st.lists(st.lists(st.booleans(), min_size=8, max_size=8), min_size=4, max_size=6).filter(
        lambda rows: any(map(any, rows))
    ),
    cp_size=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**16),
)
def test_pack_restore_and_unpack_move_the_bytes_of_every_dtype(dtype, mask, cp_size, seed):
    mask_tensor = torch.tensor(mask)
    high = 2 if dtype == torch.bool else 256  # a bool byte is 0 or 1; any byte pattern for the others
    source = torch.randint(
        0,
        high,
        (*mask_tensor.shape, 2 * torch.empty((), dtype=dtype).element_size()),
        generator=torch.Generator().manual_seed(seed),
        dtype=torch.uint8,
    ).view(dtype)
    plans = [plan_from_mask(mask_tensor, ParallelContext(cp_size=cp_size, cp_rank=r)) for r in range(cp_size)]
    locals_ = [plan.pack(source) for plan in plans]
    for plan, local in zip(plans, locals_):
        assert local.dtype == dtype
        stream = oracle.stream_of_rows(mask, plan.seqlens_padded.tolist())
        index = plan.local_index.tolist()
        valid = plan.local_valid_mask.tolist()
        for position, (stream_position, is_valid) in enumerate(zip(index, valid)):
            expected = (
                _bytes_of(source[stream[stream_position]]) if is_valid else torch.zeros_like(_bytes_of(source[0, 0]))
            )
            assert torch.equal(_bytes_of(local[0, position]), expected)
    restored = plans[0].restore(locals_)
    assert restored.dtype == dtype
    zeros = torch.zeros_like(_bytes_of(source))
    assert torch.equal(_bytes_of(restored), torch.where(mask_tensor[..., None, None], _bytes_of(source), zeros))
    if cp_size == 1:
        assert torch.equal(_bytes_of(plans[0].unpack(locals_[0])), _bytes_of(restored))
        assert torch.equal(_bytes_of(plans[0].unpack_nested(locals_[0]).values()), _bytes_of(source[mask_tensor]))
