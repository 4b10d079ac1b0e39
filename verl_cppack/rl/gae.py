"""Generalised advantage estimation over [B, S] token batches (PPO with a critic).

Positions where ``mask`` is False (prompt, padding, observation tokens) are skipped: the recursion
carries the next valid position's value and advantage across them, so a masked gap is invisible —
the same semantics as verl's ``compute_gae_advantage_return``. The loop runs over time steps
(vectorised over the batch), never over sequences.
"""

from __future__ import annotations

import torch

from verl_cppack.core.checks import require_tensor


def _check(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float) -> torch.Tensor:
    for name, tensor in (("rewards", rewards), ("values", values), ("mask", mask)):
        require_tensor(name, tensor)
        if tensor.dim() != 2:
            raise ValueError(f"{name} must be [B, S], got shape {tuple(tensor.shape)}")
    if rewards.shape != values.shape or rewards.shape != mask.shape:
        raise ValueError(
            f"rewards, values and mask must share one [B, S] shape, got {tuple(rewards.shape)}, "
            f"{tuple(values.shape)}, {tuple(mask.shape)}"
        )
    if not (rewards.dtype.is_floating_point and values.dtype.is_floating_point):
        raise TypeError(f"rewards and values must be floating point, got {rewards.dtype} and {values.dtype}")
    if mask.dtype != torch.bool:
        if mask.dtype.is_floating_point or bool(((mask != 0) & (mask != 1)).any()):
            raise ValueError("mask must be bool or 0/1 integers")
        mask = mask != 0
    for name, value in (("gamma", gamma), ("lam", lam)):
        if not 0.0 <= float(value) <= 1.0:
            raise ValueError(f"{name} must lie in [0, 1], got {value}")
    return mask


def gae_advantages(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, *, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(advantages, returns)``, both ``[B, S]`` and zero where ``mask`` is False; ``returns = adv + values``."""
    mask = _check(rewards, values, mask, gamma, lam)
    with torch.no_grad():
        next_value = torch.zeros_like(values[:, 0])  # [B]
        next_advantage = torch.zeros_like(values[:, 0])  # [B]
        advantages = torch.zeros_like(values)
        for t in reversed(range(values.shape[1])):
            valid = mask[:, t]
            delta = rewards[:, t] + gamma * next_value - values[:, t]
            advantage = delta + gamma * lam * next_advantage
            next_value = torch.where(valid, values[:, t], next_value)
            next_advantage = torch.where(valid, advantage, next_advantage)
            advantages[:, t] = torch.where(valid, advantage, 0.0)
        returns = torch.where(mask, advantages + values, 0.0)
    return advantages, returns


def whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Zero-mean, unit-variance (unbiased) over the masked entries; zero elsewhere. Needs >= 2 entries."""
    mask = mask.bool()
    count = int(mask.sum())
    if count < 2:
        raise ValueError(f"whiten needs at least 2 masked entries to estimate a variance, got {count}")
    selected = values[mask]
    whitened = (values - selected.mean()) * torch.rsqrt(selected.var(unbiased=True) + eps)
    return torch.where(mask, whitened, 0.0)
