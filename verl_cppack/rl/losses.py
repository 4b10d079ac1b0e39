"""The actor objective: clipped PPO surrogate plus the low-variance (k3) KL to the reference, token-mean."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PolicyLossOutput:
    loss: torch.Tensor  # scalar, differentiable: pg_loss + kl_coef * kl
    pg_loss: torch.Tensor  # scalar
    kl: torch.Tensor  # scalar, token-mean k3
    clip_fraction: torch.Tensor  # scalar, fraction of tokens where the clipped branch is active


def masked_token_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` over the tokens where ``mask`` is set; zero masked tokens is a ValueError."""
    if values.shape != mask.shape:
        raise ValueError(f"values {tuple(values.shape)} and mask {tuple(mask.shape)} must have the same shape")
    weights = mask.to(values.dtype)
    count = weights.sum()
    # One host sync, to refuse an empty mask instead of returning NaN.
    if float(count) == 0.0:
        raise ValueError("the response mask selects zero tokens; there is nothing to average over")
    return (values * weights).sum() / count


def low_variance_kl(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, clamp: float = 10.0) -> torch.Tensor:
    """Schulman's k3 estimator of KL(policy || ref) per token: ``exp(r) - r - 1`` with ``r = ref - logp``.

    Non-negative, unbiased, low variance; clamped to ``[-clamp, clamp]`` like verl's ``low_var_kl``.
    """
    log_ratio = ref_log_probs - log_probs
    return (torch.exp(log_ratio) - log_ratio - 1.0).clamp(min=-clamp, max=clamp)


def clipped_policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio: float = 0.2,
    kl_coef: float = 0.0,
) -> PolicyLossOutput:
    """PPO's clipped surrogate ``max(-A r, -A clip(r, 1-eps, 1+eps))`` + ``kl_coef * k3``, both token-mean.

    All tensors are [B, R] over response tokens (``response_mask`` bool/0-1); ``log_probs`` carries the gradient.
    """
    for name, tensor in (("old_log_probs", old_log_probs), ("ref_log_probs", ref_log_probs), ("advantages", advantages)):
        if tensor.shape != log_probs.shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, log_probs has {tuple(log_probs.shape)}")
    if not 0.0 < clip_ratio < 1.0:
        raise ValueError(f"clip_ratio must be in (0, 1), got {clip_ratio}")
    ratio = torch.exp(log_probs - old_log_probs.detach())  # [B, R]
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_ratio, 1.0 + clip_ratio)
    pg_loss = masked_token_mean(torch.maximum(unclipped, clipped), response_mask)
    kl = masked_token_mean(low_variance_kl(log_probs, ref_log_probs.detach()), response_mask)
    clip_fraction = masked_token_mean((clipped > unclipped).float().detach(), response_mask)
    return PolicyLossOutput(loss=pg_loss + kl_coef * kl, pg_loss=pg_loss, kl=kl, clip_fraction=clip_fraction)
