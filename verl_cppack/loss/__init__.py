"""CP-correct loss reduction over packed streams: token mean, Megatron's per-token-loss contract, document mean.

CP chunks hold different numbers of loss tokens, so these divide by the *global* count and return each rank's
differentiable share (shares summed over the group are the global loss, with its gradient)."""

from verl_cppack.loss.document_mean import document_mean_loss
from verl_cppack.loss.megatron import megatron_mean_loss_outputs, megatron_per_token_loss_outputs
from verl_cppack.loss.reduce import EmptyBatchError, OnEmpty, ReducedLoss, masked_sum_and_count, token_mean_loss

__all__ = [
    "EmptyBatchError",
    "OnEmpty",
    "ReducedLoss",
    "document_mean_loss",
    "masked_sum_and_count",
    "megatron_mean_loss_outputs",
    "megatron_per_token_loss_outputs",
    "token_mean_loss",
]
