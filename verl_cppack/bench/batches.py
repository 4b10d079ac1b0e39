"""Rollout-shaped batches: a left-padded prompt half and a right-padded response half, lengths spread out."""

from __future__ import annotations

import torch


def rollout_batch(
    batch_size: int, seq_len: int, *, vocab_size: int = 32_000, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids [B, S] int64, attention_mask [B, S] bool)``.

    The first ``S // 2`` columns hold a prompt ending at the middle (left padding), the rest a response
    starting there (right padding). Prompt lengths are uniform in ``[1, S/2]``; response lengths follow a
    long-tailed spread (most short, some hitting the limit), as RL rollouts do.
    """
    generator = torch.Generator().manual_seed(seed)
    half = seq_len // 2
    prompt = torch.randint(1, half + 1, (batch_size, 1), generator=generator)
    fraction = torch.rand(batch_size, 1, generator=generator) ** 2  # long tail towards short responses
    response = (fraction * (seq_len - half)).long().clamp(min=1)
    columns = torch.arange(seq_len)
    mask = ((columns >= half - prompt) & (columns < half)) | ((columns >= half) & (columns < half + response))
    input_ids = torch.randint(0, vocab_size, (batch_size, seq_len), generator=generator)
    return input_ids, mask
