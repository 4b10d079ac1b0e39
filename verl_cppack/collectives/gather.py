"""All-gather of every CP rank's local stream, with the gather-back gradient contracts (docs/design.md, "The core")."""

from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist

from verl_cppack.context import ParallelContext
from verl_cppack.core.checks import require_context, require_int, require_tensor

GradientContract = Literal["local", "sum"]


def _check_group(ctx: ParallelContext) -> None:
    if ctx.cp_group is None:
        raise ValueError(
            f"cp_size={ctx.cp_size} needs ctx.cp_group to all-gather over; build the context with "
            "integrations.megatron.parallel_context_from_megatron() or pass cp_group (e.g. torch.distributed.group.WORLD)"
        )
    ctx.check_group()  # torch.distributed answered for the group when ctx was made


class _AllGatherRankMajor(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local: torch.Tensor, parallel: ParallelContext, contract: str, zero_rows: int) -> torch.Tensor:
        ctx.parallel, ctx.contract, ctx.local_length = parallel, contract, local.shape[0]
        wire = local.detach().contiguous()
        if wire.dtype == torch.bool:  # gloo has no bool all-gather; same bytes as uint8
            wire = wire.view(torch.uint8)
        stream_length = parallel.cp_size * wire.shape[0]
        gathered = torch.empty((stream_length + zero_rows, *wire.shape[1:]), dtype=wire.dtype, device=wire.device)
        gathered[stream_length:].zero_()
        dist.all_gather(list(gathered[:stream_length].chunk(parallel.cp_size)), wire, group=parallel.cp_group)
        return gathered.view(torch.bool) if local.dtype == torch.bool else gathered

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        parallel = ctx.parallel
        if ctx.contract == "sum":
            grad = grad.contiguous()
            dist.all_reduce(grad, group=parallel.cp_group)
        return grad.narrow(0, parallel.cp_rank * ctx.local_length, ctx.local_length), None, None, None


def all_gather_rank_major(
    local: torch.Tensor, ctx: ParallelContext, gradient: GradientContract = "local", zero_rows: int = 0
) -> torch.Tensor:
    """``local`` [T_local, *] on every rank -> ``[cp_size * T_local, *]``, rank 0's rows first, then ``zero_rows``
    zero rows (gathered in place, no extra copy; ``PackPlan.unpack`` copies blocks of rows out of it).

    ``gradient="local"`` (verl / Megatron loss scaling): the backward passes this rank's slice of the
    incoming gradient to ``local`` and nothing else. ``gradient="sum"`` (Megatron-RL, NeMo-RL, OpenRLHF):
    incoming gradients are summed over the CP group first; it is ``cp_size`` times the other when every
    rank computes the same loss.
    """
    local = require_tensor("local", local)
    require_context(ctx, allow_none=False)
    if gradient not in ("local", "sum"):
        raise ValueError(f"gradient must be 'local' or 'sum', got {gradient!r}")
    require_int("zero_rows", zero_rows, minimum=0)
    if local.dim() < 1:
        raise ValueError(f"local must be [T_local, *] (at least 1-D), got shape {tuple(local.shape)}")
    if ctx.cp_size == 1:
        return torch.cat([local, local.new_zeros((zero_rows, *local.shape[1:]))]) if zero_rows else local
    _check_group(ctx)
    return _AllGatherRankMajor.apply(local, ctx, gradient, zero_rows)
