"""Zigzag ring attention: K/V travel around the CP ring by point-to-point send/recv (Transformer Engine's schedule).

Rank ``r`` holds chunks ``r`` and ``2*CP-1-r`` of every slot and at step ``i`` rank ``(r - i) mod CP``'s K/V; blocks
merge by log-sum-exp, and the ring shift's backward sends the K/V gradient the other way round."""

from __future__ import annotations

import torch
import torch.distributed as dist

from verl_cppack.attention.blocks import expand_groups, merge_blocks, slot_attention
from verl_cppack.attention.coordinates import coordinates_of, zigzag_half_rows
from verl_cppack.attention.inputs import local_attention_setup
from verl_cppack.context import ParallelContext


def _exchange(tensor: torch.Tensor, send_to: int, receive_from: int, parallel: ParallelContext) -> torch.Tensor:
    """Send ``tensor`` to CP rank ``send_to`` and return what CP rank ``receive_from`` sent us."""
    group = parallel.cp_group
    received = torch.empty_like(tensor)
    operations = [
        dist.P2POp(dist.isend, tensor.contiguous(), group=group, group_peer=send_to),
        dist.P2POp(dist.irecv, received, group=group, group_peer=receive_from),
    ]
    for work in dist.batch_isend_irecv(operations):
        work.wait()
    return received


class _RingShift(torch.autograd.Function):
    """Forward: pass ``x`` to the next CP rank, receive the previous rank's. Backward: the reverse."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, parallel: ParallelContext) -> torch.Tensor:
        ctx.parallel = parallel
        rank, size = parallel.cp_rank, parallel.cp_size
        return _exchange(x.detach(), (rank + 1) % size, (rank - 1) % size, parallel)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        rank, size = ctx.parallel.cp_rank, ctx.parallel.cp_size
        return _exchange(grad, (rank - 1) % size, (rank + 1) % size, ctx.parallel), None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_padded: torch.Tensor,
    ctx: ParallelContext,
    *,
    cu_seqlens: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    max_seqlen: int | None = None,
) -> torch.Tensor:
    """Same contract as ``allgather_kv_attention`` with the zigzag layout (the only one a ring supports)."""
    if ctx.cp_size > 1 and ctx.cp_group is None:
        raise ValueError(
            "ring attention with cp_size > 1 needs ctx.cp_group (e.g. integrations.megatron.parallel_context_from_megatron())"
        )
    scale, lengths, width, partition, query = local_attention_setup(
        q, k, v, cu_seqlens_padded, cu_seqlens, ctx.cp_rank, ctx.cp_size, "zigzag", softmax_scale, max_seqlen
    )
    rows, num_heads, head_dim = q.shape
    rank, size = ctx.cp_rank, ctx.cp_size
    first_half, second_half = zigzag_half_rows(cu_seqlens_padded, rows, size)  # [t/2] each

    kv = torch.cat([k, v], dim=-1)  # [t, g, 2d]: one message per step
    outs, lses = [], []
    for step in range(size):
        if step > 0:
            kv = _RingShift.apply(kv, ctx)
        key = coordinates_of(partition[(rank - step) % size], cu_seqlens_padded)
        block_q, block_query, block_kv, block_key = q, query, kv, key
        if 0 < step <= rank:  # all local queries against the first half of the received K/V
            block_kv, block_key = kv.index_select(0, first_half), key.take(first_half)
        elif step > rank:  # the second half of the local queries against all of it
            block_q, block_query = q.index_select(0, second_half), query.take(second_half)
        block_k, block_v = (expand_groups(x, num_heads) for x in block_kv.split(head_dim, dim=-1))
        out, lse = slot_attention(block_q, block_k, block_v, block_query, block_key, lengths, width, scale)
        if step > rank:  # back to all local rows; untouched rows saw nothing (lse = -inf)
            out = out.new_zeros((rows, num_heads, head_dim)).index_copy(0, second_half, out)
            lse = lse.new_full((num_heads, rows), float("-inf")).index_copy(1, second_half, lse)
        outs.append(out)
        lses.append(lse)
    out, _ = merge_blocks(outs, lses)
    return out.to(q.dtype)
