"""verl integration: drop-ins for verl's util functions (``dropins``, ``vlm_masks``), bound by ``patching``, with
``plan_cache``, ``padding``, ``comparison`` (against verl's own) and ``runtime_check`` (untested releases)."""

from verl_cppack.integrations.verl.dropins import (
    clear_plan_caches,
    postprocess_bshd,
    postprocess_bshd_engine,
    postprocess_bshd_no_padding,
    postprocess_packed_seqs,
    postprocess_packed_seqs_for_dict_output,
    postprocess_packed_seqs_no_padding,
    postprocess_thd_engine,
    postprocess_thd_no_padding,
    preprocess_bshd,
    preprocess_bshd_engine,
    preprocess_bshd_no_padding,
    preprocess_packed_seqs,
    preprocess_packed_seqs_no_padding,
    preprocess_thd_engine,
    preprocess_thd_no_padding,
    recover_left_padding,
    remove_left_padding,
)
from verl_cppack.integrations.verl.patching import DROPINS, install, is_installed, originals, status, uninstall
from verl_cppack.integrations.verl.vlm_masks import build_vlm_attn_mask_bshd, build_vlm_attn_mask_thd

__all__ = [
    "DROPINS",
    "build_vlm_attn_mask_bshd",
    "build_vlm_attn_mask_thd",
    "clear_plan_caches",
    "install",
    "is_installed",
    "originals",
    "postprocess_bshd",
    "postprocess_bshd_engine",
    "postprocess_bshd_no_padding",
    "postprocess_packed_seqs",
    "postprocess_packed_seqs_for_dict_output",
    "postprocess_packed_seqs_no_padding",
    "postprocess_thd_engine",
    "postprocess_thd_no_padding",
    "preprocess_bshd",
    "preprocess_bshd_engine",
    "preprocess_bshd_no_padding",
    "preprocess_packed_seqs",
    "preprocess_packed_seqs_no_padding",
    "preprocess_thd_engine",
    "preprocess_thd_no_padding",
    "recover_left_padding",
    "remove_left_padding",
    "status",
    "uninstall",
]
