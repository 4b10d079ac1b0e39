"""Drop-ins for verl's (0.8+) vision-language mask builders ``build_vlm_attn_mask_thd`` / ``build_vlm_attn_mask_bshd``:
jagged ``[B, j]`` ids -> dense rows ``[B, S]`` (real tokens first, then ``pad_token_id``) and a bool mask ``[B, S]``.
No Python loop over rows, one ``to_padded_tensor`` kernel; the only host read is the longest sequence, none when the
micro-batch's plan knows it or ``forced_max_seqlen`` is given. ``S`` is rounded up to ``TP*CP*2`` when CP>1, else to
``TP``, except by verl 0.8.0 / 0.9.0's ``build_vlm_attn_mask_thd`` (``build_vlm_attn_mask_thd_unaligned``).
"""

from __future__ import annotations

import torch

from verl_cppack.core.checks import require_int, require_jagged
from verl_cppack.core.jagged import jagged_to_padded, jagged_values
from verl_cppack.integrations.verl import dropins


def _check_pad_token_id(pad_token_id: object, dtype: torch.dtype) -> int | float:
    """The fill value of the padding: a number the ids' dtype holds exactly (verl: its tokenizer's pad id)."""
    if pad_token_id is None:
        raise TypeError(
            "pad_token_id must be the tokenizer's pad token id, got None (the tokenizer has no pad token: set one, "
            "e.g. tokenizer.pad_token = tokenizer.eos_token)"
        )
    if dtype.is_floating_point or dtype.is_complex:
        if isinstance(pad_token_id, bool) or not isinstance(pad_token_id, (int, float)):
            raise TypeError(f"pad_token_id must be a number, got {type(pad_token_id).__name__} ({pad_token_id!r})")
        return pad_token_id
    if isinstance(pad_token_id, bool) or not isinstance(pad_token_id, int):
        raise TypeError(
            f"pad_token_id must be an int for {dtype} token ids, got {type(pad_token_id).__name__} ({pad_token_id!r})"
        )
    info = torch.iinfo(dtype)
    if not info.min <= pad_token_id <= info.max:
        raise ValueError(
            f"pad_token_id={pad_token_id} does not fit the token ids' dtype {dtype} ({info.min}..{info.max})"
        )
    if abs(pad_token_id) > 2**53:  # the padding travels as a double: beyond 2**53 it would land on another id
        raise ValueError(f"pad_token_id={pad_token_id} is beyond 2**53, where padding values lose their exactness")
    return pad_token_id


def _aligned(length: int, aligned: bool) -> int:
    """``length`` rounded up to verl's BSHD row multiple (``TP*CP*2`` with CP>1, else ``TP``)."""
    multiple = dropins.megatron_context().default_slot_multiple if aligned else 1
    return -(-length // multiple) * multiple


def padded_rows(nested: torch.Tensor, row_length: int, pad_token_id: int | float) -> tuple[torch.Tensor, torch.Tensor]:
    """Jagged ``[B, j, *]`` -> (rows ``[B, row_length, *]``, bool mask ``[B, row_length]``, or shaped like the rows
    with trailing dimensions, as verl's). Every sequence must fit ``row_length`` (the caller checks)."""
    offsets = nested.offsets()  # [B+1]
    batch_size = offsets.shape[0] - 1
    rows = jagged_to_padded(nested, row_length, pad_token_id)  # [B, row_length, *]
    trailing = rows.shape[2:]
    mask = torch.arange(row_length, device=offsets.device) < offsets.diff().unsqueeze(1)  # [B, row_length]
    if trailing:
        mask = mask.view(batch_size, row_length, *(1,) * len(trailing)).expand(rows.shape)
    return rows, mask


def _build(input_ids: torch.Tensor, pad_token_id: object, forced: int | None, aligned: bool):
    nested = require_jagged("input_ids", input_ids)
    pad = _check_pad_token_id(pad_token_id, jagged_values(nested).dtype)  # (the nested dtype: 5 us of dispatch)
    longest = dropins.longest_sequence(nested)  # a plan's, or the one host read
    if forced is not None and forced < longest:
        raise ValueError(
            f"every sequence must fit the rows of {forced} tokens, the longest has {longest} (forced_max_seqlen "
            "below the longest sequence would cut sequences); raise forced_max_seqlen"
        )
    row_length = _aligned(longest if forced is None else forced, aligned)
    return padded_rows(nested, row_length, pad)


def _build_thd(input_ids: torch.Tensor, pad_token_id: object, aligned: bool):
    rows, mask = _build(input_ids, pad_token_id, None, aligned)
    dropins.remember_vlm_mask(mask, input_ids)  # the model's own packing of these rows finds verl's stream by it
    return rows, mask


def build_vlm_attn_mask_thd(input_ids: torch.Tensor, pad_token_id: int = None):
    """Jagged ``[B, j]`` ids -> (``[B, S]`` rows, ``[B, S]`` bool mask), ``S`` the longest sequence rounded up. The
    mask remembers the plan of ``preprocess_thd_engine``'s ``PackedSeqParams`` for the same ids, which a model that
    packs the rows again follows (Megatron-Bridge's Qwen3-VL: ``integrations.megatron_bridge``)."""
    return _build_thd(input_ids, pad_token_id, aligned=True)


def build_vlm_attn_mask_thd_unaligned(input_ids: torch.Tensor, pad_token_id: int = None):
    """verl 0.8.0 / 0.9.0's ``build_vlm_attn_mask_thd``: ``S`` is the longest sequence, not rounded."""
    return _build_thd(input_ids, pad_token_id, aligned=False)


def build_vlm_attn_mask_bshd(
    input_ids: torch.Tensor, batch_size: int, pad_token_id: int = None, forced_max_seqlen: int | None = None
):
    """As ``build_vlm_attn_mask_thd``, ``S`` being ``forced_max_seqlen`` when given (a ``ValueError`` below the
    longest sequence: verl cuts); ``batch_size`` must be ``B`` (verl ignores it)."""
    nested = require_jagged("input_ids", input_ids)
    require_int("batch_size", batch_size, minimum=1)
    num_sequences = nested.offsets().shape[0] - 1
    if batch_size != num_sequences:
        raise ValueError(f"batch_size ({batch_size}) must equal the number of sequences in input_ids ({num_sequences})")
    if forced_max_seqlen is not None:
        require_int("forced_max_seqlen", forced_max_seqlen, minimum=0)
    return _build(nested, pad_token_id, forced_max_seqlen, aligned=True)
