"""Loss-function outputs in the form Megatron-core's schedules expect (checked against megatron-core 0.16.1).

``forward_step_calc_loss`` accepts two return shapes from a ``loss_func``:

- ``(loss, num_tokens, report)``. With ``config.calculate_per_token_loss=True`` the loss is kept as a sum,
  ``num_tokens`` of every micro-batch is accumulated on the last stage, all-reduced over DP x CP in
  ``finalize_model_grads`` and the gradients (summed over DP x CP by DDP) are divided by it. So the pair
  must be *local*: this rank's loss sum and this rank's token count. Reducing the count over CP first
  would count every token ``cp_size`` times. (Without ``calculate_per_token_loss`` Megatron divides by the
  local count, a per-rank mean, which is wrong under CP: do not use the 3-tuple then.)
- ``(loss, report)``: Megatron multiplies the loss by ``cp_size`` and DDP averages over DP x CP, so the
  loss must be this rank's share of the CP-group token mean (``token_mean_loss(...).loss``).
"""

from __future__ import annotations

from typing import Any

import torch

from verl_cppack.context import ParallelContext
from verl_cppack.loss.reduce import OnEmpty, masked_sum_and_count, token_mean_loss


def megatron_per_token_loss_outputs(
    per_token_loss: torch.Tensor, loss_mask: torch.Tensor, *, name: str = "lm loss"
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """``(loss_sum, num_tokens, {name: [loss_sum, num_tokens]})`` of this rank, for ``calculate_per_token_loss=True``.

    ``loss_sum`` [] float (differentiable), ``num_tokens`` [] int32 (Megatron's accumulator dtype); both
    local. A global batch with zero tokens makes Megatron skip the gradient scaling (the gradients are
    zero); the reported count shows it.
    """
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
    """``(share, {name: global token mean})`` for Megatron's 2-tuple path (``calculate_per_token_loss=False``).

    ``share`` is this rank's share of the CP-group token mean; Megatron's ``* cp_size`` and DDP's average
    over CP turn it into the token mean of the micro-batch (then averaged over micro-batches and DP, as
    Megatron does).
    """
    reduced = token_mean_loss(per_token_loss, loss_mask, ctx, on_empty=on_empty)
    return reduced.loss, {name: reduced.value}
