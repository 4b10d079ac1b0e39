"""``PackedSeqParams`` with valid-token metadata that survives pipeline / virtual-pipeline micro-batching.

``PER_MICROBATCH_FIELDS`` hold this micro-batch's values, ``WHOLE_BATCH_FIELDS`` the whole batch's (never read them
as this micro-batch's); counts are global over CP, exact host ints (no collective, no sync). The class subclasses the
installed ``PackedSeqParams``, so Megatron accepts it and ``dataclasses.replace`` keeps the extras."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from functools import cache
from typing import Any

import torch

from verl_cppack.core.checks import require_int
from verl_cppack.integrations.megatron import packed_seq_params, packed_seq_params_class, packed_seq_params_fields
from verl_cppack.packing.documents import PackedDocuments, WholeBatch, pack_documents
from verl_cppack.packing.plan import PackPlan

PER_MICROBATCH_FIELDS = (
    "local_valid_mask",
    "local_loss_mask",
    "num_valid_tokens",
    "num_loss_tokens",
    "microbatch_index",
)
WHOLE_BATCH_FIELDS = (
    "whole_batch_num_valid_tokens",
    "whole_batch_num_loss_tokens",
    "whole_batch_num_documents",
    "whole_batch_num_microbatches",
)


@cache
def packed_seq_params_with_valid_tokens_class() -> type:
    """``PackedSeqParamsWithValidTokens``: the installed ``PackedSeqParams`` plus the fields above."""
    base = packed_seq_params_class()
    taken = packed_seq_params_fields(base) & {*PER_MICROBATCH_FIELDS, *WHOLE_BATCH_FIELDS}
    if taken:
        raise TypeError(f"this megatron-core's PackedSeqParams already defines {sorted(taken)}; cannot extend it")
    masks = ("local_valid_mask", "local_loss_mask")  # [T_local] bool; the other fields are ints
    extra = [
        (name, "torch.Tensor | None" if name in masks else "int | None", dataclasses.field(default=None))
        for name in (*PER_MICROBATCH_FIELDS, *WHOLE_BATCH_FIELDS)
    ]
    cls = dataclasses.make_dataclass("PackedSeqParamsWithValidTokens", extra, bases=(base,))
    cls.__module__ = __name__
    cls.__doc__ = "PackedSeqParams (THD) plus PER_MICROBATCH_FIELDS and WHOLE_BATCH_FIELDS (megatron_pipeline)"
    return cls


def packed_seq_params_with_valid_tokens(
    plan: PackPlan,
    *,
    valid_mask: torch.Tensor,
    loss_mask: torch.Tensor,
    microbatch_index: int = 0,
    whole_batch: WholeBatch | None = None,
) -> Any:
    """The plan's ``PackedSeqParams`` plus this micro-batch's valid-token metadata. ``valid_mask`` / ``loss_mask``:
    this rank's ``[1, T_local]`` or ``[T_local]`` bool (``num_loss_tokens = num_valid_tokens - batch_size``);
    ``whole_batch=None``: the batch is this one micro-batch."""
    num_loss_tokens = plan.num_valid_tokens - plan.batch_size
    if whole_batch is None:
        whole_batch = WholeBatch(plan.num_valid_tokens, num_loss_tokens, plan.batch_size, 1)
    require_int("microbatch_index", microbatch_index, minimum=0)
    if microbatch_index >= whole_batch.num_microbatches:
        raise ValueError(
            f"microbatch_index={microbatch_index} must be < whole_batch.num_microbatches={whole_batch.num_microbatches}"
        )
    base = packed_seq_params(plan)
    cls = packed_seq_params_with_valid_tokens_class()
    return cls(
        **{name: getattr(base, name) for name in packed_seq_params_fields(type(base))},
        local_valid_mask=_local_vector("valid_mask", valid_mask, plan.local_length),
        local_loss_mask=_local_vector("loss_mask", loss_mask, plan.local_length),
        num_valid_tokens=plan.num_valid_tokens,
        num_loss_tokens=num_loss_tokens,
        microbatch_index=microbatch_index,
        **{name: getattr(whole_batch, name.removeprefix("whole_batch_")) for name in WHOLE_BATCH_FIELDS},
    )


def documents_packed_seq_params(documents: PackedDocuments) -> Any:
    """``packed_seq_params_with_valid_tokens`` of packed documents (a new object per call)."""
    return packed_seq_params_with_valid_tokens(
        documents.plan,
        valid_mask=documents.valid_mask,
        loss_mask=documents.loss_mask,
        microbatch_index=documents.microbatch_index,
        whole_batch=documents.whole_batch,
    )


def split_microbatches(tokens: torch.Tensor, num_microbatches: int, **pack_kwargs: Any) -> list[PackedDocuments]:
    """``tokens`` [B, S] cut into ``num_microbatches`` equal row groups, each ``pack_documents(rows, **pack_kwargs)``
    with its own micro-batch index and the shared whole-batch totals."""
    require_int("num_microbatches", num_microbatches, minimum=1)
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2:
        raise ValueError("tokens must be a [B, S] tensor")
    if tokens.shape[0] % num_microbatches:
        raise ValueError(
            f"tokens has B={tokens.shape[0]} rows, not divisible into num_microbatches={num_microbatches} equal "
            "micro-batches; pad the batch with whole rows or pick a divisor"
        )
    packed = []
    for index, rows in enumerate(tokens.chunk(num_microbatches)):  # loop over micro-batches, not sequences
        try:
            packed.append(pack_documents(rows, **pack_kwargs))
        except ValueError as error:
            raise ValueError(f"micro-batch {index} of {num_microbatches}: {error}") from error
    whole_batch = WholeBatch(
        num_valid_tokens=sum(docs.plan.num_valid_tokens for docs in packed),
        num_loss_tokens=sum(docs.plan.num_valid_tokens - docs.num_documents for docs in packed),
        num_documents=sum(docs.num_documents for docs in packed),
        num_microbatches=num_microbatches,
    )
    return [
        dataclasses.replace(docs, microbatch_index=index, whole_batch=whole_batch) for index, docs in enumerate(packed)
    ]


def virtual_pipeline_iterators(microbatches: Sequence[Any], num_model_chunks: int) -> list[Iterator[Any]]:
    """One iterator per virtual-pipeline model chunk over the same micro-batches (each chunk consumes all of them)."""
    require_int("num_model_chunks", num_model_chunks, minimum=1)
    items = list(microbatches)
    return [iter(items) for _ in range(num_model_chunks)]


def _local_vector(name: str, mask: torch.Tensor, local_length: int) -> torch.Tensor:
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        raise TypeError(f"{name} must be a bool tensor")
    if mask.numel() != local_length or mask.dim() not in (1, 2):
        raise ValueError(
            f"{name} must be [1, T_local] or [T_local] with T_local={local_length}, got {tuple(mask.shape)}"
        )
    return mask.reshape(local_length)
