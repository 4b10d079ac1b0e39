"""Where the tokens of a padded batch's ``[B, S]`` mask sit: per-row token count, first and last token column.

The scan behind ``plan_from_mask`` (``packing.builders``). A row whose tokens form one run (rollouts: a
left-padded prompt then a right-padded response) is fully described by its first column and count — its span
``last - first + 1`` equals its count only then; rows with gaps need ``token_positions`` (a rank-and-scatter
over the whole mask). The same three statistics are computed where the mask lives: by numpy on a CPU mask's own
memory (no tensor op, no copy: ``argmax`` stops at the first token of a row), by three tensor ops on an
accelerator, read back in the plan's one device->host read.
"""

from __future__ import annotations

import numpy as np
import torch

from verl_cppack.core import host
from verl_cppack.core.runs import counting


class MaskRows:
    """The token mask of a padded batch (``[B, S]``, bool or 0/1 integers) and its per-row statistics (``scan``)."""

    def __init__(self, attention_mask: torch.Tensor) -> None:
        self.device = attention_mask.device
        self.shape: tuple[int, int] = tuple(attention_mask.shape)  # (B, S)
        self._given = attention_mask

    @property
    def mask(self) -> torch.Tensor:
        """[B, S] bool, True at tokens."""
        mask = self._given
        return mask if mask.dtype == torch.bool else mask != 0

    def scan(self, on_host: bool | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(tokens, first token column, last token column)`` per row [B] int64 (an empty row has 0 tokens and
        meaningless columns): the plan's one device->host read. ``ValueError`` for mask values other than 0/1.
        ``on_host``: numpy on the mask's memory (``None``: where the mask is on the CPU) or tensor ops (an
        accelerator's way, on any device)."""
        seq_len = self.shape[1]
        if self.device.type == "cpu" if on_host is None else on_host:
            values = host.host_memory(self._given)  # [B, S] the mask's memory (a strided view is read as it is)
            if values.dtype != np.bool_:
                _check_values(np.count_nonzero(values.view(f"u{values.itemsize}") > 1))  # negatives wrap around
                values = values != 0
            # a byte sum into the narrowest integer that holds S: 4x count_nonzero's speed with 16 bits
            counts = values.view(np.uint8).sum(axis=1, dtype=np.uint16 if seq_len < 2**16 else np.int64)
            first = values.argmax(axis=1)  # stops at each row's first token
            return counts.astype(np.int64), first, _last_columns(values)
        given = self._given
        as_int8 = self.mask.view(torch.int8)
        stats = [as_int8.sum(dim=1, dtype=torch.int64), as_int8.argmax(dim=1), as_int8.flip(1).argmax(dim=1)]
        if given.dtype != torch.bool:
            stats.append(((given != 0) & (given != 1)).sum(dim=1))  # [B] bad entries; all [B], read as one [k, B]
        counts, first, last_reversed, *bad = host.read_to_host(torch.stack(stats))[0].reshape(len(stats), -1)
        if bad:
            _check_values(int(bad[0].sum()))
        return counts, first, (seq_len - 1) - last_reversed

    def token_positions(self, num_tokens: int) -> torch.Tensor:
        """[N] flat ``b * S + s`` of the n-th token in row-major order (any mask)."""
        flat = self.mask.reshape(-1)
        rank = torch.where(flat, torch.cumsum(flat, 0) - 1, num_tokens)  # [B*S], non-tokens to a sink
        positions = torch.empty(num_tokens + 1, dtype=torch.long, device=flat.device)
        return positions.index_copy_(0, rank, torch.arange(flat.numel(), device=flat.device))[:num_tokens]


def _last_columns(values: np.ndarray) -> np.ndarray:
    """[B] column of each row's last token of a ``[B, S]`` bool array (meaningless for an empty row). A reversed
    ``argmax`` reads a byte at a time; where a row's columns are contiguous and a multiple of 8, the last word of 8
    columns holding a token is found first, then the token inside it: 4x faster at B=256, S=8192, slower below
    ~16 K columns in all (measured), where the reversed ``argmax`` stays."""
    rows, seq_len = values.shape
    if seq_len % 8 or values.strides[1] != 1 or values.size < 1 << 14:
        return (seq_len - 1) - values[:, ::-1].argmax(axis=1)
    nonzero_words = values.view(np.uint64) != 0  # [B, S/8]
    last_word = (seq_len // 8 - 1) - nonzero_words[:, ::-1].argmax(axis=1)  # [B]
    last_eight = values.reshape(rows, seq_len // 8, 8)[counting(rows), last_word]  # [B, 8] the columns of that word
    return last_word * 8 + 7 - last_eight[:, ::-1].argmax(axis=1)


def _check_values(num_bad: int) -> None:
    if num_bad:
        raise ValueError(f"attention_mask values must be 0 or 1; found {num_bad} offending entries")
