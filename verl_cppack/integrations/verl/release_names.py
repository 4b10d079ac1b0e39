"""The packing functions under the names (and return conventions) of verl releases before 0.8.

Thin wrappers over ``dropins``: verl renamed its no-padding functions twice (0.6 ``*_packed_seqs_no_padding``
and ``remove/recover_left_padding`` -> 0.7 ``*_thd_no_padding`` / ``*_bshd_no_padding`` / ``*_bshd`` -> 0.8
``*_engine``) and changed what the THD preprocess returns (a pair until 0.7.0, a triple with position ids from
0.7.1). Which wrapper a release gets is decided by ``patching`` from the release's own signature.
"""

from __future__ import annotations

from typing import Any

import torch

from verl_cppack.integrations.verl import dropins


# ================================================================ verl 0.6
def preprocess_packed_seqs_no_padding(input_ids: torch.Tensor, pre_process: bool = True) -> tuple[torch.Tensor, Any]:
    """verl 0.6's name of ``preprocess_thd_engine`` (zigzag layout): the pair ``(packed [1, T/CP, *], params)``."""
    packed, packed_seq_params, _ = dropins.preprocess_thd_engine(input_ids, pre_process=pre_process)
    return packed, packed_seq_params


def postprocess_packed_seqs_no_padding(
    output: torch.Tensor, packed_seq_params: Any, input_ids: torch.Tensor, batch_size: int, post_process: bool = True
) -> torch.Tensor:
    """verl 0.6's name of ``postprocess_thd_engine`` (zigzag layout)."""
    return dropins.postprocess_thd_engine(output, packed_seq_params, input_ids, batch_size, post_process=post_process)


def remove_left_padding(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    sequence_parallel: bool = False,
    pre_process: bool = True,
):
    """verl 0.6's name of ``preprocess_bshd``."""
    return dropins.preprocess_bshd(
        input_ids, attention_mask, position_ids, sequence_parallel=sequence_parallel, pre_process=pre_process
    )


def recover_left_padding(
    result: torch.Tensor,
    attention_mask: torch.Tensor,
    original_attention_mask: torch.Tensor,
    origin_seqlen: int,
    post_process: bool = True,
):
    """verl 0.6's name of ``postprocess_bshd``."""
    return dropins.postprocess_bshd(
        result, attention_mask, original_attention_mask, origin_seqlen, post_process=post_process
    )


# ================================================================ verl 0.7
def preprocess_thd_no_padding(
    input_ids: torch.Tensor,
    pre_process: bool = True,
    need_roll: bool = False,
    use_fp8_padding: bool = False,
    fp8_recipe: str | None = None,
    include_total_tokens: bool = False,
) -> tuple[torch.Tensor, Any, torch.Tensor | None]:
    """verl 0.7.1's name of ``preprocess_thd_engine`` (zigzag layout): the triple, its position ids shaped like
    the packed rows (``[1, T/CP, *]``: 0.7.1 repeats them over the trailing dimensions of ``input_ids``)."""
    packed, packed_seq_params, position_ids = dropins.preprocess_thd_engine(
        input_ids,
        pre_process=pre_process,
        need_roll=need_roll,
        use_fp8_padding=use_fp8_padding,
        fp8_recipe=fp8_recipe,
        include_total_tokens=include_total_tokens,
    )
    if position_ids is not None and packed.dim() > 2:
        trailing = packed.shape[2:]
        position_ids = position_ids.view(*position_ids.shape, *(1,) * len(trailing)).expand(packed.shape)
    return packed, packed_seq_params, position_ids


def preprocess_thd_no_padding_pair(
    input_ids: torch.Tensor, pre_process: bool = True, need_roll: bool = False
) -> tuple[torch.Tensor, Any]:
    """verl 0.7.0's ``preprocess_thd_no_padding``: the pair ``(packed, PackedSeqParams)``."""
    packed, packed_seq_params, _ = dropins.preprocess_thd_engine(
        input_ids, pre_process=pre_process, need_roll=need_roll
    )
    return packed, packed_seq_params


def postprocess_thd_no_padding(
    output: torch.Tensor, packed_seq_params: Any, input_ids: torch.Tensor, batch_size: int, post_process: bool = True
) -> torch.Tensor:
    """verl 0.7's name of ``postprocess_thd_engine`` (zigzag layout)."""
    return dropins.postprocess_thd_engine(output, packed_seq_params, input_ids, batch_size, post_process=post_process)


def preprocess_bshd_no_padding(
    input_ids: torch.Tensor, pre_process: bool = True, need_roll: bool = False, use_fp8_padding: bool = False
):
    """verl 0.7's name of ``preprocess_bshd_engine``."""
    return dropins.preprocess_bshd_engine(
        input_ids, pre_process=pre_process, need_roll=need_roll, use_fp8_padding=use_fp8_padding
    )


def postprocess_bshd_no_padding(
    output: torch.Tensor, attention_mask: torch.Tensor, post_process: bool = True
) -> torch.Tensor:
    """verl 0.7's name of ``postprocess_bshd_engine``."""
    return dropins.postprocess_bshd_engine(output, attention_mask, post_process=post_process)
