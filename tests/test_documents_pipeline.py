"""Specification of PackedSeqParams with valid-token metadata across pipeline / virtual-pipeline micro-batches."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from verl_cppack import ParallelContext
from verl_cppack.integrations.megatron import packed_seq_params_class
from verl_cppack.integrations.megatron_pipeline import (
    PER_MICROBATCH_FIELDS,
    WHOLE_BATCH_FIELDS,
    documents_packed_seq_params,
    split_microbatches,
    virtual_pipeline_iterators,
)
from verl_cppack.packing.documents import pack_documents

PAD, EOD = 0, 1
WORKED = torch.tensor([[10, 11, 12, EOD, 13, 14, EOD, PAD], [15, 16, 17, 18, 19, EOD, PAD, PAD]])  # the worked example
# 4 rows, 2 micro-batches: rows 0-1 hold documents of lengths 4,3,6 (10 loss tokens); rows 2-3 lengths 2,1,4,4 (7)
BATCH = torch.cat([WORKED, torch.tensor([[20, EOD, EOD, PAD, 21, 22, 23, 24], [25, 26, 27, 28, PAD, PAD, PAD, PAD]])])


def test_params_carry_the_plan_and_this_microbatch_valid_tokens():
    rank0 = pack_documents(WORKED, eod_id=EOD, pad_id=PAD, ctx=ParallelContext(cp_size=2, cp_rank=0))
    params = documents_packed_seq_params(rank0)
    assert isinstance(params, packed_seq_params_class())  # Megatron code taking PackedSeqParams accepts it
    assert params.qkv_format == "thd"
    assert params.cu_seqlens_q_padded.tolist() == [0, 4, 8, 16] and params.cu_seqlens_q.tolist() == [0, 4, 8, 16]
    assert params.max_seqlen_q == 8
    assert params.local_valid_mask.tolist() == [True, True, True, False, True, True, False, False]
    assert torch.equal(params.local_loss_mask, rank0.loss_mask[0])
    assert (params.num_valid_tokens, params.num_loss_tokens, params.microbatch_index) == (13, 10, 0)
    # a single micro-batch is the whole batch
    assert params.whole_batch_num_valid_tokens == 13 and params.whole_batch_num_loss_tokens == 10
    assert params.whole_batch_num_documents == 3 and params.whole_batch_num_microbatches == 1


def test_metadata_survives_dataclasses_replace():
    params = documents_packed_seq_params(pack_documents(WORKED, eod_id=EOD, pad_id=PAD))
    copy = dataclasses.replace(params, max_seqlen_q=99)
    assert type(copy) is type(params) and copy.max_seqlen_q == 99
    for name in (*PER_MICROBATCH_FIELDS, *WHOLE_BATCH_FIELDS):
        assert getattr(copy, name) is getattr(params, name)


def test_every_extra_field_is_either_per_microbatch_or_named_whole_batch():
    params = documents_packed_seq_params(pack_documents(WORKED, eod_id=EOD, pad_id=PAD))
    base_fields = {f.name for f in dataclasses.fields(packed_seq_params_class())}
    extra = {f.name for f in dataclasses.fields(params)} - base_fields
    assert extra == {*PER_MICROBATCH_FIELDS, *WHOLE_BATCH_FIELDS}
    assert all(name.startswith("whole_batch_") for name in WHOLE_BATCH_FIELDS)
    assert not any("whole" in name for name in PER_MICROBATCH_FIELDS)


@pytest.mark.parametrize("cp_size", [1, 2])
def test_split_microbatches_chunks_per_microbatch_fields_and_shares_whole_batch_totals(cp_size):
    per_rank = [
        split_microbatches(BATCH, 2, eod_id=EOD, pad_id=PAD, ctx=ParallelContext(cp_size=cp_size, cp_rank=rank))
        for rank in range(cp_size)
    ]
    for rank, microbatches in enumerate(per_rank):
        assert [m.microbatch_index for m in microbatches] == [0, 1]
        for index, (microbatch, rows) in enumerate(zip(microbatches, BATCH.chunk(2))):
            alone = pack_documents(rows, eod_id=EOD, pad_id=PAD, ctx=ParallelContext(cp_size=cp_size, cp_rank=rank))
            params = documents_packed_seq_params(microbatch)
            # per micro-batch: exactly what packing these rows alone gives
            assert torch.equal(params.cu_seqlens_q_padded, alone.cu_seqlens_padded)
            assert torch.equal(params.local_valid_mask, alone.valid_mask[0])
            assert torch.equal(params.local_loss_mask, alone.loss_mask[0])
            assert params.num_loss_tokens == [10, 7][index] and params.microbatch_index == index
            # whole batch: the same totals on every micro-batch
            assert params.whole_batch_num_loss_tokens == 17 and params.whole_batch_num_valid_tokens == 13 + 11
            assert params.whole_batch_num_documents == 7 and params.whole_batch_num_microbatches == 2
    # the loss tokens of every micro-batch on every CP rank add up to the whole-batch count
    total = sum(
        int(documents_packed_seq_params(m).local_loss_mask.sum()) for microbatches in per_rank for m in microbatches
    )
    assert total == 17


def test_split_microbatches_rejects_bad_splits():
    with pytest.raises(ValueError, match="not divisible"):
        split_microbatches(BATCH, 3, eod_id=EOD, pad_id=PAD)
    empty_second = torch.cat([WORKED, torch.zeros(2, 8, dtype=torch.long)])
    with pytest.raises(ValueError, match="micro-batch 1 of 2"):
        split_microbatches(empty_second, 2, eod_id=EOD, pad_id=PAD)


def test_virtual_pipeline_iterators_give_every_model_chunk_all_microbatches():
    microbatches = split_microbatches(BATCH, 2, eod_id=EOD, pad_id=PAD)
    first, second = virtual_pipeline_iterators(microbatches, 2)
    assert next(first) is microbatches[0] and next(first) is microbatches[1]
    assert next(second) is microbatches[0]  # not advanced by the other chunk
    with pytest.raises(StopIteration):
        next(first)


def test_contiguous_params_need_a_megatron_with_cp_partition_mode():
    docs = pack_documents(WORKED, eod_id=EOD, pad_id=PAD, ctx=ParallelContext(cp_size=2), layout="contiguous")
    assert docs.tokens.shape == (1, 8)  # packing itself works; only the Megatron params are refused
    if "cp_partition_mode" not in {f.name for f in dataclasses.fields(packed_seq_params_class())}:
        with pytest.raises(ValueError, match="cp_partition_mode"):
            documents_packed_seq_params(docs)
