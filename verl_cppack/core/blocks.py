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

from verl_cppack.core.host import to_device
from verl_cppack.core.runs import linear_runs, linear_runs_host, run_offsets


@dataclass(frozen=True)
class BlockCopy:
    """How to copy a stream of pieces in blocks: windows per block, then fix-up runs (see the module docstring)."""

    block: int
    window_first: np.ndarray  # [k] window of the first block each piece owns; its next ones count up by ``block``
    blocks_owned: np.ndarray  # [k] blocks whose first position lies in the piece
    num_blocks: int  # ceil(total / block)
    last_window: int  # source_rows - block: windows are clamped to at most this
    fix_position: np.ndarray  # [f] first stream position of each fix-up run
    fix_source: np.ndarray  # [f] the source row it reads
    fix_length: np.ndarray  # [f] zero allowed
    fill_position: np.ndarray  # [k] first stream position of each piece
    fill_length: np.ndarray  # [k] its length if it has no target, else 0
    total: int  # stream positions

    def to_device(self, device: torch.device, dtype: torch.dtype) -> "BlockGather":
        """The tables on ``device``, expanded on the host (they are short: a window per block, the fix-ups and
        fills) and sent in one copy. With ``block=1`` the windows are one per position: expanded on the
        device in ``dtype`` instead."""
        num_fixes = int(self.fix_length.sum())
        positions = linear_runs_host(
            np.concatenate([self.fix_position, self.fix_source, self.fill_position]),
            np.concatenate([self.fix_length, self.fix_length, self.fill_length]),
        )
        if self.block == 1:
            windows = linear_runs(self.window_first, self.blocks_owned, self.num_blocks, device, dtype)
            windows, positions = windows.clamp_(max=self.last_window), to_device(positions, device)
        else:
            windows = np.minimum(linear_runs_host(self.window_first, self.blocks_owned, self.block), self.last_window)
            tables = to_device(np.concatenate([windows, positions]), device)
            windows, positions = tables.split_with_sizes([windows.size, positions.size])
        fixes, fix_sources, fills = positions.split_with_sizes([num_fixes, num_fixes, positions.numel() - 2 * num_fixes])
        return BlockGather(self.block, windows, fixes, fix_sources, fills, self.total)


@dataclass(frozen=True)
class BlockGather:
    """``BlockCopy`` on the device; ``gather(rows)`` is the copy."""

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
            windows = rows.as_strided((rows.shape[0] - block + 1, block, *rows.shape[1:]), (rows.stride(0), *rows.stride()))
            copied = windows.index_select(0, self.windows).flatten(0, 1)[: self.total]  # [total, *]
            copied.index_copy_(0, self.fix_positions, rows.index_select(0, self.fix_sources))
        return copied.index_fill_(0, self.fill_positions, 0)


def block_copy(
    first: np.ndarray,  # [k] source row of each piece's first position (ignored where has_target is False)
    length: np.ndarray,  # [k] positions of each piece, zero allowed
    has_target: np.ndarray,  # [k] bool
    block: int,
    source_rows: int,  # rows of the source, at least ``block``
) -> BlockCopy:
    """The block windows and fix-up runs that copy ``first[k] + i`` to stream position ``start[k] + i``."""
    if not 1 <= block <= source_rows:
        raise ValueError(f"block must be between 1 and the {source_rows} source rows, got {block}")
    offsets = run_offsets(length)
    start, end = offsets[:-1], offsets[1:]
    first_block, end_block = -(-start // block), -(-end // block)  # owned blocks: [first_block, end_block)
    shift = np.where(has_target, first - start, 0)  # source row - stream position; fillers read anything in range
    last_window = source_rows - block
    head_length = np.where(has_target, np.minimum(length, block * first_block - start), 0)
    first_clamped = np.maximum(first_block, (last_window - shift) // block + 1)  # first block whose window is too far
    tail_start = block * first_clamped
    tail_length = np.where(has_target & (first_clamped < end_block), end - tail_start, 0)
    return BlockCopy(
        block=block,
        window_first=block * first_block + shift,
        blocks_owned=end_block - first_block,
        num_blocks=int(-(-offsets[-1] // block)),
        last_window=last_window,
        fix_position=np.concatenate([start, tail_start]),
        fix_source=np.concatenate([first, tail_start + shift]),
        fix_length=np.concatenate([head_length, tail_length]),
        fill_position=start,
        fill_length=np.where(has_target, 0, length),
        total=int(offsets[-1]),
    )
