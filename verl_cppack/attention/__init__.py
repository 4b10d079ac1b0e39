"""Causal attention over a packed THD stream with context parallelism, as a CPU-checkable reference: the oracle,
all-gather (any layout) and zigzag ring implementations; ``core_attention`` is the Megatron module."""

from __future__ import annotations

from typing import Literal

import torch

from verl_cppack.attention.allgather import allgather_kv_attention
from verl_cppack.attention.reference import reference_attention
from verl_cppack.attention.ring import ring_attention
from verl_cppack.context import ParallelContext
from verl_cppack.core.layouts import Layout, LayoutName, get_layout

AttentionImplementation = Literal["allgather", "ring"]
IMPLEMENTATIONS: tuple[str, ...] = ("allgather", "ring")


def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_padded: torch.Tensor,
    ctx: ParallelContext,
    *,
    implementation: AttentionImplementation = "allgather",
    cu_seqlens: torch.Tensor | None = None,
    layout: LayoutName | Layout = "zigzag",
    softmax_scale: float | None = None,
    max_seqlen: int | None = None,
) -> torch.Tensor:
    """Local q ``[t, h, d]``, k/v ``[t, g, d]`` -> ``[t, h, d]``; see ``allgather_kv_attention``."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    options = dict(cu_seqlens=cu_seqlens, softmax_scale=softmax_scale, max_seqlen=max_seqlen)
    if implementation == "allgather":
        return allgather_kv_attention(q, k, v, cu_seqlens_padded, ctx, layout=layout, **options)
    if ctx.cp_size > 1 and get_layout(layout).name != "zigzag":
        raise ValueError(f"ring attention needs the zigzag layout, got {get_layout(layout).name!r}; use 'allgather'")
    return ring_attention(q, k, v, cu_seqlens_padded, ctx, **options)


__all__ = [
    "IMPLEMENTATIONS",
    "AttentionImplementation",
    "allgather_kv_attention",
    "context_parallel_attention",
    "reference_attention",
    "ring_attention",
]
