"""All-gather of every CP rank's local stream, with the gather-back gradient contracts (docs/design.md, "The core")."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.distributed as dist

from verl_cppack.context import ParallelContext
from verl_cppack.core.checks import require_context, require_tensor

GradientContract = Literal["local", "sum"]


def all_gather_into(output: torch.Tensor, local: torch.Tensor, group: Any, cp_size: int | None = None) -> None:
    """Every rank's ``local`` ``[T_local, *]`` into ``output`` ``[cp_size * T_local, *]`` (rank 0 first): one
    blocking ``torch.distributed.all_gather`` called as verl calls it (``[1, T_local, *]`` buffers, views of ``output``),
    so whoever wraps it (a profiler, verl's unit tests) sees every call."""
    if cp_size is None:
        cp_size = output.shape[0] // local.shape[0]
    buffers = output.view(cp_size, 1, *local.shape).unbind(0)  # cp_size x [1, T_local, *]
    dist.all_gather(list(buffers), local.unsqueeze(0), group=group)


def _gathered(
    local: torch.Tensor, parallel: ParallelContext, while_waiting: Callable[[], object] | None
) -> torch.Tensor:
    """Every rank's ``local`` ``[T_local, *]`` concatenated (rank 0 first), no autograd. ``while_waiting`` runs on
    the host once the collective is enqueued (on an accelerator it overlaps the transfer)."""
    wire = local.contiguous()
    if wire.dtype == torch.bool:  # gloo has no bool all-gather; same bytes as uint8
        wire = wire.view(torch.uint8)
    gathered = wire.new_empty((parallel.cp_size * wire.shape[0], *wire.shape[1:]))
    all_gather_into(gathered, wire, parallel.cp_group, parallel.cp_size)
    if while_waiting is not None:
        while_waiting()
    return gathered.view(torch.bool) if local.dtype == torch.bool else gathered


class _AllGatherRankMajor(torch.autograd.Function):
    """``_gathered`` with the gradient contracts. Backward: see ``all_gather_rank_major``."""

    @staticmethod
    def forward(
        ctx, local: torch.Tensor, parallel: ParallelContext, contract: str, while_waiting: Callable[[], object] | None
    ) -> torch.Tensor:
        ctx.parallel, ctx.contract, ctx.local_length = parallel, contract, local.shape[0]
        return _gathered(local, parallel, while_waiting)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        parallel = ctx.parallel
        if ctx.contract == "sum":
            grad = grad.contiguous()
            dist.all_reduce(grad, group=parallel.cp_group)
        return grad.narrow(0, parallel.cp_rank * ctx.local_length, ctx.local_length), None, None, None


def all_gather_rank_major(
    local: torch.Tensor, ctx: ParallelContext, gradient: GradientContract = "local"
) -> torch.Tensor:
    """``local`` [T_local, *] on every rank -> ``[cp_size * T_local, *]``, rank 0's rows first. Backward:
    ``gradient="local"`` (verl / Megatron) passes this rank's slice of the incoming gradient; ``"sum"`` (Megatron-RL,
    NeMo-RL, OpenRLHF) sums the incoming gradients over the CP group first."""
    local = require_tensor("local", local)
    require_context(ctx, allow_none=False)
    _check_contract(gradient)
    if local.dim() < 1:
        raise ValueError(f"local must be [T_local, *] (at least 1-D), got shape {tuple(local.shape)}")
    return gather_stream(local, ctx, gradient)


def gather_stream(
    local: torch.Tensor,
    ctx: ParallelContext,
    gradient: GradientContract,
    while_waiting: Callable[[], object] | None = None,
) -> torch.Tensor:
    """A plan's ``unpack`` (checked arguments): ``[T_local, *]`` -> rank-major ``[T, *]``, gradient as
    ``all_gather_rank_major``; ``while_waiting``: host work run while the all-gather is in flight (never at CP=1)."""
    _check_contract(gradient)
    if ctx.cp_size == 1:  # no communication: the local stream itself
        return local
    if ctx.cp_group is None:
        raise ValueError(
            f"cp_size={ctx.cp_size} needs ctx.cp_group to all-gather over; build the context with "
            "integrations.megatron.parallel_context_from_megatron() or pass cp_group (e.g. torch.distributed.group.WORLD)"
        )
    ctx.check_group()  # torch.distributed answered for the group when ctx was made
    if not (local.requires_grad and torch.is_grad_enabled()):  # no graph to record (log-probs under no_grad):
        return _gathered(local, ctx, while_waiting)  # autograd's Function costs ~60 us a call here
    return _AllGatherRankMajor.apply(local, ctx, gradient, while_waiting)


def _check_contract(gradient: object) -> None:
    if gradient not in ("local", "sum"):
        raise ValueError(f"gradient must be 'local' or 'sum', got {gradient!r}")
