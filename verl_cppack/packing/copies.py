"""The two copies every plan makes: ``pack`` gathers, ``out[p] = rows[index[p]]`` (one ``index_select``, then zeros
at the positions no row lands on); the copy back scatters, ``out[index[p]] = stream[p]`` into zeros, touching the
stream's ``T`` positions rather than a padded output's many more rows. Indices come from ``packing.indices``, one
copy each to the device. Every dtype is copied as is: those the index kernels lack travel as same-size integers
(``copyable`` / ``as_dtype``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from verl_cppack.core.host import to_device


@dataclass(frozen=True)
class RowCopy:
    """``rows [R, *] -> [P, *]``: ``index`` [P] int32 or int64 (an in-range row where nothing lands), then
    ``zero_positions`` [Z] int64 set to zero (``None``: no position needs it). Rows are read along dim 0, the fast
    ``index_select`` on the CPU for every dtype (along dim 1 of ``[1, R]`` it is up to 6x slower there)."""

    index: torch.Tensor
    zero_positions: torch.Tensor | None

    @classmethod
    def of(cls, index: np.ndarray, zero_positions: np.ndarray, device: torch.device, may_zero: bool) -> RowCopy:
        """The copy of host tables: sent to ``device`` (one copy each). ``may_zero``: the plan's policy can leave
        positions without a token, so the zeroing runs even where this batch lists none — the ops a copy
        dispatches then depend on the policy, not on the batch's lengths; without it, no zeroing where none is listed."""
        zeros = to_device(zero_positions, device) if zero_positions.size or may_zero else None
        return cls(to_device(index, device), zeros)

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        copied = rows.index_select(0, self.index)
        if self.zero_positions is not None:
            copied.index_fill_(0, self.zero_positions, 0)
        return copied


@dataclass(frozen=True)
class RowScatter:
    """``stream [T, *] -> [rows, *]``: position ``p`` lands on row ``index[p]`` ([T] int64, distinct); the ``sinks``
    rows past ``rows`` take the positions without a token and are dropped; rows nothing lands on are zero
    (``zeroed``; ``False`` where every row receives a position); ``trim``: drop the sinks (set wherever the plan's
    policy can pad, even with no sink in this batch: the same ops for every batch). Rows of one element go through the 1-D
    ``scatter_``, the fast kernel here (about 2.5x ``index_copy_``'s speed on 1 M float32 positions, this machine, one
    thread); wider rows through ``index_copy_`` (faster than ``scatter_`` with an expanded index from 2 columns on)."""

    index: torch.Tensor
    rows: int
    sinks: int
    zeroed: bool
    trim: bool

    def __call__(self, stream: torch.Tensor) -> torch.Tensor:
        shape = (self.rows + self.sinks, *stream.shape[1:])
        out = stream.new_zeros(shape) if self.zeroed else stream.new_empty(shape)
        if stream.dim() == 1:
            out.scatter_(0, self.index, stream)
        elif stream.numel() == stream.shape[0]:  # one element per row ([T, 1]: a value head's output)
            out.view(-1).scatter_(0, self.index, stream.reshape(-1))
        else:
            out.index_copy_(0, self.index, stream)
        return out[: self.rows] if self.trim else out


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
