"""Specification of the loss helpers on one process: token mean, document mean, zero-token policy, Megatron outputs."""

from __future__ import annotations

import pytest
import torch

from verl_cppack import ParallelContext
from verl_cppack.loss import (
    EmptyBatchError,
    document_mean_loss,
    masked_sum_and_count,
    megatron_mean_loss_outputs,
    megatron_per_token_loss_outputs,
    token_mean_loss,
)
from verl_cppack.packing.documents import pack_documents

PAD, EOD = 0, 1
# The worked example's batch (docs/design.md): documents "abcE", "deE", "fghijE"
WORKED = torch.tensor([[10, 11, 12, EOD, 13, 14, EOD, PAD], [15, 16, 17, 18, 19, EOD, PAD, PAD]])


def losses_for(docs) -> torch.Tensor:
    """A per-token loss that depends only on (token, position): 0.1 * token + 0.01 * position, as float64."""
    return (0.1 * docs.tokens + 0.01 * docs.position_ids).double()


def test_token_mean_is_the_mean_over_loss_tokens():
    docs = pack_documents(WORKED, eod_id=EOD, pad_id=PAD)
    losses = losses_for(docs).requires_grad_()
    reduced = token_mean_loss(losses, docs.loss_mask)
    kept = [value for value, keep in zip(losses[0].tolist(), docs.loss_mask[0].tolist()) if keep]
    assert len(kept) == 10 and int(reduced.num_tokens) == 10 and not bool(reduced.empty)
    assert reduced.value.item() == pytest.approx(sum(kept) / len(kept), abs=1e-12)
    assert reduced.loss.item() == pytest.approx(sum(kept) / len(kept), abs=1e-12)
    reduced.loss.backward()
    assert torch.equal(losses.grad, docs.loss_mask.double() / 10)


def test_nan_at_masked_positions_does_not_leak():
    docs = pack_documents(WORKED, eod_id=EOD, pad_id=PAD, ctx=ParallelContext(cp_size=2, cp_rank=0))
    losses = torch.where(docs.loss_mask, 1.0, float("nan")).requires_grad_()
    local_sum, count = masked_sum_and_count(losses, docs.loss_mask)
    assert local_sum.item() == 4.0 and int(count) == 4
    local_sum.backward()
    assert torch.isfinite(losses.grad).all() and torch.equal(losses.grad, docs.loss_mask.float())


def test_zero_loss_tokens_raise_by_default_and_skip_explicitly():
    losses = torch.ones(1, 6, requires_grad=True)
    nothing = torch.zeros(1, 6, dtype=torch.bool)
    with pytest.raises(EmptyBatchError, match="zero loss tokens"):
        token_mean_loss(losses, nothing)
    assert issubclass(EmptyBatchError, ValueError)
    reduced = token_mean_loss(losses, nothing, on_empty="skip")
    assert bool(reduced.empty) and int(reduced.num_tokens) == 0
    assert reduced.loss.item() == 0.0 and reduced.value.item() == 0.0
    reduced.loss.backward()
    assert torch.equal(losses.grad, torch.zeros(1, 6))
    with pytest.raises(ValueError, match="on_empty"):
        token_mean_loss(losses, nothing, on_empty="clamp")


def test_a_batch_of_single_token_documents_has_no_loss_token():
    docs = pack_documents(torch.tensor([[EOD, EOD, 10, PAD]]), eod_id=EOD, pad_id=PAD)
    assert docs.num_documents == 3 and not docs.loss_mask.any()
    losses = losses_for(docs)
    with pytest.raises(EmptyBatchError):
        token_mean_loss(losses, docs.loss_mask)
    with pytest.raises(EmptyBatchError, match="documents with a loss token"):
        document_mean_loss(losses, docs.loss_mask, docs.document_ids, docs.num_documents)
    skipped = document_mean_loss(losses, docs.loss_mask, docs.document_ids, docs.num_documents, on_empty="skip")
    assert bool(skipped.empty) and skipped.value.item() == 0.0 and int(skipped.num_tokens) == 0


def test_document_mean_averages_each_document_then_the_documents():
    tokens = torch.tensor([[10, 11, 12, EOD, 13, 14, EOD, PAD], [EOD, 15, 16, 17, 18, 19, EOD, PAD]])
    docs = pack_documents(tokens, eod_id=EOD, pad_id=PAD)  # documents abcE, deE, E (no loss token), fghijE
    losses = losses_for(docs).requires_grad_()
    reduced = document_mean_loss(losses, docs.loss_mask, docs.document_ids, docs.num_documents)
    # oracle: a Python loop over documents
    per_document: dict[int, list[float]] = {}
    for value, keep, document in zip(losses[0].tolist(), docs.loss_mask[0].tolist(), docs.document_ids[0].tolist()):
        if keep:
            per_document.setdefault(document, []).append(value)
    means = [sum(v) / len(v) for v in per_document.values()]
    assert sorted(per_document) == [0, 1, 3] and int(reduced.num_tokens) == 3
    assert reduced.value.item() == pytest.approx(sum(means) / len(means), abs=1e-12)
    reduced.loss.backward()
    expected_grad = torch.zeros_like(losses)
    for t, (keep, document) in enumerate(zip(docs.loss_mask[0].tolist(), docs.document_ids[0].tolist())):
        if keep:
            expected_grad[0, t] = 1 / (3 * len(per_document[document]))
    assert torch.allclose(losses.grad, expected_grad, rtol=0, atol=1e-15)


def test_megatron_per_token_outputs_are_local_sum_and_count():
    docs = pack_documents(WORKED, eod_id=EOD, pad_id=PAD, ctx=ParallelContext(cp_size=2, cp_rank=1))
    losses = torch.ones(1, docs.plan.local_length)
    loss_sum, num_tokens, report = megatron_per_token_loss_outputs(losses, docs.loss_mask)
    assert loss_sum.item() == 6.0 and num_tokens.dtype == torch.int32 and int(num_tokens) == 6  # rank 1's 6 of 10
    assert report["lm loss"].tolist() == [6.0, 6.0]
    (docs1,) = [pack_documents(WORKED, eod_id=EOD, pad_id=PAD)]
    share, report = megatron_mean_loss_outputs(torch.ones(1, 13), docs1.loss_mask)
    assert share.item() == 1.0 and report["lm loss"].item() == 1.0


def test_bad_loss_input_is_rejected():
    mask = torch.ones(1, 4, dtype=torch.bool)
    with pytest.raises(TypeError, match="loss_mask must be a bool tensor"):
        token_mean_loss(torch.ones(1, 4), mask.float())
    with pytest.raises(TypeError, match="floating"):
        token_mean_loss(torch.ones(1, 4, dtype=torch.long), mask)
    with pytest.raises(ValueError, match="same shape"):
        token_mean_loss(torch.ones(1, 4), torch.ones(4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"\[1, T_local\]"):
        token_mean_loss(torch.ones(2, 4), torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="cp_group"):
        token_mean_loss(torch.ones(1, 4), mask, ParallelContext(cp_size=2))
    with pytest.raises(ValueError, match="document_ids"):
        document_mean_loss(torch.ones(1, 4), mask, torch.zeros(1, 3, dtype=torch.long), 1)
    with pytest.raises(ValueError, match="num_documents"):
        document_mean_loss(torch.ones(1, 4), mask, torch.zeros(1, 4, dtype=torch.long), 0)
