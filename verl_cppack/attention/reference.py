"""Slow, obviously-correct oracle: causal attention document by document on the global THD stream."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from verl_cppack.attention.blocks import expand_groups


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_padded: torch.Tensor,
    cu_seqlens: torch.Tensor | None = None,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """q ``[T, h, d]``, k/v ``[T, g, d]`` on the global stream -> ``[T, h, d]`` (float32): slot ``i``'s first
    ``L_i`` rows (``cu_seqlens``; default the whole slot) attend causally among themselves, the rest are 0."""
    num_heads = q.shape[1]
    k, v = expand_groups(k, num_heads), expand_groups(v, num_heads)
    starts = cu_seqlens_padded[:-1].tolist()
    slot_lengths = (cu_seqlens_padded[1:] - cu_seqlens_padded[:-1]).tolist()
    attention_lengths = slot_lengths if cu_seqlens is None else (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for start, length in zip(starts, attention_lengths):
        if length == 0:
            continue
        rows = slice(start, start + length)
        # SDPA wants [batch, heads, seq, dim]
        doc_q, doc_k, doc_v = (x[rows].float().transpose(0, 1).unsqueeze(0) for x in (q, k, v))
        doc_out = F.scaled_dot_product_attention(doc_q, doc_k, doc_v, is_causal=True, scale=softmax_scale)
        out[rows] = doc_out.squeeze(0).transpose(0, 1)
    return out
