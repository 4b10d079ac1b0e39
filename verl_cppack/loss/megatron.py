"""Loss-function outputs in the form Megatron-core's schedules expect (checked against megatron-core 0.16.1).

- ``(loss, num_tokens, report)`` with ``config.calculate_per_token_loss=True``: Megatron all-reduces ``num_tokens``
  over DP x CP itself, so the pair must be *local* (a CP-reduced count counts every token ``cp_size`` times);
- ``(loss, report)``: Megatron multiplies the loss by ``cp_size`` and DDP averages over DP x CP, so the loss must be
  this rank's share of the CP-group token mean (``token_mean_loss(...).loss``)."""

from __future__ import annotations

from typing import Any

import torch

from verl_cppack.context import ParallelContext
from verl_cppack.loss.reduce import OnEmpty, masked_sum_and_count, token_mean_loss


def megatron_per_token_loss_outputs(
    per_token_loss: torch.Tensor, loss_mask: torch.Tensor, *, name: str = "lm loss"
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """``(loss_sum, num_tokens, {name: [loss_sum, num_tokens]})`` of this rank (``calculate_per_token_loss=True``):
    ``loss_sum`` [] float (differentiable), ``num_tokens`` [] int32 (Megatron's accumulator dtype), both local."""
    loss_sum, num_tokens = masked_sum_and_count(per_token_loss, loss_mask)
    num_tokens = num_tokens.int()
    report = torch.stack([loss_sum.detach(), num_tokens.to(loss_sum.dtype)])
    return loss_sum, num_tokens, {name: report}


def megatron_mean_loss_outputs(
    per_token_loss: torch.Tensor,
    loss_mask: torch.Tensor,
    ctx: ParallelContext | None = None,
    *,
    on_empty: OnEmpty = "raise",
    name: str = "lm loss",
) -> tuple[torch.Tensor, dict[str, Any]]:
    """``(share, {name: global token mean})`` for Megatron's 2-tuple path (``calculate_per_token_loss=False``):
    ``share`` is this rank's share of the CP-group token mean (see the module docstring)."""
    reduced = token_mean_loss(per_token_loss, loss_mask, ctx, on_empty=on_empty)
    return reduced.loss, {name: reduced.value}
