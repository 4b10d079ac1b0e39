"""Drop-ins for verl's (0.8+) vision-language mask builders ``build_vlm_attn_mask_thd`` / ``build_vlm_attn_mask_bshd``:
jagged ``[B, j]`` ids -> rows ``[B, S]`` (real tokens, then ``pad_token_id``) and a bool mask ``[B, S]``, by one
kernel; the only host read is the longest sequence (none when a plan knows it). ``S`` is rounded up to ``TP*CP*2``
with CP>1, else ``TP``, except by verl 0.8.0 / 0.9.0's thd builder (``build_vlm_attn_mask_thd_unaligned``)."""

from __future__ import annotations

import torch

from verl_cppack.core.checks import require_int, require_jagged, require_token_id
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
    require_token_id("pad_token_id", pad_token_id, dtype)
    if abs(pad_token_id) > 2**53:  # the padding travels as a double: beyond 2**53 it would land on another id
        raise ValueError(f"pad_token_id={pad_token_id} is beyond 2**53, where padding values lose their exactness")
    return pad_token_id


def _build(input_ids: torch.Tensor, pad_token_id: object, forced: int | None, aligned: bool, remember: bool = False):
    nested = require_jagged("input_ids", input_ids)
    pad = _check_pad_token_id(pad_token_id, jagged_values(nested).dtype)  # (the nested dtype: 5 us of dispatch)
    longest = dropins.longest_sequence(nested)  # a plan's, or the one host read
    if forced is not None and forced < longest:
        raise ValueError(
            f"every sequence must fit the rows of {forced} tokens, the longest has {longest} (forced_max_seqlen "
            "below the longest sequence would cut sequences); raise forced_max_seqlen"
        )
    multiple = dropins.megatron_context().default_slot_multiple if aligned else 1  # TP*CP*2 with CP>1, else TP
    row_length = -(-(longest if forced is None else forced) // multiple) * multiple  # S
    offsets = nested.offsets()  # [B+1]
    rows = jagged_to_padded(nested, row_length, pad)  # [B, S, *]
    mask = torch.arange(row_length, device=offsets.device) < offsets.diff().unsqueeze(1)  # [B, S]
    if rows.dim() > 2:  # shaped like the rows, as verl's
        mask = mask.view(*mask.shape, *(1,) * (rows.dim() - 2)).expand(rows.shape)
    if remember:  # the model's own packing of these rows finds verl's stream by it
        dropins.remember_vlm_mask(mask, input_ids)
    return rows, mask


def build_vlm_attn_mask_thd(input_ids: torch.Tensor, pad_token_id: int = None):
    """Jagged ``[B, j]`` ids -> (``[B, S]`` rows, ``[B, S]`` bool mask), ``S`` the longest sequence rounded up. The
    mask remembers the plan of ``preprocess_thd_engine``'s ``PackedSeqParams`` for the same ids, which a model that
    packs the rows again follows (Megatron-Bridge's Qwen3-VL: ``integrations.megatron_bridge``)."""
    return _build(input_ids, pad_token_id, None, aligned=True, remember=True)


def build_vlm_attn_mask_thd_unaligned(input_ids: torch.Tensor, pad_token_id: int = None):
    """verl 0.8.0 / 0.9.0's ``build_vlm_attn_mask_thd``: ``S`` is the longest sequence, not rounded."""
    return _build(input_ids, pad_token_id, None, aligned=False, remember=True)


def build_vlm_attn_mask_bshd(
    input_ids: torch.Tensor, batch_size: int, pad_token_id: int = None, forced_max_seqlen: int | None = None
):
    """As ``build_vlm_attn_mask_thd``, ``S`` being ``forced_max_seqlen`` when given (a ``ValueError`` below the
    longest sequence: verl cuts); ``batch_size`` must be ``B`` (verl ignores it)."""
    nested = require_jagged("input_ids", input_ids)
    require_int("batch_size", batch_size, minimum=1)
    dropins.check_batch_size(batch_size, nested)
    if forced_max_seqlen is not None:
        require_int("forced_max_seqlen", forced_max_seqlen, minimum=0)
    return _build(nested, pad_token_id, forced_max_seqlen, aligned=True)
