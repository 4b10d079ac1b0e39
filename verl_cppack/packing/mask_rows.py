"""Where the tokens of a padded batch's ``[B, S]`` mask sit: per-row token count, first and last token column.

The scan behind ``plan_from_mask`` (``packing.builders``). A row whose tokens form one run (rollouts: a
left-padded prompt then a right-padded response) is fully described by its first column and count — its span
``last - first + 1`` equals its count only then; rows with gaps need ``token_positions`` (a rank-and-scatter
over the whole mask). The three statistics are computed where the mask lives, by three tensor ops read back in the
plan's one device->host read (a CPU mask: by ``packing.compiled``, which declines rows with gaps).
"""

from __future__ import annotations

import numpy as np
import torch

from verl_cppack.core import host


class MaskRows:
    """The token mask of a padded batch (``[B, S]``, bool or 0/1 integers) and its per-row statistics (``scan``)."""

    def __init__(self, attention_mask: torch.Tensor) -> None:
        self.device = attention_mask.device
        self.shape: tuple[int, int] = tuple(attention_mask.shape)  # (B, S)
        self.given = attention_mask

    @property
    def mask(self) -> torch.Tensor:
        """[B, S] bool, True at tokens."""
        mask = self.given
        return mask if mask.dtype == torch.bool else mask != 0

    def scan(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(tokens, first token column, last token column)`` per row [B] int64 (an empty row has 0 tokens and
        meaningless columns) by three tensor ops, read back in the plan's one device->host read. ``ValueError`` for
        mask values other than 0/1. (A CPU mask is scanned by ``packing.compiled`` where it applies.)"""
        seq_len, given = self.shape[1], self.given
        as_int8 = self.mask.view(torch.int8)
        stats = [as_int8.sum(dim=1, dtype=torch.int64), as_int8.argmax(dim=1), as_int8.flip(1).argmax(dim=1)]
        if given.dtype != torch.bool:
            stats.append(((given != 0) & (given != 1)).sum(dim=1))  # [B] bad entries; all [B], read as one [k, B]
        counts, first, last_reversed, *bad = host.read_to_host(torch.stack(stats))[0].reshape(len(stats), -1)
        if bad:
            check_values(int(bad[0].sum()))
        return counts, first, (seq_len - 1) - last_reversed

    def token_positions(self, num_tokens: int) -> torch.Tensor:
        """[N] flat ``b * S + s`` of the n-th token in row-major order (any mask)."""
        flat = self.mask.reshape(-1)
        rank = torch.where(flat, torch.cumsum(flat, 0) - 1, num_tokens)  # [B*S], non-tokens to a sink
        positions = torch.empty(num_tokens + 1, dtype=torch.long, device=flat.device)
        return positions.index_copy_(0, rank, torch.arange(flat.numel(), device=flat.device))[:num_tokens]


def check_values(num_bad: int) -> None:
    if num_bad:
        raise ValueError(f"attention_mask values must be 0 or 1; found {num_bad} offending entries")
