"""GRPO's group-normalised advantages (verl's ``compute_grpo_outcome_advantage``, vectorised)."""

from __future__ import annotations

import torch


def group_normalized_advantages(
    scores: torch.Tensor, response_mask: torch.Tensor, group_size: int, *, eps: float = 1e-6, normalize_std: bool = True
) -> torch.Tensor:
    """``(score - group mean) / (group std + eps)`` broadcast over each response's tokens.

    scores [N*G] float: one scalar per response; responses of one prompt are consecutive rows (row ``i`` belongs
    to prompt ``i // group_size``). response_mask [N*G, R]. Returns [N*G, R] float32, zero on masked tokens.
    The std is the unbiased one, as in verl; a group of identical scores gets advantage 0.
    """
    if scores.dim() != 1:
        raise ValueError(f"scores must be 1-D [N*G], got shape {tuple(scores.shape)}")
    if group_size < 2:
        raise ValueError(f"group_size must be >= 2 (one response has no group baseline), got {group_size}")
    if scores.numel() % group_size != 0:
        raise ValueError(f"scores has {scores.numel()} rows, not a multiple of group_size={group_size}")
    if response_mask.dim() != 2 or response_mask.shape[0] != scores.numel():
        raise ValueError(
            f"response_mask must be [N*G={scores.numel()}, R], got shape {tuple(response_mask.shape)}"
        )
    grouped = scores.float().view(-1, group_size)  # [N, G]
    centred = grouped - grouped.mean(dim=1, keepdim=True)  # [N, G]
    if normalize_std:
        centred = centred / (grouped.std(dim=1, keepdim=True) + eps)
    return centred.reshape(-1, 1) * response_mask.float()  # [N*G, R]
