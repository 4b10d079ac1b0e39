"""Masked attention of a query block against a key block, and the stable log-sum-exp merge (a CPU reference).

A key is kept for a query only in the same slot, not after it and inside the slot's attention length; a query with no
such key gets 0 and ``lse = -inf``. ``slot_attention`` costs ``slots * L^2`` (padded BSHD), not ``rows^2``."""

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


def _normalise(logits: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax of ``logits`` over ``dim`` and its log-sum-exp (``dim`` kept, size 1), stably; where every logit is
    ``-inf`` the weights are 0 and the lse ``-inf``, with finite gradients."""
    top = logits.amax(dim=dim, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top)).detach()
    weights = torch.exp(logits - top)  # 0 where -inf
    total = weights.sum(dim=dim, keepdim=True)
    seen = total > 0
    safe_total = torch.where(seen, total, torch.ones_like(total))
    return weights / safe_total, torch.where(seen, torch.log(safe_total) + top, torch.full_like(top, float("-inf")))


def attention_block(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, softmax_scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """q ``[..., tq, h, d]``, k/v ``[..., tk, h, d]``, mask ``[..., tq, tk]`` -> (out ``[..., tq, h, d]``, lse
    ``[..., h, tq]``) float32, ``lse = -inf`` where a query sees no key; fully masked rows keep finite gradients."""
    scores = torch.einsum("...qhd,...khd->...hqk", q.float(), k.float()) * softmax_scale  # [..., h, tq, tk]
    probabilities, lse = _normalise(scores.masked_fill(~mask.unsqueeze(-3), float("-inf")), dim=-1)
    out = torch.einsum("...hqk,...khd->...qhd", probabilities, v.float())  # [..., tq, h, d]
    return out, lse.squeeze(-1)


def masked_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, softmax_scale: float | None
) -> torch.Tensor:
    """torch's fused attention of q/k/v ``[b, h, s, d]`` where ``allowed`` ``[..., s, s]`` -> ``[b, h, s, d]``; a
    query allowed no key gets 0 (it attends to itself instead of producing NaN, then is zeroed)."""
    blind = ~allowed.any(dim=-1, keepdim=True)  # [..., s, 1]
    allowed = allowed | (blind & torch.eye(allowed.shape[-1], dtype=torch.bool, device=allowed.device))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=softmax_scale).masked_fill(blind, 0.0)


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
    k_batch, v_batch = (_scatter_rows(x, key_cell, sink).view(slots, width, *x.shape[1:]) for x in (k, v))
    key_present = torch.zeros(sink + 1, dtype=torch.bool, device=q.device).index_fill(0, key_cell, True)
    causal = torch.ones(width, width, dtype=torch.bool, device=q.device).tril()  # [L, L]
    mask = causal & key_present[:sink].view(slots, 1, width)  # [n, L, L]
    if not with_lse:  # cells that see no key hold no query, or one outside the attention length: never read back
        batch = (x.float().transpose(1, 2) for x in (q_batch, k_batch, v_batch))  # [n, h, L, d]
        out, lse = masked_sdpa(*batch, mask.unsqueeze(1), softmax_scale).transpose(1, 2), None  # [n, L, h, d]
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
    weights, lse = _normalise(torch.stack(list(lses)), dim=0)  # [blocks, h, tq], [1, h, tq]
    scale = weights.permute(0, 2, 1).unsqueeze(-1)  # [blocks, tq, h, 1]
    out = (torch.stack(list(outs)) * scale).sum(dim=0)  # [tq, h, d]
    return out, lse.squeeze(0)
