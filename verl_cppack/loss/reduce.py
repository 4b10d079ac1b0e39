"""Token-mean of a per-token loss over the CP group (optionally also DP), with the global token count."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist

from verl_cppack.context import ParallelContext
from verl_cppack.core.checks import require_tensor

OnEmpty = Literal["raise", "skip"]


class EmptyBatchError(ValueError):
    """The global batch has zero loss tokens: there is no loss to average (skip the step or fix the masks)."""


@dataclass(frozen=True)
class ReducedLoss:
    """A loss averaged over the whole reduction group, seen from one rank; back-propagate ``loss`` as is when gradients
    are *summed* over the group, times the group size when they are *averaged*."""

    loss: torch.Tensor  # [] differentiable share; 0 when empty
    value: torch.Tensor  # [] detached global loss, the same on every rank of the group; 0 when empty
    num_tokens: torch.Tensor  # [] int64 global count of loss tokens (token mean) or of averaged documents
    empty: torch.Tensor  # [] bool: the global batch had nothing to average (only ever True with on_empty="skip")


def check_per_token(per_token_loss: Any, loss_mask: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate a per-token loss and its bool mask (same shape, ``[1, T_local]`` or ``[T_local]``) -> both flat."""
    per_token_loss = require_tensor("per_token_loss", per_token_loss)
    loss_mask = require_tensor("loss_mask", loss_mask)
    if not per_token_loss.dtype.is_floating_point:
        raise TypeError(f"per_token_loss must be a floating tensor, got dtype {per_token_loss.dtype}")
    if loss_mask.dtype != torch.bool:
        raise TypeError(
            f"loss_mask must be a bool tensor (True = the token counts), got dtype {loss_mask.dtype}; "
            "convert with loss_mask.bool() after checking it only holds 0/1"
        )
    if per_token_loss.shape != loss_mask.shape:
        raise ValueError(
            f"per_token_loss {tuple(per_token_loss.shape)} and loss_mask {tuple(loss_mask.shape)} must have the same "
            "shape (no broadcasting)"
        )
    if per_token_loss.dim() not in (1, 2) or (per_token_loss.dim() == 2 and per_token_loss.shape[0] != 1):
        raise ValueError(f"per_token_loss must be [1, T_local] or [T_local], got {tuple(per_token_loss.shape)}")
    return per_token_loss.reshape(-1), loss_mask.reshape(-1)


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def masked_sum_and_count(per_token_loss: torch.Tensor, loss_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's ``(loss sum over mask tokens [] float >= fp32, mask tokens [] int64)``; masked-out positions
    are dropped with ``where`` (a NaN at padding cannot leak)."""
    losses, mask = check_per_token(per_token_loss, loss_mask)
    kept = torch.where(mask, losses.to(accumulation_dtype(losses.dtype)), 0)  # [T_local]
    return kept.sum(), mask.sum()


def all_reduce_sum(tensor: torch.Tensor, ctx: ParallelContext, dp_group: Any = None) -> torch.Tensor:
    """Sum a detached tensor over the CP group (when cp_size > 1), then over ``dp_group`` (when given)."""
    tensor = tensor.detach().clone()
    if ctx.cp_size > 1:
        if ctx.cp_group is None:
            raise ValueError(f"cp_size={ctx.cp_size} needs ctx.cp_group to reduce the loss over")
        dist.all_reduce(tensor, group=ctx.cp_group)
    if dp_group is not None:
        dist.all_reduce(tensor, group=dp_group)
    return tensor


def check_on_empty(on_empty: object) -> None:
    if on_empty not in ("raise", "skip"):
        raise ValueError(f"on_empty must be 'raise' or 'skip', got {on_empty!r}")


def guarded_denominator(count: torch.Tensor, on_empty: OnEmpty, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` [] global -> (denominator, empty flag). 'raise' reads the count on the host (one sync)."""
    empty = count == 0
    if on_empty == "raise":
        if bool(empty):
            raise EmptyBatchError(
                f"the global batch has zero {what}: nothing to average. Skip this step, or pass on_empty='skip' to "
                "get a zero loss with empty=True"
            )
        return count, empty
    # 'skip': the 1 is only ever used when the numerators are all zero too; `empty` reports it.
    return torch.where(empty, torch.ones_like(count), count), empty


def token_mean_loss(
    per_token_loss: torch.Tensor,
    loss_mask: torch.Tensor,
    ctx: ParallelContext | None = None,
    *,
    dp_group: Any = None,
    on_empty: OnEmpty = "raise",
) -> ReducedLoss:
    """Mean of ``per_token_loss`` over every loss token of the CP group (and of ``dp_group`` when given).

    ``per_token_loss`` / ``loss_mask``: this rank's ``[1, T_local]`` (or ``[T_local]``) losses and bool mask. No loss
    token: ``on_empty="raise"`` raises ``EmptyBatchError`` (one host read), ``"skip"`` gives zeros, ``empty=True``."""
    check_on_empty(on_empty)
    ctx = ParallelContext() if ctx is None else ctx
    local_sum, local_count = masked_sum_and_count(per_token_loss, loss_mask)
    totals = all_reduce_sum(torch.stack([local_sum.detach().double(), local_count.double()]), ctx, dp_group)  # [2]
    count = totals[1].round().long()
    denominator, empty = guarded_denominator(count, on_empty, "loss tokens")
    return ReducedLoss(
        loss=local_sum / denominator, value=(totals[0] / denominator).to(local_sum.dtype), num_tokens=count, empty=empty
    )
