"""``PackedSeqParams`` with valid-token metadata that survives pipeline / virtual-pipeline micro-batching.

Two kinds of fields, kept apart by name: per micro-batch (``PER_MICROBATCH_FIELDS``: this micro-batch only) and
whole batch (``WHOLE_BATCH_FIELDS``: the same on every micro-batch, never to be read as this micro-batch's value).
Counts are global over the CP group and exact host ints (a micro-batch's loss tokens are its real tokens minus its
documents: no collective, no sync). The class subclasses the installed ``PackedSeqParams`` (a stand-in without
megatron-core), so Megatron accepts it and ``dataclasses.replace`` keeps the extras.
"""

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
    extra = [
        ("local_valid_mask", "torch.Tensor | None", dataclasses.field(default=None)),  # [T_local] bool
        ("local_loss_mask", "torch.Tensor | None", dataclasses.field(default=None)),  # [T_local] bool
        ("num_valid_tokens", "int | None", dataclasses.field(default=None)),
        ("num_loss_tokens", "int | None", dataclasses.field(default=None)),
        ("microbatch_index", "int | None", dataclasses.field(default=None)),
        *((name, "int | None", dataclasses.field(default=None)) for name in WHOLE_BATCH_FIELDS),
    ]
    cls = dataclasses.make_dataclass("PackedSeqParamsWithValidTokens", extra, bases=(base,))
    cls.__module__ = __name__
    cls.__doc__ = (
        "PackedSeqParams (THD) plus per-micro-batch valid-token fields (local_valid_mask, local_loss_mask, "
        "num_valid_tokens, num_loss_tokens, microbatch_index) and whole-batch totals (whole_batch_*)."
    )
    return cls


def packed_seq_params_with_valid_tokens(
    plan: PackPlan,
    *,
    valid_mask: torch.Tensor,
    loss_mask: torch.Tensor,
    microbatch_index: int = 0,
    whole_batch: WholeBatch | None = None,
) -> Any:
    """The plan's ``PackedSeqParams`` plus this micro-batch's valid-token metadata.

    ``valid_mask`` / ``loss_mask``: this rank's ``[1, T_local]`` or ``[T_local]`` bool; ``loss_mask`` is the plan's
    next-token target mask (possibly narrowed), so ``num_loss_tokens = num_valid_tokens - batch_size``.
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
        whole_batch_num_valid_tokens=whole_batch.num_valid_tokens,
        whole_batch_num_loss_tokens=whole_batch.num_loss_tokens,
        whole_batch_num_documents=whole_batch.num_documents,
        whole_batch_num_microbatches=whole_batch.num_microbatches,
    )


def documents_packed_seq_params(documents: PackedDocuments) -> Any:
    """Megatron ``PackedSeqParams`` (THD) of packed documents plus their micro-batch's valid-token metadata (a new
    object per call; the contiguous layout with CP>1 needs a megatron-core with ``cp_partition_mode``)."""
    return packed_seq_params_with_valid_tokens(
        documents.plan,
        valid_mask=documents.valid_mask,
        loss_mask=documents.loss_mask,
        microbatch_index=documents.microbatch_index,
        whole_batch=documents.whole_batch,
    )


def split_microbatches(tokens: torch.Tensor, num_microbatches: int, **pack_kwargs: Any) -> list[PackedDocuments]:
    """Cut ``tokens`` [B, S] into ``num_microbatches`` equal row groups and pack each as documents
    (``pack_kwargs`` to ``pack_documents``), each with its own per-micro-batch fields and the shared whole-batch totals."""
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
    """One iterator per virtual-pipeline model chunk, each over the same micro-batches in order (every chunk of
    Megatron's interleaved schedule consumes all ``M``; one shared iterator would hand chunk 1 micro-batch 2's data)."""
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
