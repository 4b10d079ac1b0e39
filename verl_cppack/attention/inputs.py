"""Shape and argument checks shared by the CP attention entry points (raised before any work)."""

from __future__ import annotations

import math

import torch

from verl_cppack.attention.coordinates import StreamCoordinates, coordinates_of, rank_partition
from verl_cppack.core.checks import OFFSET_DTYPES, require_integer_tensor, require_tensor
from verl_cppack.core.layouts import Layout


def check_qkv(q: object, k: object, v: object) -> None:
    """q ``[t, heads, dim]``, k/v ``[t, groups, dim]`` with ``heads % groups == 0``."""
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        require_tensor(name, tensor)
        if tensor.dim() != 3:
            raise ValueError(f"{name} must be THD [t, heads, dim], got shape {tuple(tensor.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(
            f"q {tuple(q.shape)} and k {tuple(k.shape)} must share the row count t and head dim (self-attention)"
        )
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of key/value groups ({k.shape[1]}) for GQA")


def check_offsets(cu_seqlens_padded: object, cu_seqlens: object, device: torch.device) -> None:
    require_integer_tensor("cu_seqlens_padded", cu_seqlens_padded, ndim=1, dtypes=OFFSET_DTYPES)
    if cu_seqlens_padded.numel() < 2:
        raise ValueError("cu_seqlens_padded needs at least 2 entries ([0, total])")
    if cu_seqlens is not None:
        require_integer_tensor("cu_seqlens", cu_seqlens, ndim=1, dtypes=OFFSET_DTYPES)
        if cu_seqlens.shape != cu_seqlens_padded.shape:
            raise ValueError(
                f"cu_seqlens {tuple(cu_seqlens.shape)} and cu_seqlens_padded {tuple(cu_seqlens_padded.shape)} "
                "must describe the same sequences"
            )
    for name, tensor in (("cu_seqlens_padded", cu_seqlens_padded), ("cu_seqlens", cu_seqlens)):
        if tensor is not None and tensor.device != device:
            raise ValueError(f"{name} is on {tensor.device} but q is on {device}; move it")


def attention_lengths(cu_seqlens_padded: torch.Tensor, cu_seqlens: torch.Tensor | None) -> torch.Tensor:
    """[n] int64 tokens per slot that take part in attention (default: the whole padded slot)."""
    cu = (cu_seqlens_padded if cu_seqlens is None else cu_seqlens).long()
    return cu[1:] - cu[:-1]


def batch_width(lengths: torch.Tensor, max_seqlen: int | None) -> int:
    """The slot-batch width: ``max_seqlen`` when given (Megatron's ``max_seqlen_q``), else one host sync."""
    if max_seqlen is None:
        return max(int(lengths.max()), 1)
    if isinstance(max_seqlen, torch.Tensor) and max_seqlen.numel() == 1 and not max_seqlen.dtype.is_floating_point:
        max_seqlen = int(max_seqlen)  # some callers keep it as a tensor
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int) or max_seqlen < 1:
        raise ValueError(f"max_seqlen must be a positive int (the longest attention length), got {max_seqlen!r}")
    return max_seqlen


def local_attention_setup(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_padded: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    cp_rank: int,
    cp_size: int,
    layout: str | Layout,
    softmax_scale: float | None,
    max_seqlen: int | None,
) -> tuple[float, torch.Tensor, int, torch.Tensor, StreamCoordinates]:
    """Check a CP attention call's inputs -> (softmax scale, attention lengths ``[n]``, batch width, every rank's
    stream positions ``[cp, t]``, this rank's query coordinates)."""
    check_qkv(q, k, v)
    check_offsets(cu_seqlens_padded, cu_seqlens, q.device)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[2])
    lengths = attention_lengths(cu_seqlens_padded, cu_seqlens)  # [n]
    partition = rank_partition(cu_seqlens_padded, q.shape[0], cp_size, layout)  # [cp, t]
    query = coordinates_of(partition[cp_rank], cu_seqlens_padded)
    return scale, lengths, batch_width(lengths, max_seqlen), partition, query
