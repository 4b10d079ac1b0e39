"""verl_cppack: exact, loop-free sequence packing (THD) and context-parallel slicing for verl on Megatron."""

from verl_cppack.collectives.gather import all_gather_rank_major
from verl_cppack.context import ParallelContext
from verl_cppack.core.alignment import Alignment
from verl_cppack.core.layouts import Layout, get_layout, zigzag_indices
from verl_cppack.integrations.verl import (
    install,
    postprocess_bshd,
    postprocess_bshd_engine,
    postprocess_bshd_no_padding,
    postprocess_packed_seqs,
    postprocess_packed_seqs_for_dict_output,
    postprocess_thd_engine,
    postprocess_thd_no_padding,
    preprocess_bshd,
    preprocess_bshd_engine,
    preprocess_bshd_no_padding,
    preprocess_packed_seqs,
    preprocess_thd_engine,
    preprocess_thd_no_padding,
    uninstall,
)
from verl_cppack.loss import (
    EmptyBatchError,
    ReducedLoss,
    document_mean_loss,
    megatron_mean_loss_outputs,
    megatron_per_token_loss_outputs,
    token_mean_loss,
)
from verl_cppack.packing.builders import plan_from_lengths, plan_from_mask, plan_from_nested
from verl_cppack.packing.documents import PackedDocuments, pack_documents
from verl_cppack.packing.plan import PackPlan

__version__ = "0.1.0"

__all__ = [
    "Alignment",
    "EmptyBatchError",
    "Layout",
    "PackPlan",
    "PackedDocuments",
    "ParallelContext",
    "ReducedLoss",
    "all_gather_rank_major",
    "document_mean_loss",
    "get_layout",
    "install",
    "megatron_mean_loss_outputs",
    "megatron_per_token_loss_outputs",
    "pack_documents",
    "plan_from_lengths",
    "plan_from_mask",
    "plan_from_nested",
    "postprocess_bshd",
    "postprocess_bshd_engine",
    "postprocess_bshd_no_padding",
    "postprocess_packed_seqs",
    "postprocess_packed_seqs_for_dict_output",
    "postprocess_thd_engine",
    "postprocess_thd_no_padding",
    "preprocess_bshd",
    "preprocess_bshd_engine",
    "preprocess_bshd_no_padding",
    "preprocess_packed_seqs",
    "preprocess_thd_engine",
    "preprocess_thd_no_padding",
    "token_mean_loss",
    "uninstall",
    "zigzag_indices",
]
