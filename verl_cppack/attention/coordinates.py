"""Where every row of a (local) THD stream sits: its slot and in-slot offset, from ``cu_seqlens_padded`` and the CP
layout's ``partition``, without a host sync (the stream total is ``cp_size * local_rows``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from verl_cppack.core.layouts import Layout, get_layout


@dataclass(frozen=True)
class StreamCoordinates:
    """Slot and in-slot offset of a list of stream rows (all ``[rows]`` int64)."""

    slot: torch.Tensor  # [rows] sequence owning the row
    offset: torch.Tensor  # [rows] position inside the slot (0 = first token)

    def take(self, rows: torch.Tensor) -> StreamCoordinates:
        return StreamCoordinates(self.slot.index_select(0, rows), self.offset.index_select(0, rows))


def coordinates_of(stream_positions: torch.Tensor, cu_seqlens_padded: torch.Tensor) -> StreamCoordinates:
    """``stream_positions`` ``[*]`` global stream positions -> their slot and in-slot offset."""
    cu = cu_seqlens_padded.long()
    slot = torch.searchsorted(cu, stream_positions, right=True) - 1
    return StreamCoordinates(slot=slot, offset=stream_positions - cu.index_select(0, slot.reshape(-1)).view_as(slot))


def rank_partition(
    cu_seqlens_padded: torch.Tensor, local_rows: int, cp_size: int, layout: str | Layout = "zigzag"
) -> torch.Tensor:
    """Every rank's global stream positions, ``[cp_size, local_rows]`` int64 (``Layout.partition``)."""
    partition = get_layout(layout).partition(cu_seqlens_padded, cp_size)
    if partition.shape[1] != local_rows:
        raise ValueError(f"cu_seqlens_padded describes {partition.shape[1]} rows per rank, the input has {local_rows}")
    return partition


def zigzag_half_rows(
    cu_seqlens_padded: torch.Tensor, local_rows: int, cp_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Local rows of the first and of the second zigzag chunk of every slot, each ``[local_rows // 2]``
    (TE's ``thd_read_half_tensor``)."""
    cu = cu_seqlens_padded.long()
    local_start = cu[:-1] // cp_size  # [n] slot start in the local stream
    chunk = (cu[1:] - cu[:-1]) // (2 * cp_size)  # [n]
    rows = torch.arange(local_rows, device=cu.device)
    slot = torch.searchsorted(local_start, rows, right=True) - 1  # [local_rows]
    in_second = (rows - local_start.index_select(0, slot)) >= chunk.index_select(0, slot)  # [local_rows]
    order = torch.argsort(in_second.to(torch.int8), stable=True)  # first-chunk rows first, each in order
    half = local_rows // 2
    return order[:half], order[half:]
