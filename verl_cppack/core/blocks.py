"""Copying a stream of count-up pieces as windows of ``block`` consecutive source rows (host tables).

A *piece* is ``length`` consecutive stream positions that read consecutive source rows from ``first`` (or,
without a target, are filled in afterwards). Cut the stream into blocks of ``block`` positions and copy each
block as one window of the source, ``rows[w : w + block]``: the window that is right for the piece holding
the block's first position (the block's *owner*). One index entry then moves ``block`` rows, and the index
is ``block`` times shorter than one entry per position.

The window is wrong for two kinds of positions, which are then copied one by one (*fix-ups*):

- heads: the positions of a piece that starts inside a block it does not own (fewer than ``block`` per piece);
- tails: the positions of blocks whose window would run past the last source row and is clamped back in
  (only pieces that end less than ``block`` rows before the end of the source have any).

Positions of pieces without a target need neither: they are zeroed last. With ``block=1`` this is a plain
row-by-row gather (no fix-ups).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from verl_cppack.core.host import tables_to_device
from verl_cppack.core.runs import linear_runs, linear_runs_host, run_offsets


@dataclass(frozen=True)
class BlockGather:
    """The tables of a block copy on the device; ``gather(rows)`` is the copy."""

    block: int
    windows: torch.Tensor  # [M] int64 first source row of each block's window (int32/int64 when block == 1)
    fix_positions: torch.Tensor  # [F] int64 positions copied one by one (none when block == 1)
    fix_sources: torch.Tensor  # [F] int64 their source rows
    fill_positions: torch.Tensor  # [P] int64 positions without a target (zeroed)
    total: int

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows`` [R, *] (any strides, R the ``source_rows`` of the tables) -> fresh [total, *], zero where a
        position has no target."""
        if self.block == 1:
            copied = rows.index_select(0, self.windows)  # [total, *]
        else:  # window w is rows[w : w + block]: an overlapping strided view, no copy
            block = self.block
            windows = rows.as_strided(
                (rows.shape[0] - block + 1, block, *rows.shape[1:]), (rows.stride(0), *rows.stride())
            )
            copied = windows.index_select(0, self.windows).flatten(0, 1)[: self.total]  # [total, *]
            copied.index_copy_(0, self.fix_positions, rows.index_select(0, self.fix_sources))
        if self.fill_positions.numel():  # e.g. no padding and no missing target: nothing to zero
            copied.index_fill_(0, self.fill_positions, 0)
        return copied


def block_copy(
    first: np.ndarray,  # [k] int64 source row of each piece's first position (ignored where has_target is False)
    length: np.ndarray,  # [k] int64 positions of each piece, zero allowed
    has_target: np.ndarray,  # [k] bool
    block: int,
    source_rows: int,  # rows of the source, at least ``block``
    device: torch.device,
    dtype: torch.dtype = torch.long,  # of the windows when block == 1 (int32 halves their traffic)
    zero_rows: int | None = None,  # first of ``block`` zero rows of the source, if it has them
) -> BlockGather:
    """The tables that copy ``first[k] + i`` to stream position ``start[k] + i``, on ``device``.

    With ``block > 1`` the tables are short (a window per block, the fix-ups, the fills): computed and expanded
    on the host, sent in one copy. With ``block == 1`` the windows are one per position: expanded on the device.
    With ``zero_rows`` (and ``block > 1``) the blocks owned by pieces without a target read the zero rows, so only
    those pieces' positions inside other blocks are zeroed one by one.
    """
    if not 1 <= block <= source_rows:
        raise ValueError(f"block must be between 1 and the {source_rows} source rows, got {block}")
    offsets = run_offsets(length)
    start, end, total = offsets[:-1], offsets[1:], int(offsets[-1])
    shift = np.where(has_target, first - start, 0)  # source row - stream position; fillers read anything in range
    fill_length = np.where(has_target, 0, length)
    if block == 1:
        windows = linear_runs(start + shift, length, total, device, dtype).clamp_(max=source_rows - 1)
        (fill_positions,) = tables_to_device([linear_runs_host(start, fill_length)], device)
        return BlockGather(1, windows, fill_positions[:0], fill_positions[:0], fill_positions, total)
    block_of = -(-offsets // block)  # first block starting at or after each piece boundary
    first_block, end_block = block_of[:-1], block_of[1:]  # piece k owns blocks [first_block, end_block)
    last_window = source_rows - block
    blocks_owned = end_block - first_block
    windows = np.arange(0, block * int(block_of[-1]), block) + shift.repeat(blocks_owned)
    heads = np.minimum(length, block * first_block - start)  # positions before a piece's first block
    head_length = np.where(has_target, heads, 0)
    if zero_rows is not None:
        windows = np.where(has_target.repeat(blocks_owned), windows, zero_rows)
        fill_length = np.where(has_target, 0, heads)
    fix_first, fix_length = start, head_length
    if windows.max(initial=0) > last_window:  # windows past the last row are clamped: their tails are fixed up
        np.minimum(windows, last_window, out=windows)
        clamped_from = np.maximum(first_block, (last_window - shift) // block + 1)  # first clamped block
        tail_start = block * clamped_from
        tail_length = np.where(has_target & (clamped_from < end_block), end - tail_start, 0)
        fix_first, fix_length = np.concatenate([start, tail_start]), np.concatenate([head_length, tail_length])
        shift = np.concatenate([shift, shift])
    positions = linear_runs_host(np.concatenate([fix_first, start]), np.concatenate([fix_length, fill_length]))
    num_fixes = positions.size - int(fill_length.sum())
    fix_sources = positions[:num_fixes] + shift.repeat(fix_length)
    tables = tables_to_device([windows, positions[:num_fixes], fix_sources, positions[num_fixes:]], device)
    return BlockGather(block, *tables, total)
