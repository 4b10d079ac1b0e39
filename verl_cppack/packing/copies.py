"""The one copy every plan makes: ``out[p] = rows[index[p]]``, then zeros at the positions no row lands on.

``pack`` reads the caller's rows (``[1, R, *]``, a view of the padded batch or of a jagged batch's values) with
the plan's per-position index and zeroes its few padding positions (``zero_positions``: one ``index_fill_``,
skipped when there are none); ``unpack`` reads the all-gathered stream followed by one zero row, where every
position without a token points. Both indices are built on the host from the plan's pieces (``packing.pieces``,
one expansion each) and sent to the device in one copy each. Every dtype is copied as is: those the index
kernels lack travel as same-size integers (``copyable`` / ``as_dtype``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from verl_cppack.core.host import to_device
from verl_cppack.packing.pieces import Pieces


@dataclass(frozen=True)
class RowCopy:
    """``rows [1, R, *] -> [1, P, *]``: ``index`` [1, P] int64 (an in-range row where nothing lands), then
    ``zero_positions`` [Z] int64 set to zero (``None``: no position needs it)."""

    index: torch.Tensor
    zero_positions: torch.Tensor | None

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        index = self.index
        if rows.dim() > 2:  # one index per element: the row index repeated over the trailing dimensions
            index = index.view(*index.shape, *(1,) * (rows.dim() - 2)).expand(-1, -1, *rows.shape[2:])
        copied = rows.gather(1, index)
        if self.zero_positions is not None:
            copied.index_fill_(1, self.zero_positions, 0)
        return copied


def copy_of_pieces(pieces: Pieces, rows: int, device: torch.device, zero_row: int | None = None) -> RowCopy:
    """The copy of ``pieces`` out of ``rows`` rows. Pieces without a target read ``zero_row`` (a row of zeros the
    source ends with) or, without one, are zeroed after the copy."""
    index = np.empty((1, pieces.total), np.int64)
    if zero_row is not None:  # they count up from the zero row and are clamped to it
        np.minimum(pieces.expand(zero_row, out=index[0]), zero_row, out=index[0])
        return RowCopy(to_device(index, device), None)
    pieces.expand(0, out=index[0])  # they count up from row 0: in range unless longer than the source
    if pieces.longest_without_target > rows:
        np.minimum(index, rows - 1, out=index)
    zeros = pieces.positions_without_target()
    return RowCopy(to_device(index, device), to_device(zeros, device) if zeros.size else None)


# dtypes the index kernels (gather, index_fill_) lack are copied as the same-size integer: the bytes move as is. The
# 16-bit floats too: gather goes through float32 for them and quiets signalling NaNs (their payload bits change).
_COPY_AS_INTEGER = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_INDEXABLE_DTYPES = frozenset(
    {
        torch.bool,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.float32,
        torch.float64,
        torch.complex64,
        torch.complex128,
    }
)


def copyable(rows: torch.Tensor) -> torch.Tensor:
    """``rows`` itself, or a same-size integer view of it where the index kernels lack its dtype (float8, uint16...)
    or would change its bits (16-bit floats, unless they carry a gradient: then the values are what counts)."""
    if rows.dtype in _INDEXABLE_DTYPES or (rows.requires_grad and rows.dtype in (torch.float16, torch.bfloat16)):
        return rows
    integer = _COPY_AS_INTEGER.get(rows.dtype.itemsize)
    if integer is None:
        raise TypeError(
            f"cannot pack or unpack dtype {rows.dtype}: supported are every dtype of 1, 2, 4 or 8 bytes and the "
            "complex dtypes"
        )
    return rows.view(integer)


def communicable(rows: torch.Tensor) -> torch.Tensor:
    """``rows`` as the all-gather sends them: the 16-bit floats as they are (gloo has no int16), the other dtypes the
    index kernels lack as same-size integers (``copyable``)."""
    return rows if rows.dtype in (torch.float16, torch.bfloat16) else copyable(rows)


def as_dtype(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Undo ``copyable``."""
    return rows if rows.dtype == dtype else rows.view(dtype)
