"""A plan's stream positions as *pieces*: runs of positions whose values count up by one.

Every copy of a plan (``pack`` with any shift, the copy back of ``unpack``, ``stream_source``) is described by
pieces computed on the host from the layout's runs and the per-sequence tables, never by a per-position loop:
a piece either reads its values from ``first`` on (it *has a target*) or gets zeros (padding, or positions whose
shifted target lies past the sequence end).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from verl_cppack.core.layouts import Runs
from verl_cppack.core.runs import count_up, run_starts


@dataclass(frozen=True)
class Pieces:
    """Host table of a stream cut into pieces that each count up by one from ``first`` over ``length``
    positions; ``has_target`` marks the pieces whose positions hold a token (the others get zeros)."""

    first: np.ndarray  # [p] int64, meaningful where has_target
    length: np.ndarray  # [p] int64, zero allowed
    has_target: np.ndarray  # [p] bool
    total: int  # length.sum()

    def expand(self, filler_first: np.ndarray | int, out: np.ndarray | None = None) -> np.ndarray:
        """[total] values; pieces without a target count up from ``filler_first`` instead."""
        return count_up(np.where(self.has_target, self.first, filler_first), self.length, out)

    def positions_without_target(self) -> np.ndarray:
        """[Z] int64 the positions of the pieces without a target, in order."""
        empty = ~self.has_target
        return count_up(run_starts(self.length)[empty], self.length[empty])

    @property
    def longest_without_target(self) -> int:
        return int(np.max(self.length, initial=0, where=~self.has_target))


def cut_pieces(
    runs: Runs,
    first_token: np.ndarray,  # [n] value of each sequence's first token (source row or token index)
    seqlens: np.ndarray,  # [n] real tokens per sequence
    *,
    shift: int = 0,
    wrap: bool = False,
) -> Pieces:
    """Split ``runs`` (host arithmetic) into pieces that count up by one: targets ``shift`` places ahead in
    the same sequence, targets wrapped round inside it (``wrap`` only), then positions without a target
    (past the sequence end, or padding). Values start at each sequence's ``first_token``."""
    first_token = runs.per_slot(first_token)
    offset, length = runs.offset, runs.length
    seqlen = runs.per_slot(seqlens)
    shift_ = shift % np.maximum(seqlen, 1) if wrap else shift  # per slot, or an int
    ahead = np.minimum(np.maximum(seqlen - shift_ - offset, 0), length)  # target o + shift < seqlen
    firsts, lengths, used = [first_token + offset + shift_], [ahead], ahead
    if wrap:
        used = np.minimum(np.maximum(seqlen - offset, 0), length)  # every real token of the run
        firsts.append(first_token + offset + ahead + shift_ - seqlen)  # target o + shift - seqlen
        lengths.append(used - ahead)
    firsts.append(np.zeros_like(offset))
    lengths.append(length - used)
    shape = (*offset.shape, len(firsts))  # the pieces of each run, in order
    first, piece_length = np.empty(shape, np.int64), np.empty(shape, np.int64)
    for piece, (piece_first, piece_len) in enumerate(zip(firsts, lengths)):
        first[..., piece], piece_length[..., piece] = piece_first, piece_len
    has_target = np.arange(first.size) % len(firsts) != len(firsts) - 1  # the last piece of each run has none
    return Pieces(first.reshape(-1), piece_length.reshape(-1), has_target, runs.total)
