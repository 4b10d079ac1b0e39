"""Packed causal attention on one rank: the per-document reference, CP=1 paths, the LSE merge, input checks."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verl_cppack.attention import (
    allgather_kv_attention,
    context_parallel_attention,
    reference_attention,
    ring_attention,
)
from verl_cppack.attention.blocks import attention_block, merge_blocks
from verl_cppack.attention.coordinates import zigzag_half_rows
from verl_cppack.context import ParallelContext
from verl_cppack.core.layouts import zigzag_indices

SINGLE = ParallelContext()


def naive_attention(q, k, v, cu_seqlens_padded, cu_seqlens=None):
    """Textbook loops: softmax(q.k / sqrt(d)) over the earlier keys of the same document."""
    total, heads, dim = q.shape
    groups = k.shape[1]
    out = torch.zeros(total, heads, dim, dtype=torch.float64)
    lengths = cu_seqlens if cu_seqlens is not None else cu_seqlens_padded
    for doc in range(len(cu_seqlens_padded) - 1):
        start = int(cu_seqlens_padded[doc])
        length = int(lengths[doc + 1] - lengths[doc])
        for i in range(length):
            for h in range(heads):
                g = h // (heads // groups)
                scores = [float(q[start + i, h] @ k[start + j, g]) / math.sqrt(dim) for j in range(i + 1)]
                top = max(scores)
                weights = [math.exp(s - top) for s in scores]
                for j, w in enumerate(weights):
                    out[start + i, h] += w / sum(weights) * v[start + j, g].double()
    return out


def random_qkv(total, heads=4, groups=2, dim=8, seed=0, requires_grad=False):
    generator = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(total, n, dim, generator=generator) for n in (heads, groups, groups))
    return [x.requires_grad_(requires_grad) for x in (q, k, v)]


def cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def test_reference_equals_textbook_attention_with_gqa_and_padding():
    cu_padded = cu([4, 6, 2, 0, 4])
    cu_real = cu([3, 6, 0, 0, 1])
    q, k, v = random_qkv(16)
    for cu_attention in (None, cu_real):
        expected = naive_attention(q, k, v, cu_padded, cu_attention)
        got = reference_attention(q, k, v, cu_padded, cu_attention)
        torch.testing.assert_close(got.double(), expected, atol=1e-6, rtol=0)


slot_lengths = st.lists(st.integers(0, 9), min_size=1, max_size=6)


@settings(max_examples=25, deadline=None)
@given(lengths=slot_lengths, groups=st.sampled_from([1, 2, 4]), real=st.booleans(), data=st.data())
def test_cp1_paths_equal_per_document_attention_forward_and_backward(lengths, groups, real, data):
    padded = [2 * math.ceil(n / 2) for n in lengths]  # some padding in odd-length slots
    if sum(padded) == 0:
        padded[0] = 2
    cu_padded = cu(padded)
    real_lengths = [data.draw(st.integers(0, p)) for p in padded]
    if sum(real_lengths) == 0:  # at least one token attends, so there is a gradient to compare
        real_lengths[padded.index(max(padded))] = 1
    cu_real = cu(real_lengths) if real else None
    total = sum(padded)
    weight = torch.randn(total, 4, 8, generator=torch.Generator().manual_seed(1))

    q, k, v = random_qkv(total, groups=groups, requires_grad=True)
    (reference_attention(q, k, v, cu_padded, cu_real) * weight).sum().backward()
    expected = [reference_attention(q, k, v, cu_padded, cu_real).detach(), q.grad, k.grad, v.grad]

    for attention in (allgather_kv_attention, ring_attention):
        q, k, v = random_qkv(total, groups=groups, requires_grad=True)
        out = attention(q, k, v, cu_padded, SINGLE, cu_seqlens=cu_real)
        (out * weight).sum().backward()
        for got, want in zip([out.detach(), q.grad, k.grad, v.grad], expected):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_rows_past_the_real_length_are_zero_and_padding_keys_are_ignored():
    cu_padded, cu_real = cu([8, 8]), cu([5, 8])
    q, k, v = random_qkv(16)
    out = allgather_kv_attention(q, k, v, cu_padded, SINGLE, cu_seqlens=cu_real)
    assert torch.equal(out[5:8], torch.zeros_like(out[5:8]))
    k2, v2 = k.clone(), v.clone()
    k2[5:8], v2[5:8] = 100.0, -100.0  # garbage in the padding of slot 0
    out2 = allgather_kv_attention(q, k2, v2, cu_padded, SINGLE, cu_seqlens=cu_real)
    assert torch.equal(out, out2)


@settings(max_examples=25, deadline=None)
@given(num_keys=st.integers(1, 12), num_blocks=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_lse_merge_of_disjoint_key_blocks_equals_attention_over_all_keys(num_keys, num_blocks, seed):
    generator = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(n, 2, 4, generator=generator) * 4 for n in (5, num_keys, num_keys))
    mask = torch.rand(5, num_keys, generator=generator) < 0.7
    block_of_key = torch.randint(0, num_blocks, (num_keys,), generator=generator)
    whole, whole_lse = attention_block(q, k, v, mask, 0.5)
    parts = [attention_block(q, k, v, mask & (block_of_key == b), 0.5) for b in range(num_blocks)]
    merged, merged_lse = merge_blocks([p[0] for p in parts], [p[1] for p in parts])
    torch.testing.assert_close(merged, whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(merged_lse, whole_lse, atol=1e-5, rtol=1e-5)


def test_a_query_that_sees_no_key_gives_zero_output_and_finite_gradients():
    q, k, v = (torch.randn(3, 2, 4, requires_grad=True) for _ in range(3))
    mask = torch.tensor([[True, False, False], [False, False, False], [True, True, False]])
    out, lse = attention_block(q, k, v, mask, 1.0)
    merged, _ = merge_blocks([out, torch.zeros_like(out)], [lse, torch.full_like(lse, float("-inf"))])
    assert torch.equal(merged[1], torch.zeros_like(merged[1]))
    assert torch.isneginf(lse[:, 1]).all()
    merged.sum().backward()
    assert all(torch.isfinite(x.grad).all() for x in (q, k, v))


@pytest.mark.parametrize("cp_size", [2, 4])
def test_zigzag_half_rows_are_the_first_and_second_chunk_of_every_slot(cp_size):
    cu_padded = cu([4 * cp_size, 0, 2 * cp_size, 6 * cp_size])
    local_rows = int(cu_padded[-1]) // cp_size
    first, second = zigzag_half_rows(cu_padded, local_rows, cp_size)
    for rank in range(cp_size):
        positions = zigzag_indices(cu_padded, cp_size, rank)
        slot = torch.searchsorted(cu_padded.long(), positions, right=True) - 1
        chunk = (positions - cu_padded.long()[slot]) // (
            (cu_padded[slot + 1] - cu_padded[slot]).long() // (2 * cp_size)
        )
        assert (chunk[first] == rank).all() and (chunk[second] == 2 * cp_size - 1 - rank).all()


def test_bad_inputs_are_rejected_with_the_argument_named():
    q, k, v = random_qkv(8)
    cu_padded = cu([8])
    with pytest.raises(ValueError, match="q must be THD"):
        allgather_kv_attention(q[None], k, v, cu_padded, SINGLE)
    with pytest.raises(ValueError, match="k and v"):
        ring_attention(q, k, v[:, :1], cu_padded, SINGLE)
    with pytest.raises(ValueError, match="multiple of key/value groups"):
        allgather_kv_attention(q[:, :3], k, v, cu_padded, SINGLE)
    with pytest.raises(TypeError, match="cu_seqlens_padded"):
        allgather_kv_attention(q, k, v, cu_padded.float(), SINGLE)
    with pytest.raises(ValueError, match="cu_seqlens .* must describe the same sequences"):
        allgather_kv_attention(q, k, v, cu_padded, SINGLE, cu_seqlens=cu([4, 4]))
    with pytest.raises(ValueError, match="implementation"):
        context_parallel_attention(q, k, v, cu_padded, SINGLE, implementation="flash")
    ctx = ParallelContext(cp_size=2, cp_rank=0)
    with pytest.raises(ValueError, match="zigzag"):
        context_parallel_attention(q, k, v, cu_padded, ctx, implementation="ring", layout="contiguous")
    with pytest.raises(ValueError, match="cp_group"):
        ring_attention(q, k, v, cu_padded, ctx)
