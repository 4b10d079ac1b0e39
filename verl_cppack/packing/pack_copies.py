"""How ``pack`` copies: windows of consecutive source rows per index entry (``core.blocks``), or one row each.

``pack`` copies windows of up to ``MAX_COPY_BLOCK`` consecutive source rows per index entry: one
``index_select`` over an overlapping strided view, then the few positions the windows get wrong, then zeros
where there is no token. It never builds a per-position index on large streams; its tables are expanded on
the host and sent in one copy. ``block_rows`` is the one place that picks the window size, for ``pack`` and for
the copies back (``packing.unpack_copies``). Every dtype is copied as is: those the index kernels lack travel as
same-size integers (``copyable`` / ``as_dtype``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from verl_cppack.core.blocks import BlockGather, block_copy
from verl_cppack.core.runs import repeat_runs
from verl_cppack.packing.pieces import Pieces

# The most rows ``pack`` copies per index entry (``core.blocks``): 32 makes the index 32 times shorter than one
# entry per position and a byte-sized source (label masks) ~5x faster to copy; 64 gains little more on int64 rows.
MAX_COPY_BLOCK = 32
# Below this many positions a copy gathers row by row with a per-position index instead: the index is
# cheap to expand there, and the block copy's fixed cost (a few more small ops per pack) would dominate.
MIN_BLOCK_COPY_POSITIONS = 1 << 14


def block_rows(pieces: Pieces, positions: int, *, windows_allowed: bool = True) -> int:
    """Rows per copy window for ``pieces`` over ``positions`` positions: 1 (a per-position index) for small
    copies or where windows are not allowed, else ``copy_block(pieces)``."""
    return copy_block(pieces) if windows_allowed and positions >= MIN_BLOCK_COPY_POSITIONS else 1


def copy_block(pieces: Pieces) -> int:
    """Rows per window for ``pieces``: a piece of ``L`` rows costs about ``L / b`` windows plus ``b / 2`` fix-ups,
    least at ``b = sqrt(2 L)``; a power of two between 2 and ``MAX_COPY_BLOCK`` near that for the mean piece."""
    target_lengths = np.where(pieces.has_target, pieces.length, 0)
    num_pieces = np.count_nonzero(target_lengths)
    mean_length = float(target_lengths.sum()) / num_pieces if num_pieces else 1.0
    return min(max(2 ** round(math.log2(math.sqrt(2 * mean_length))), 2), MAX_COPY_BLOCK)


@dataclass(frozen=True)
class LocalPacking:
    """What ``pack(x, shift, wrap)`` needs on this rank: the copy of its pieces (``core.blocks``), and the pieces."""

    gather: BlockGather
    pieces: Pieces

    @cached_property
    def target_flags(self) -> torch.Tensor:
        """[T_local] bool, True where the position holds its target."""
        pieces = self.pieces
        device = self.gather.windows.device
        flags = repeat_runs(pieces.has_target.astype(np.int8), pieces.length, pieces.total, device, torch.int8)
        return flags.view(torch.bool)


def copy_pieces(
    pieces: Pieces,
    block: int,
    source_rows: int,  # rows of the flattened source
    token_rows: torch.Tensor | None,  # [N] int64 source row of each token; None: piece values are source rows
    device: torch.device,
) -> LocalPacking:
    """``pieces`` copied in windows of ``block`` rows (``core.blocks``); with ``block=1`` the windows are the
    source row of each position (piece values are token indices, looked up in ``token_rows``, when it is set)."""
    rows = token_rows.shape[0] if token_rows is not None else source_rows  # the space the piece values count in
    dtype = torch.int32 if source_rows < 2**31 else torch.long
    gather = block_copy(pieces.first, pieces.length, pieces.has_target, block, rows, device, dtype)
    if token_rows is not None:
        gather = dataclasses.replace(gather, windows=token_rows.index_select(0, gather.windows).to(dtype))
    return LocalPacking(gather, pieces)


# dtypes the index kernels (index_copy_, index_fill_) lack are copied as the same-size integer: the bytes move as is.
_COPY_AS_INTEGER = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_INDEXABLE_DTYPES = frozenset(
    {
        torch.bool,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
        torch.complex32,
        torch.complex64,
        torch.complex128,
    }
)


def copyable(rows: torch.Tensor) -> torch.Tensor:
    """``rows`` itself, or a same-size integer view of it where the index kernels lack its dtype (float8, uint16...)."""
    if rows.dtype in _INDEXABLE_DTYPES:
        return rows
    integer = _COPY_AS_INTEGER.get(rows.dtype.itemsize)
    if integer is None:
        raise TypeError(
            f"cannot pack or unpack dtype {rows.dtype}: supported are every dtype of 1, 2, 4 or 8 bytes and the "
            "complex dtypes"
        )
    return rows.view(integer)


def as_dtype(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Undo ``copyable``."""
    return rows if rows.dtype == dtype else rows.view(dtype)
