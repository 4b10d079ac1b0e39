"""Pretraining / SFT document packing: documents cut at EOD tokens, in-document labels and MTP targets.

A *document* is a maximal run of non-PAD tokens of one row that ends at an EOD token (inclusive), just
before a PAD token, or at the row end. PAD tokens never belong to a document, wherever they stand. The
documents, in row-major order, are the sequences of an ordinary ``PackPlan`` built by the core builder
from each document's length and first position: the same offsets, layouts, alignment and the one
shift function (``plan.pack(tokens, shift=k)``) as every other plan.

Cost: no Python loop over rows or documents, O(B*S + T) device work, and one device->host sync per
call: the document count, lengths and starts ride on the plan's own read (``builders.plan_from_documents``,
capacity-sized buffers: on an accelerator that read copies ``2 * B * S`` integers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from verl_cppack.context import ParallelContext
from verl_cppack.core.alignment import FP8_STREAM_FACTOR, Alignment
from verl_cppack.core.checks import require_context, require_int, require_integer_tensor, require_token_id
from verl_cppack.core.layouts import Layout, LayoutName, get_layout
from verl_cppack.packing.builders import plan_from_documents, resolve_policy
from verl_cppack.packing.plan import PackPlan


@dataclass(frozen=True)
class WholeBatch:
    """Totals of the whole (global, all micro-batches) batch, identical on every micro-batch."""

    num_valid_tokens: int
    num_loss_tokens: int
    num_documents: int
    num_microbatches: int


@dataclass(frozen=True, eq=False)
class PackedDocuments:
    """One packed micro-batch of documents, for one CP rank. Every ``[1, T_local]`` tensor is local.

    ``labels[0, t]`` is the token after ``tokens[0, t]`` in the same document; ``loss_mask`` is True where
    that token exists (so the last token of every document and all padding are excluded). MTP depth
    ``d`` (1-based, Megatron's convention: the main head predicts ``t+1``, MTP depth ``d`` predicts
    ``t+1+d``) has ``mtp_labels[d-1]`` / ``mtp_loss_masks[d-1]``. Positions outside a mask hold ``pad_id``.
    Megatron's ``PackedSeqParams`` with this micro-batch's valid-token metadata:
    ``integrations.megatron_pipeline.documents_packed_seq_params(documents)``.
    """

    plan: PackPlan  # its sequences are the documents; source_shape is the token batch's (B, S)
    tokens: torch.Tensor  # [1, T_local] token ids, pad_id at padding
    labels: torch.Tensor  # [1, T_local] next in-document token, pad_id where loss_mask is False
    loss_mask: torch.Tensor  # [1, T_local] bool: a next in-document token exists
    position_ids: torch.Tensor  # [1, T_local] int64, restarts at 0 in every document (slot offset at padding)
    valid_mask: torch.Tensor  # [1, T_local] bool: a real (non-padding) token
    document_ids: torch.Tensor  # [1, T_local] int64 document owning each position (its slot, also at padding)
    mtp_labels: tuple[torch.Tensor, ...]  # mtp_depth x [1, T_local], depth d at index d-1
    mtp_loss_masks: tuple[torch.Tensor, ...]  # mtp_depth x [1, T_local] bool
    pad_id: int
    microbatch_index: int = 0  # position among the micro-batches of one global batch
    whole_batch: WholeBatch | None = None  # totals of all micro-batches (None: this is the whole batch)

    @property
    def cu_seqlens(self) -> torch.Tensor:
        """[num_documents + 1] int32, global: real tokens."""
        return self.plan.cu_seqlens

    @property
    def cu_seqlens_padded(self) -> torch.Tensor:
        """[num_documents + 1] int32, global: slot offsets in the padded stream."""
        return self.plan.cu_seqlens_padded

    @property
    def max_seqlen(self) -> int:
        """Longest document in real tokens (as ``PackPlan.max_seqlen``)."""
        return self.plan.max_seqlen

    @property
    def max_seqlen_padded(self) -> int:
        """Longest slot (padded document): what attention gets with the padded ``cu_seqlens`` (the worked example)."""
        return self.plan.max_seqlen_padded

    @property
    def num_documents(self) -> int:
        return self.plan.batch_size

    @property
    def mtp_depth(self) -> int:
        return len(self.mtp_labels)

    def pack(self, x: torch.Tensor, *, shift: int = 0) -> torch.Tensor:
        """Any other ``[B, S, *]`` tensor of the batch -> ``[1, T_local, *]`` (the plan's ``pack``)."""
        return self.plan.pack(x, shift=shift)

    def unpack(self, y_local: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        """This rank's ``[1, T_local, *]`` output -> ``[B, S, *]`` on every CP rank (the plan's ``unpack``)."""
        return self.plan.unpack(y_local, **kwargs)


def segment_documents(
    tokens: torch.Tensor, *, eod_id: int, pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``tokens`` [B, S] -> (document lengths, flat position of each document's first token, number of documents ``[]``).

    A document is a run of consecutive non-PAD positions of one row, ended by an EOD, a PAD or the row end.
    Lengths and starts are capacity-sized, ``[B*S]`` int64: the documents in row-major order, then zeros.
    No host sync.
    """
    valid = tokens != pad_id  # [B, S]
    ends_document = (tokens == eod_id) | ~valid  # [B, S]: an EOD, or a PAD (which ends the run before it)
    follows_end = torch.ones_like(valid)
    follows_end[:, 1:] = ends_document[:, :-1]  # [B, S]: row start, or the previous token ended a document
    starts_document = (valid & follows_end).reshape(-1)  # [B*S] (tokens of any strides)
    document = (torch.cumsum(starts_document, dim=0) - 1).clamp(min=0)  # [B*S] id of the last document started
    lengths = torch.zeros_like(document).scatter_add_(0, document, valid.reshape(-1).long())  # [B*S]
    capacity = document.numel()
    starts = torch.zeros(capacity + 1, dtype=torch.long, device=tokens.device)  # one sink slot for non-starts
    starts.index_copy_(
        0, torch.where(starts_document, document, capacity), torch.arange(capacity, device=tokens.device)
    )
    return lengths, starts[:capacity], starts_document.sum()


def document_alignment(
    ctx: ParallelContext, layout: Layout, alignment: Alignment | int | None, fp8: bool
) -> Alignment | int | None:
    """The alignment of a documents plan (``None`` = the core default for the layout).

    zigzag: the core default, every document's slot padded (``TP*CP*2`` when CP>1, else ``TP``; FP8
    variant with ``fp8``). contiguous: only the stream total is padded, to the same base (FP8: ``base*128``),
    the padding folded into the last document's slot. An explicit ``alignment`` wins.
    """
    if alignment is not None or layout.name != "contiguous":
        return alignment
    base = ctx.default_slot_multiple
    return Alignment.per_stream(base * FP8_STREAM_FACTOR if fp8 else base)


def plan_documents(
    tokens: torch.Tensor,
    *,
    eod_id: int,
    pad_id: int,
    ctx: ParallelContext | None = None,
    layout: LayoutName | Layout = "zigzag",
    fp8: bool = False,
    alignment: Alignment | int | None = None,
) -> PackPlan:
    """The documents plan of ``tokens`` [B, S] (see ``pack_documents`` for the arguments)."""
    _check_tokens(tokens, eod_id, pad_id)
    ctx = require_context(ctx)
    if fp8 and alignment is not None:
        raise ValueError("pass either fp8=True (the layout's FP8 alignment) or an explicit alignment, not both")
    layout_ = get_layout(layout)
    chosen = document_alignment(ctx, layout_, alignment, fp8)
    ctx, layout_, alignment_ = resolve_policy(ctx, layout_, chosen, fp8 and chosen is None)

    lengths, starts, num_documents = segment_documents(tokens, eod_id=eod_id, pad_id=pad_id)  # [B*S], [B*S], []
    return plan_from_documents(ctx, layout_, alignment_, lengths, starts, num_documents, tuple(tokens.shape))


def pack_documents(
    tokens: torch.Tensor,
    *,
    eod_id: int,
    pad_id: int,
    ctx: ParallelContext | None = None,
    layout: LayoutName | Layout = "zigzag",
    fp8: bool = False,
    mtp_depth: int = 0,
    alignment: Alignment | int | None = None,
) -> PackedDocuments:
    """Pack the documents of ``tokens`` [B, S] into this CP rank's ``[1, T_local]`` stream with labels.

    Args:
        tokens: ``[B, S]`` integer token ids.
        eod_id: end-of-document token; it belongs to (and ends) its document.
        pad_id: padding token; never part of a document (end, middle, whole row). Must differ from ``eod_id``.
        ctx: TP/CP sizes and this rank (default: no parallelism).
        layout: ``"zigzag"`` (every document slot padded to ``TP*CP*2``, ``TP`` when CP=1) or
            ``"contiguous"`` (only the stream total padded, folded into the last document's slot).
        fp8: FP8 alignment (zigzag: verl's FP8 policy; contiguous: stream total to ``base*128``).
        mtp_depth: number of multi-token-prediction depths to build targets for (0 = none).
        alignment: an explicit ``Alignment`` / per-slot multiple instead of the layout's default.

    Labels, loss masks and MTP targets all come from ``plan.pack(tokens, shift=k)`` /
    ``plan.target_mask(k)``: taken inside each document on the global stream, then cut for CP.
    Raises ``ValueError`` when the batch holds no document (all PAD). Two host syncs (one with the
    extended core builder, see the module docstring).
    """
    require_int("mtp_depth", mtp_depth, minimum=0)
    plan = plan_documents(tokens, eod_id=eod_id, pad_id=pad_id, ctx=ctx, layout=layout, fp8=fp8, alignment=alignment)

    def shifted(shift: int) -> tuple[torch.Tensor, torch.Tensor]:
        mask = plan.target_mask(shift)  # [1, T_local] bool
        return plan.pack(tokens, shift=shift).masked_fill(~mask, pad_id), mask

    valid_mask = plan.target_mask(0)  # [1, T_local] bool
    labels, loss_mask = shifted(1)
    mtp = [shifted(1 + depth) for depth in range(1, mtp_depth + 1)]
    return PackedDocuments(
        plan=plan,
        tokens=plan.pack(tokens).masked_fill(~valid_mask, pad_id),
        labels=labels,
        loss_mask=loss_mask,
        position_ids=plan.local_position_ids.unsqueeze(0),
        valid_mask=valid_mask,
        document_ids=plan.local_slot.unsqueeze(0),
        mtp_labels=tuple(label for label, _ in mtp),
        mtp_loss_masks=tuple(mask for _, mask in mtp),
        pad_id=pad_id,
    )


def _check_tokens(tokens: object, eod_id: object, pad_id: object) -> None:
    tokens = require_integer_tensor("tokens", tokens)
    if tokens.is_nested or tokens.dim() != 2 or tokens.shape[0] < 1 or tokens.shape[1] < 1:
        raise ValueError(f"tokens must be a [B, S] tensor with B >= 1 and S >= 1, got shape {tuple(tokens.shape)}")
    for name, value in (("eod_id", eod_id), ("pad_id", pad_id)):
        require_token_id(name, value, tokens.dtype)
    if eod_id == pad_id:
        raise ValueError(
            f"eod_id and pad_id are both {eod_id}: a document end and padding must be different tokens "
            "(PAD never belongs to a document, EOD always does)"
        )
