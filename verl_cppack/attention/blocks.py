"""Masked attention of a query block against a key block, and the stable log-sum-exp merge.

Key ``k`` is kept for query ``q`` only in the same slot, not after ``q`` (causal) and inside the slot's attention
length; a query with no admissible key gets output 0 and ``lse = -inf``. ``slot_attention`` scatters rows to
``[slots, L, ...]`` by in-slot offset, so the cost is ``slots * L^2`` (padded BSHD), not ``rows^2``. A CPU reference
(einsum + masked softmax), not a kernel.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from verl_cppack.attention.coordinates import StreamCoordinates


def expand_groups(kv: torch.Tensor, num_heads: int) -> torch.Tensor:
    """GQA: ``[t, groups, d]`` -> ``[t, heads, d]``, query head ``j`` reads group ``j // (heads/groups)``."""
    groups = kv.shape[1]
    if num_heads % groups:
        raise ValueError(f"number of query heads ({num_heads}) must be a multiple of the key/value groups ({groups})")
    return kv if groups == num_heads else kv.repeat_interleave(num_heads // groups, dim=1)


def attention_block(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, softmax_scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """q ``[..., tq, h, d]``, k/v ``[..., tk, h, d]``, mask ``[..., tq, tk]`` -> (out ``[..., tq, h, d]``, lse
    ``[..., h, tq]``) float32, ``lse = -inf`` where a query sees no key; fully masked rows keep finite gradients."""
    scores = torch.einsum("...qhd,...khd->...hqk", q.float(), k.float()) * softmax_scale  # [..., h, tq, tk]
    scores = scores.masked_fill(~mask.unsqueeze(-3), float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True)  # [..., h, tq, 1]
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max)).detach()
    weights = torch.exp(scores - row_max)  # 0 where masked
    denominator = weights.sum(dim=-1, keepdim=True)
    seen = denominator > 0
    safe_denominator = torch.where(seen, denominator, torch.ones_like(denominator))
    out = torch.einsum("...hqk,...khd->...qhd", weights / safe_denominator, v.float())  # [..., tq, h, d]
    lse = torch.where(seen, torch.log(safe_denominator) + row_max, torch.full_like(row_max, float("-inf")))
    return out, lse.squeeze(-1)


def slot_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    query: StreamCoordinates,
    key: StreamCoordinates,
    attention_lengths: torch.Tensor,
    max_length: int,
    softmax_scale: float,
    *,
    with_lse: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Query rows q ``[tq, h, d]`` against key rows k/v ``[tk, h, d]`` (placed by ``query`` / ``key``
    coordinates) -> (out ``[tq, h, d]``, lse ``[h, tq]``) float32. ``max_length`` >= the longest of
    ``attention_lengths`` ``[slots]``; rows past their slot's length get 0 / ``-inf``. ``with_lse=False`` runs torch's
    fused ``scaled_dot_product_attention`` and returns ``lse = None``."""
    slots, width = attention_lengths.numel(), max_length
    sink = slots * width  # one extra row collects everything outside the batch
    query_cell = _batch_cell(query, attention_lengths, width, sink)  # [tq]
    key_cell = _batch_cell(key, attention_lengths, width, sink)  # [tk]
    q_batch = _scatter_rows(q, query_cell, sink).view(slots, width, *q.shape[1:])  # [n, L, h, d]
    k_batch = _scatter_rows(k, key_cell, sink).view(slots, width, *k.shape[1:])
    v_batch = _scatter_rows(v, key_cell, sink).view(slots, width, *v.shape[1:])
    key_present = torch.zeros(sink + 1, dtype=torch.bool, device=q.device).index_fill(0, key_cell, True)
    causal = torch.ones(width, width, dtype=torch.bool, device=q.device).tril()  # [L, L]
    mask = causal & key_present[:sink].view(slots, 1, width)  # [n, L, L]
    if not with_lse:
        # cells that see no key (no query lives there, or it lies outside the attention length) attend to
        # themselves instead of producing NaN; they are never read back
        blind = ~mask.any(dim=-1, keepdim=True)  # [n, L, 1]
        mask = mask | (blind & torch.eye(width, dtype=torch.bool, device=q.device))
        out = F.scaled_dot_product_attention(
            *(x.float().transpose(1, 2) for x in (q_batch, k_batch, v_batch)),  # [n, h, L, d]
            attn_mask=mask.unsqueeze(1),
            scale=softmax_scale,
        ).transpose(1, 2)  # [n, L, h, d]
        lse = None
    else:
        out, lse = attention_block(q_batch, k_batch, v_batch, mask, softmax_scale)  # [n, L, h, d], [n, h, L]
        heads = lse.shape[1]
        lse = torch.cat([lse.transpose(0, 1).reshape(heads, sink), lse.new_full((heads, 1), float("-inf"))], dim=1)
        lse = lse.index_select(1, query_cell)
    out = torch.cat([out.reshape(sink, *out.shape[2:]), out.new_zeros(1, *out.shape[2:])])  # + zero sink row
    return out.index_select(0, query_cell), lse


def _batch_cell(rows: StreamCoordinates, attention_lengths: torch.Tensor, width: int, sink: int) -> torch.Tensor:
    """[rows] index into the flattened ``[slots * L]`` batch; ``sink`` for rows outside the attention length."""
    inside = (rows.offset < attention_lengths.index_select(0, rows.slot)) & (rows.offset < width)
    return torch.where(inside, rows.slot * width + rows.offset, sink)


def _scatter_rows(x: torch.Tensor, cell: torch.Tensor, sink: int) -> torch.Tensor:
    """x ``[rows, *]`` -> ``[sink, *]`` with row ``i`` at ``cell[i]`` (zeros elsewhere; the sink row is dropped)."""
    return x.new_zeros(sink + 1, *x.shape[1:]).index_copy(0, cell, x)[:sink]


def merge_blocks(outs: Sequence[torch.Tensor], lses: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine partial attentions over disjoint key sets, ``out = sum_i exp(lse_i - lse) * out_i``, stably:
    outs ``[tq, h, d]``, lses ``[h, tq]`` -> (out ``[tq, h, d]``, lse ``[h, tq]``); rows unseen everywhere give 0 / -inf."""
    stacked_lse = torch.stack(list(lses))  # [blocks, h, tq]
    top = stacked_lse.amax(dim=0, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top)).detach()
    weights = torch.exp(stacked_lse - top)  # [blocks, h, tq]
    total = weights.sum(dim=0)  # [h, tq]
    seen = total > 0
    safe_total = torch.where(seen, total, torch.ones_like(total))
    scale = (weights / safe_total).permute(0, 2, 1).unsqueeze(-1)  # [blocks, tq, h, 1]
    out = (torch.stack(list(outs)) * scale).sum(dim=0)  # [tq, h, d]
    lse = torch.where(seen, torch.log(safe_total) + top.squeeze(0), torch.full_like(total, float("-inf")))
    return out, lse
