"""CP attention by all-gathering K/V: each rank attends its local queries to every key; the gather's backward
(``gradient="sum"``) sums K/V gradients over the CP group and keeps this rank's rows."""

from __future__ import annotations

import torch

from verl_cppack.attention.blocks import expand_groups, slot_attention
from verl_cppack.attention.coordinates import coordinates_of
from verl_cppack.attention.inputs import local_attention_setup
from verl_cppack.collectives.gather import all_gather_rank_major
from verl_cppack.context import ParallelContext
from verl_cppack.core.layouts import Layout, LayoutName


def allgather_kv_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_padded: torch.Tensor,
    ctx: ParallelContext,
    *,
    cu_seqlens: torch.Tensor | None = None,
    layout: LayoutName | Layout = "zigzag",
    softmax_scale: float | None = None,
    max_seqlen: int | None = None,
) -> torch.Tensor:
    """Local q ``[t, h, d]``, k/v ``[t, g, d]`` (this rank's rows of the padded stream cut by ``layout``)
    -> ``[t, h, d]`` in q's dtype. ``cu_seqlens_padded`` is global; ``cu_seqlens`` the per-slot attention lengths
    (default: whole slots, verl's convention); ``max_seqlen`` their maximum (one host sync when omitted).
    ``cp_size * t`` must equal ``cu_seqlens_padded[-1]`` (not checked: a host sync per layer)."""
    scale, lengths, width, partition, query = local_attention_setup(
        q, k, v, cu_seqlens_padded, cu_seqlens, ctx.cp_rank, ctx.cp_size, layout, softmax_scale, max_seqlen
    )
    key = coordinates_of(partition.reshape(-1), cu_seqlens_padded)  # rank-major, like the gather
    kv = all_gather_rank_major(torch.cat([k, v], dim=-1), ctx, gradient="sum")  # [cp*t, g, 2d]
    all_k, all_v = (expand_groups(x, q.shape[1]) for x in kv.split(q.shape[2], dim=-1))
    out, _ = slot_attention(q, all_k, all_v, query, key, lengths, width, scale, with_lse=False)
    return out.to(q.dtype)
