"""The drop-ins under the names (and return conventions) of verl releases before 0.8.

verl renamed its no-padding functions twice (0.6 ``*_packed_seqs_no_padding``, ``remove/recover_left_padding`` ->
0.7 ``*_thd_no_padding`` / ``*_bshd_no_padding`` -> 0.8 ``*_engine`` / ``*_bshd``) and changed what the THD
preprocess returns (a pair until 0.7.0, a triple with position ids from 0.7.1). A name whose calls the 0.8 drop-in
takes as they are is that drop-in (its extra parameters have defaults); ``patching`` picks by signature.
"""

from __future__ import annotations

from typing import Any

import torch

from verl_cppack.integrations.verl import dropins

# verl 0.6
remove_left_padding = dropins.preprocess_bshd
recover_left_padding = dropins.postprocess_bshd
# verl 0.7 (and 0.6's THD gather-back)
postprocess_thd_no_padding = postprocess_packed_seqs_no_padding = dropins.postprocess_thd_engine
preprocess_bshd_no_padding = dropins.preprocess_bshd_engine
postprocess_bshd_no_padding = dropins.postprocess_bshd_engine


def preprocess_thd_no_padding_pair(
    input_ids: torch.Tensor, pre_process: bool = True, need_roll: bool = False
) -> tuple[torch.Tensor, Any]:
    """verl 0.7.0's ``preprocess_thd_no_padding`` (and 0.6's ``preprocess_packed_seqs_no_padding``): the pair
    ``(packed [1, T/CP, *], PackedSeqParams)``, zigzag layout."""
    packed, packed_seq_params, _ = dropins.preprocess_thd_engine(
        input_ids, pre_process=pre_process, need_roll=need_roll
    )
    return packed, packed_seq_params


preprocess_packed_seqs_no_padding = preprocess_thd_no_padding_pair


def preprocess_thd_no_padding(
    input_ids: torch.Tensor,
    pre_process: bool = True,
    need_roll: bool = False,
    use_fp8_padding: bool = False,
    fp8_recipe: str | None = None,
    include_total_tokens: bool = False,
) -> tuple[torch.Tensor, Any, torch.Tensor | None]:
    """verl 0.7.1's: the triple, its position ids shaped like the packed rows (``[1, T/CP, *]``: 0.7.1 repeats them
    over the trailing dimensions of ``input_ids``)."""
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
