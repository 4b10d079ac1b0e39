"""The copies back of ``unpack`` / ``unpack_nested`` / ``restore``: every rank's local stream -> source rows.

The gather-back is one all-gather into the rank-major stream followed by a block of zero rows, then one
block copy (``core.blocks``) of the source rows in source order: each sequence's chunks read from where the
layout put them, and the gaps between them (padding) read from the zero block. ``restore`` runs the same copy
on outputs already collected, with no process group.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from verl_cppack.collectives.gather import GradientContract, all_gather_rank_major
from verl_cppack.context import ParallelContext
from verl_cppack.core.blocks import BlockGather, block_copy
from verl_cppack.core.runs import run_starts
from verl_cppack.packing.pack_copies import block_rows
from verl_cppack.packing.pieces import Pieces


@dataclass(frozen=True)
class CopyBack:
    """How the rank-major stream ``[T, *]`` followed by ``block`` zero rows is copied to source rows ``[source_rows, *]``
    (or, when the copy yields tokens, to the ``N`` tokens in stream order), zeros where no token lands."""

    gather: BlockGather  # reads the stream + zero block in the copy's own order
    token_rows: torch.Tensor | None  # [N] source row of each token: scatter the tokens there; None: rows already
    source_rows: int

    @property
    def block(self) -> int:
        """Zero rows the stream must be followed by."""
        return self.gather.block

    def from_stream(self, stream: torch.Tensor) -> torch.Tensor:
        """Rank-major ``[T + block, *]`` (zero block last) -> ``[source_rows, *]`` (or ``[N, *]`` tokens)."""
        values = self.gather.gather(stream)  # [source_rows or N, *]
        if self.token_rows is None:
            return values
        rows = values.new_zeros((self.source_rows, *values.shape[1:]))  # tokens -> their source rows (rows with gaps)
        return rows.index_copy_(0, self.token_rows, values)

    def gather_back(self, local: torch.Tensor, ctx: ParallelContext, gradient: GradientContract) -> torch.Tensor:
        """This rank's ``[T_local, *]`` -> what ``from_stream`` returns, all ranks' rows gathered straight into the
        stream and zero block it reads."""
        stream = all_gather_rank_major(local, ctx, gradient, zero_rows=self.block)  # [T + block, *]
        return self.from_stream(stream)

    def restore(self, local_outputs: list[torch.Tensor]) -> torch.Tensor:
        """Every rank's ``[T_local, *]`` (rank order, no process group) -> what ``from_stream`` returns."""
        zeros = local_outputs[0].new_zeros((self.block, *local_outputs[0].shape[1:]))
        return self.from_stream(torch.cat([*local_outputs, zeros]))


def source_order_copy(pieces: Pieces, rows: int, total_length: int, device: torch.device) -> BlockGather:
    """The ``rows`` rows (or tokens) in their own order, read from the rank-major stream of ``total_length``
    positions whose all-ranks ``pieces`` (rank-major: ``[tokens, padding]...``) say where each chunk landed.

    Each chunk of a sequence is read from where the layout put it; the gaps around the chunks have no target
    (the blocks they own read the zero block after the stream; their few other positions are zeroed)."""
    stream_start = run_starts(pieces.length)  # rank-major position of every piece
    chunks = pieces.has_target & (pieces.length > 0)
    order = np.argsort(pieces.first[chunks], kind="stable")  # chunks are disjoint: sorted = source order
    first, start, length = pieces.first[chunks][order], stream_start[chunks][order], pieces.length[chunks][order]
    gaps = np.append(first, rows) - np.concatenate([[0], first + length])  # before each chunk, then after the last
    piece_first, piece_length = np.zeros(2 * first.size + 1, np.int64), np.empty(2 * first.size + 1, np.int64)
    piece_first[1::2], piece_length[1::2], piece_length[0::2] = start, length, gaps
    has_target = np.arange(piece_first.size) % 2 == 1
    block = block_rows(Pieces(piece_first, piece_length, has_target, rows), rows)
    dtype = torch.int32 if total_length + block < 2**31 else torch.long  # the source: the stream, then the zero block
    return block_copy(
        piece_first, piece_length, has_target, block, total_length + block, device, dtype, zero_rows=total_length
    )
