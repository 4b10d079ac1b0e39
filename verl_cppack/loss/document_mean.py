"""Document-level loss: mean over each document's loss tokens, then mean over documents (CP-correct); a document
with no loss token (a single-token one) is left out of the mean rather than counted as zero."""

from __future__ import annotations

from typing import Any

import torch

from verl_cppack.context import ParallelContext
from verl_cppack.core.checks import require_context, require_int, require_integer_tensor, require_true
from verl_cppack.loss.reduce import (
    OnEmpty,
    ReducedLoss,
    accumulation_dtype,
    all_reduce_sum,
    check_on_empty,
    check_per_token,
    guarded_denominator,
)


def document_mean_loss(
    per_token_loss: torch.Tensor,
    loss_mask: torch.Tensor,
    document_ids: torch.Tensor,
    num_documents: int,
    ctx: ParallelContext | None = None,
    *,
    dp_group: Any = None,
    on_empty: OnEmpty = "raise",
) -> ReducedLoss:
    """Mean over documents of each document's mean per-token loss.

    ``document_ids``: this rank's ``[1, T_local]`` (or ``[T_local]``) document of every position, in
    ``[0, num_documents)`` (``PackedDocuments.document_ids`` / ``.num_documents``). With ``dp_group`` the mean runs over
    every DP replica's documents. ``num_tokens`` counts the averaged documents; ``on_empty`` as in ``token_mean_loss``."""
    check_on_empty(on_empty)
    ctx = require_context(ctx)
    require_int("num_documents", num_documents, minimum=1)
    losses, mask = check_per_token(per_token_loss, loss_mask)  # [T_local] each
    document_ids = require_integer_tensor("document_ids", document_ids)
    if document_ids.numel() != losses.numel() or document_ids.shape != per_token_loss.shape:
        raise ValueError(
            f"document_ids {tuple(document_ids.shape)} must have the shape of per_token_loss "
            f"{tuple(per_token_loss.shape)}"
        )
    documents = document_ids.reshape(-1).long()  # [T_local]
    require_true(  # on an accelerator one read (a Python error, never a device-side assertion)
        ((documents >= 0) & (documents < num_documents)).all(),
        f"document_ids must lie in [0, num_documents) = [0, {num_documents}); pass the ids and count of the same "
        "PackedDocuments (docs.document_ids, docs.num_documents)",
    )

    kept = torch.where(mask, losses.to(accumulation_dtype(losses.dtype)), 0)  # [T_local]
    local_sums = kept.new_zeros(num_documents).scatter_add(0, documents, kept)  # [D] differentiable
    local_counts = torch.zeros(num_documents, dtype=torch.long, device=documents.device)
    local_counts.scatter_add_(0, documents, mask.long())  # [D]

    totals = all_reduce_sum(torch.stack([local_sums.detach().double(), local_counts.double()]), ctx)  # [2, D]
    counts = totals[1].round().long()  # [D] loss tokens of each document over the CP group
    has_tokens = counts > 0  # [D]
    safe_counts = torch.where(has_tokens, counts, 1)  # [D] the 1 only meets zero numerators
    document_means = torch.where(has_tokens, totals[0] / safe_counts, 0)  # [D] detached
    across = all_reduce_sum(torch.stack([document_means.sum(), has_tokens.sum().double()]), ParallelContext(), dp_group)
    num_averaged = across[1].round().long()
    denominator, empty = guarded_denominator(num_averaged, on_empty, "documents with a loss token")

    share = (local_sums / safe_counts.to(local_sums.dtype)).sum() / denominator  # [] this rank's share
    value = (across[0] / denominator).to(share.dtype)
    return ReducedLoss(loss=share, value=value, num_tokens=num_averaged, empty=empty)
