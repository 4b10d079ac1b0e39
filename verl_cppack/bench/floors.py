"""The floors of ``verl-cppack bench``: a micro-batch's packing work with nothing left but its copies and collectives.

- preprocess floor: its three copies alone with the index given, one ``index_select`` each of ``input_ids``,
  labels and the label mask (``[B, S]`` -> ``[1, T_local]``);
- postprocess floor: per output (log-probs, entropy), its all-gather alone (none at CP=1) plus one ``scatter_`` of
  the gathered stream into zeros ``[B, S]`` (the fastest such copy; padding positions land past the output).

The indices come untimed from verl's own functions applied to position numbers, so the floors move exactly the bytes
verl's layout moves. The engine path (jagged inputs and outputs) has floors of the same kind; its preprocess floor also
hands out, per call, a new copy of the position ids ``preprocess_thd_engine`` returns with every packed tensor."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from verl_cppack.bench.batches import EngineMicroBatch, MicroBatch
from verl_cppack.collectives.gather import all_gather_into


@dataclass(frozen=True)
class FloorIndex:
    """Where each element goes, for one micro-batch on one CP rank (computed untimed)."""

    pack: torch.Tensor  # [T_local] int64: flat [B*S] source of each local slot (padding slots read position 0)
    unpack: torch.Tensor  # [cp * T_local] int64: flat [B*S] row of each gathered position (padding: B*S, dropped)
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
    on_mask = torch.nonzero(placed).squeeze(1)  # [N] flat [B*S] rows that receive a position
    unpack = torch.full((cp_size * local_length,), batch_size * seq_len, device=mask.device)  # padding: dropped
    unpack[placed[on_mask] - 1] = on_mask
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
    """Each ``[1, T_local]`` output all-gathered and scattered once into ``[B, S]`` (zeros off the mask)."""
    results, rows = [], shape[0] * shape[1]
    for output in outputs:
        stream = _gathered(output, index, group)
        full = stream.new_zeros(rows + 1).scatter_(0, index.unpack, stream)  # the last row takes the padding
        results.append(full[:rows].view(shape))
    return results


def all_gathers_alone(outputs: tuple[torch.Tensor, ...], index: FloorIndex, group: Any) -> None:
    """The postprocess's all-gathers and nothing else (nothing at CP=1)."""
    if index.cp_size > 1:
        for output in outputs:
            _gathered(output, index, group)


def _gathered(output: torch.Tensor, index: FloorIndex | EngineFloorIndex, group: Any) -> torch.Tensor:
    """``output`` ``[1, T_local]`` all-gathered over the CP group: ``[cp * T_local]`` (at CP=1 itself, flat)."""
    local = output.reshape(-1)  # [T_local]
    if index.cp_size == 1:
        return local
    gathered = local.new_empty(index.cp_size * index.local_length)
    all_gather_into(gathered, local, group)
    return gathered


# ------------------------------------------------------------- the engine path (jagged inputs and outputs)
@dataclass(frozen=True)
class EngineFloorIndex:
    """The engine path's copies for one micro-batch on one CP rank: from and to the jagged values ``[N]``."""

    pack: torch.Tensor  # [T_local] int64: jagged position of each local slot (padding slots read position 0)
    pack_rolled: torch.Tensor  # [T_local] int64: the same for the labels, which verl rolls (need_roll=True)
    unpack: torch.Tensor  # [N] int64: row of the gathered stream of each real token
    position_ids: torch.Tensor  # [1, T_local] int64: what each preprocess_thd_engine call returns beside its tensor
    local_length: int  # T_local
    cp_size: int


def engine_floor_index(verl_util: Any, batch: EngineMicroBatch, cp_size: int, cp_rank: int) -> EngineFloorIndex:
    """The copies' indices from verl's ``preprocess_thd_engine`` / ``postprocess_thd_engine`` (collective at CP > 1)."""
    offsets = batch.input_ids.offsets()
    count = batch.input_ids.values().shape[0]
    positions = torch.nested.nested_tensor_from_jagged(
        torch.arange(1, count + 1, device=offsets.device), offsets=offsets
    )  # [B, j]: jagged position + 1
    packed, params, position_ids = verl_util.preprocess_thd_engine(positions, pre_process=True)  # [1, T_local] each
    rolled = verl_util.preprocess_thd_engine(positions, pre_process=True, need_roll=True)[0]  # [1, T_local]
    local_length = packed.shape[1]
    stream = torch.arange(1, local_length + 1, device=offsets.device) + cp_rank * local_length  # [T_local]
    placed = verl_util.postprocess_thd_engine(stream.unsqueeze(0), params, positions, batch.batch_size)  # [B, j]
    return EngineFloorIndex(
        (packed[0] - 1).clamp(min=0),
        (rolled[0] - 1).clamp(min=0),
        placed.values() - 1,
        position_ids,
        local_length,
        cp_size,
    )


def engine_preprocess_floor(batch: EngineMicroBatch, index: EngineFloorIndex) -> torch.Tensor:
    """The three packed tensors by ``index_select`` alone, each with its own copy of the position ids (verl's calls
    return a new one each); returns the packed ids ``[1, T_local]``."""
    packed_ids = batch.input_ids.values().index_select(0, index.pack)
    batch.labels.values().index_select(0, index.pack_rolled)
    batch.temperature.values().index_select(0, index.pack)
    for _ in range(3):
        index.position_ids.clone()
    return packed_ids.unsqueeze(0)


def engine_postprocess_floor(
    outputs: tuple[torch.Tensor, ...], index: EngineFloorIndex, group: Any
) -> list[torch.Tensor]:
    """Each ``[1, T_local]`` output all-gathered and copied once into the jagged values ``[N]``."""
    return [_gathered(output, index, group).index_select(0, index.unpack) for output in outputs]
