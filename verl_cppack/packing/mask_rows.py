"""Where the tokens of a padded batch's ``[B, S]`` mask sit: per-row counts, first and last token column.

The scans behind ``plan_from_mask`` (``packing.builders``): a few ``[B]`` statistics ride on the plan's one
device->host read; the mask is read as 8-byte words where it can (see ``MaskRows``).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import torch


class MaskRows:
    """Where the tokens of a ``[B, S]`` bool mask sit: per-row counts, first and last token column.

    The device computes a few ``[B]`` statistics (``device_stats``, read back in the plan's one sync); the
    host turns them into columns (``extents``). A row whose tokens form one run (rollouts: left-padded
    prompt + right-padded response) is then fully described by its first column and count; rows with gaps
    need the general O(B*S) rank-and-scatter of ``token_positions``.

    When ``S % 8 == 0`` the mask is read as 8-byte words (8 columns each) so the scans run over ``S/8``
    words: the first and last non-zero word of each row, whose bytes the host inspects, and token counts as
    lane-wise word sums (a byte lane counts its column's tokens, below 128 per group of words, so lanes never
    carry) read back as bytes. A CPU mask is scanned by numpy on the mask's own memory (``scan_on_host``: no
    tensor op, nothing to read back; ``argmax`` stops at the first non-zero word), and its counts are the rows'
    spans when one ``count_nonzero`` of the whole mask shows every row is one run (else the same lane sums).
    """

    scan_cpu_masks_on_host = True  # tests turn it off to run the device scan on CPU tensors

    def __init__(self, token_mask: torch.Tensor) -> None:
        self.mask = token_mask.contiguous()  # [B, S] bool
        batch_size, seq_len = self.mask.shape
        self.by_words = seq_len % 8 == 0 and self.mask.storage_offset() % 8 == 0
        self.scan_on_host = self.by_words and self.mask.device.type == "cpu" and self.scan_cpu_masks_on_host
        if self.scan_on_host:
            self.device_stats = ()  # nothing to read back: ``extents`` scans the mask's memory
        elif self.by_words:
            words = self.mask.view(torch.int64)  # [B, W]: word w holds columns 8w .. 8w+7, one byte each
            group = _lane_group(words.shape[1])
            counts = words.view(batch_size, -1, group).sum(dim=2).view(torch.int8).sum(dim=1, dtype=torch.int32)
            occupied = (words != 0).view(torch.int8)  # [B, W]
            last = (words.shape[1] - 1) - occupied.flip(1).argmax(dim=1)
            edges = torch.stack([occupied.argmax(dim=1), last], dim=1)  # [B, 2] first/last non-zero word
            self.device_stats = (counts, edges, words.gather(1, edges))  # [B], [B, 2], their words
        else:
            as_int8 = self.mask.view(torch.int8)
            first = as_int8.argmax(dim=1)
            last = (seq_len - 1) - as_int8.flip(1).argmax(dim=1)
            self.device_stats = (as_int8.sum(dim=1, dtype=torch.int32), torch.stack([first, last], 1))

    def extents(self, host_stats: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The read-back ``device_stats`` -> (tokens, first token column, last token column) per row, [B]
        (an empty row has 0 tokens; its columns are meaningless)."""
        if self.scan_on_host:
            mask_host = self.mask.numpy()  # [B, S] the mask's memory
            words = mask_host.view(np.int64)  # [B, W]
            occupied = words != 0
            edges = np.empty((words.shape[0], 2), np.int64)  # first/last non-zero word of each row
            occupied.argmax(axis=1, out=edges[:, 0])
            np.subtract(words.shape[1] - 1, _reversed_rows(occupied).argmax(axis=1), out=edges[:, 1])
            edge_words = words[np.arange(words.shape[0])[:, None], edges]  # [B, 2]
        elif not self.by_words:
            edges = host_stats[1].reshape(-1, 2)
            return host_stats[0], edges[:, 0], edges[:, 1]
        else:
            edges, edge_words = host_stats[1].reshape(-1, 2), host_stats[2].reshape(-1, 2)
        edge_bytes = edge_words.view(np.uint8).reshape(-1, 2, 8) != 0  # memory order = columns
        first = edges[:, 0] * 8 + edge_bytes[:, 0].argmax(axis=1)
        last = edges[:, 1] * 8 + (7 - edge_bytes[:, 1, ::-1].argmax(axis=1))
        if not self.scan_on_host:
            return host_stats[0], first, last
        # A row's span (first to last token) is at least its token count, equal only if it is one run: when the
        # spans add up to the mask's token count every row is one run and the spans are the counts.
        spans = np.where(edge_words[:, 0] != 0, last - first + 1, 0)
        if spans.sum() == np.count_nonzero(mask_host):
            return spans, first, last
        return self._word_counts_on_host(words), first, last

    @staticmethod
    def _word_counts_on_host(words: np.ndarray) -> np.ndarray:
        """Tokens per row of a ``[B, W]`` word view of the mask: lane sums of groups of words, then of the lanes."""
        return words.reshape(words.shape[0], -1, _lane_group(words.shape[1])).sum(axis=2).view(np.int8).sum(axis=1)

    def token_positions(self, num_tokens: int) -> torch.Tensor:
        """[N] flat ``b * S + s`` of the n-th token in row-major order (any mask)."""
        flat = self.mask.reshape(-1)
        rank = torch.where(flat, torch.cumsum(flat, 0) - 1, num_tokens)  # [B*S], non-tokens to a sink
        positions = torch.empty(num_tokens + 1, dtype=torch.long, device=flat.device)
        return positions.index_copy_(0, rank, torch.arange(flat.numel(), device=flat.device))[:num_tokens]


def _reversed_rows(flags: np.ndarray) -> np.ndarray:
    """``flags[:, ::-1]`` as a contiguous copy; rows of whole 8-byte groups are reversed group by group with the
    bytes of each group swapped (numpy copies reversed bytes one at a time, 8-byte groups ~3x faster)."""
    if flags.shape[1] % 8:
        return np.ascontiguousarray(flags[:, ::-1])
    return flags.view(np.uint64)[:, ::-1].byteswap().view(bool)


@functools.lru_cache(maxsize=64)
def _lane_group(num_words: int) -> int:
    """The most words (a divisor of ``num_words``, at most 127) whose byte-lane sums stay below 128."""
    return max(d for d in range(1, min(num_words, 127) + 1) if num_words % d == 0)
