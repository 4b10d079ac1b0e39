"""The floors of ``verl-cppack bench``: a micro-batch's packing work with nothing left but its copies and collectives.

- preprocess floor: its three copies alone with the index given, one ``index_select`` each of ``input_ids``,
  labels and the label mask (``[B, S]`` -> ``[1, T_local]``);
- postprocess floor: per output (log-probs, entropy), its all-gather alone plus one copy into ``[B, S]`` with the
  index given (one ``index_select``; at CP > 1 the gather buffer ends with a zero row the positions off the mask
  read; at CP=1 there is no all-gather and they read any element, so the CP=1 floor writes no zeros).

The indices are computed before the timed calls, with verl's own ``preprocess_packed_seqs`` and
``postprocess_packed_seqs`` applied to position numbers, so the floors move exactly the bytes verl's layout moves
(and depend on nothing of verl_cppack). A packer's time over its floor is what planning, reading the mask and its
own glue cost.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from verl_cppack.bench.batches import MicroBatch


@dataclass(frozen=True)
class FloorIndex:
    """Where each element goes, for one micro-batch on one CP rank (computed untimed)."""

    pack: torch.Tensor  # [T_local] int64: flat [B*S] source of each local slot (padding slots read position 0)
    unpack: (
        torch.Tensor
    )  # [B*S] int64: row of the gathered stream (CP > 1: off the mask its zero last row; CP=1: row 0)
    local_length: int  # T_local
    cp_size: int


def floor_index(verl_util: Any, mask: torch.Tensor, cp_size: int, cp_rank: int) -> FloorIndex:
    """The copies' indices for ``mask`` [B, S] from verl's functions (collective at CP > 1: every rank calls it)."""
    batch_size, seq_len = mask.shape
    positions = torch.arange(1, batch_size * seq_len + 1, device=mask.device).view(batch_size, seq_len)
    packed, params = verl_util.preprocess_packed_seqs(positions, mask, pre_process=True)  # [1, T_local]: source + 1
    local_length = packed.shape[1]
    pack = (packed[0] - 1).clamp(min=0)  # [T_local]
    stream = torch.arange(1, local_length + 1, device=mask.device) + cp_rank * local_length  # [T_local]
    placed = verl_util.postprocess_packed_seqs(stream.unsqueeze(0), params, mask, batch_size, seq_len).reshape(-1)
    off_mask = cp_size * local_length if cp_size > 1 else 0
    unpack = torch.where(placed > 0, placed - 1, torch.full_like(placed, off_mask))  # [B*S]
    return FloorIndex(pack, unpack, local_length, cp_size)


def preprocess_floor(batch: MicroBatch, index: FloorIndex) -> torch.Tensor:
    """The three packed tensors by ``index_select`` alone; returns the packed ids ``[1, T_local]``."""
    packed_ids, _, _ = (
        x.reshape(-1).index_select(0, index.pack) for x in (batch.input_ids, batch.labels, batch.label_mask)
    )
    return packed_ids.unsqueeze(0)


def postprocess_floor(
    outputs: tuple[torch.Tensor, ...], index: FloorIndex, shape: tuple[int, int], group: Any
) -> list[torch.Tensor]:
    """Each ``[1, T_local]`` output all-gathered and copied once into ``[B, S]`` (zeros off the mask at CP > 1)."""
    results = []
    for output in outputs:
        local = output.reshape(-1)  # [T_local]
        if index.cp_size == 1:
            full = local.index_select(0, index.unpack)
        else:
            stream_length = index.cp_size * index.local_length
            gathered = local.new_empty(stream_length + 1)  # [cp * T_local + 1]: the last row is the zero row
            gathered[stream_length:].zero_()
            _all_gather_into(gathered[:stream_length], local, group)
            full = gathered.index_select(0, index.unpack)
        results.append(full.view(shape))
    return results


def all_gathers_alone(outputs: tuple[torch.Tensor, ...], index: FloorIndex, group: Any) -> None:
    """The postprocess's all-gathers and nothing else (nothing at CP=1)."""
    if index.cp_size == 1:
        return
    for output in outputs:
        local = output.reshape(-1)
        _all_gather_into(local.new_empty(index.cp_size * index.local_length), local, group)


def _all_gather_into(out: torch.Tensor, local: torch.Tensor, group: Any) -> None:
    """Every rank's ``local`` [T_local] into ``out`` [cp * T_local] (one collective, no list of views)."""
    gather = (
        getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    )  # all_gather_into_tensor's newer name
    gather(out, local, group=group)
