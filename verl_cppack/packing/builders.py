"""Building a ``PackPlan``: ``plan_from_mask`` (padded batch), ``plan_from_lengths`` / ``plan_from_nested``
(jagged sequences), and ``build_plan``, the one builder behind them and ``packing.documents``.

Cost: one device->host read (``core.host.read_to_host``: per-sequence lengths and where each sequence starts,
with the value checks); the per-sequence arithmetic then runs on the host with numpy and the offsets travel
back in one copy. No Python loop over sequences. A mask is scanned as 8-byte words (``packing.mask_rows``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from verl_cppack.context import ParallelContext
from verl_cppack.core import host
from verl_cppack.core.alignment import Alignment
from verl_cppack.core.checks import (
    MAX_STREAM_POSITIONS,
    require_context,
    require_jagged,
    require_stream_int,
    require_tensor,
)
from verl_cppack.core.layouts import Layout, LayoutName, get_layout
from verl_cppack.core.runs import run_offsets
from verl_cppack.packing.mask_rows import MaskRows
from verl_cppack.packing.plan import PackPlan, SequenceTables


def plan_from_mask(
    attention_mask: torch.Tensor,
    ctx: ParallelContext | None = None,
    *,
    layout: LayoutName | Layout = "zigzag",
    alignment: Alignment | int | None = None,
    fp8: bool = False,
) -> PackPlan:
    """Plan for a padded batch: ``attention_mask`` ``[B, S]``, bool or 0/1 integers, valid tokens anywhere.

    Each row becomes one sequence holding its valid tokens in their order (left, right or middle
    padding, empty rows allowed). ``alignment``: ``None`` = verl's default for the layout (FP8 variant
    with ``fp8=True``), an ``int`` = pad every slot to that multiple, or an explicit ``Alignment``.
    """
    require_tensor("attention_mask", attention_mask)
    if attention_mask.is_nested or attention_mask.dim() != 2:
        raise ValueError(f"attention_mask must be a 2-D [B, S] tensor, got shape {tuple(attention_mask.shape)}")
    if attention_mask.dtype.is_floating_point or attention_mask.dtype.is_complex:
        raise TypeError(f"attention_mask must be bool or integer 0/1, got dtype {attention_mask.dtype}")
    batch_size, seq_len = attention_mask.shape
    if batch_size < 1 or seq_len < 1:
        raise ValueError(f"attention_mask must have B >= 1 and S >= 1, got shape {tuple(attention_mask.shape)}")
    ctx, layout_, alignment_ = resolve_policy(ctx, layout, alignment, fp8)

    num_bad_values = None  # a bool mask has no bad values
    if attention_mask.dtype != torch.bool:
        num_bad_values = ((attention_mask != 0) & (attention_mask != 1)).sum()
        attention_mask = attention_mask != 0
    return build_plan(
        ctx, layout_, alignment_, None, (batch_size, seq_len), num_bad_values, mask_rows=MaskRows(attention_mask)
    )


def plan_from_lengths(
    seqlens: torch.Tensor | Sequence[int],
    ctx: ParallelContext | None = None,
    *,
    layout: LayoutName | Layout = "zigzag",
    alignment: Alignment | int | None = None,
    fp8: bool = False,
    device: torch.device | str | None = None,
) -> PackPlan:
    """Plan for jagged sequences of the given lengths (``pack`` then takes a jagged nested tensor)."""
    if not isinstance(seqlens, torch.Tensor):
        if not isinstance(seqlens, Sequence) or not all(
            isinstance(n, int) and not isinstance(n, bool) for n in seqlens
        ):
            raise TypeError("seqlens must be a 1-D integer tensor or a sequence of ints")
        if seqlens:  # before they become int64: a Python int may not fit
            _check_longest(max(seqlens))
        seqlens = torch.tensor(list(seqlens), dtype=torch.long, device=device)
    if seqlens.dtype.is_floating_point or seqlens.dtype.is_complex or seqlens.dtype == torch.bool:
        raise TypeError(f"seqlens must be an integer tensor, got dtype {seqlens.dtype}")
    if seqlens.dim() != 1 or seqlens.numel() < 1:
        raise ValueError(f"seqlens must be 1-D with at least one sequence, got shape {tuple(seqlens.shape)}")
    ctx, layout_, alignment_ = resolve_policy(ctx, layout, alignment, fp8)
    return build_plan(ctx, layout_, alignment_, seqlens, None, (seqlens < 0).sum())


def plan_from_nested(
    nested: torch.Tensor,
    ctx: ParallelContext | None = None,
    *,
    layout: LayoutName | Layout = "zigzag",
    alignment: Alignment | int | None = None,
    fp8: bool = False,
) -> PackPlan:
    """Plan for a jagged nested tensor ``[B, j, *]``: its sequences' real lengths (a view with holes, from
    ``torch.nested.narrow``, is read as ``nested.contiguous()``; ``pack`` does the same)."""
    nested = require_jagged("nested", nested)
    return plan_from_lengths(nested.offsets().diff(), ctx, layout=layout, alignment=alignment, fp8=fp8)


def resolve_policy(
    ctx: ParallelContext | None, layout: LayoutName | Layout, alignment: Alignment | int | None, fp8: bool
) -> tuple[ParallelContext, Layout, Alignment]:
    """Default the context, look up the layout, and turn ``alignment``/``fp8`` into an ``Alignment`` the layout
    can cut for ``ctx`` (``ValueError`` otherwise), before any work."""
    ctx = require_context(ctx)
    ctx.check_group()
    layout_ = get_layout(layout)
    if alignment is None:
        alignment_ = layout_.default_alignment(ctx, fp8=fp8)
    elif fp8:
        raise ValueError("pass either fp8=True (verl's FP8 alignment) or an explicit alignment, not both")
    elif isinstance(alignment, Alignment):
        alignment_ = alignment
    else:
        alignment_ = Alignment.per_slot(require_stream_int("alignment", alignment, minimum=1))
    layout_.check_alignment(alignment_, ctx)
    return ctx, layout_, alignment_


def build_plan(
    ctx: ParallelContext,
    layout: Layout,
    alignment: Alignment,
    seqlens: torch.Tensor
    | None,  # [n] any integer dtype: tokens of each sequence, in stream order; None: one per mask row
    source_shape: tuple[int, int] | None,  # (B, S) of a padded source; None for a jagged source
    num_bad_values: torch.Tensor
    | None,  # [] count of invalid input values, reported after the sync; None: none possible
    *,
    mask_rows: MaskRows | None = None,  # the token mask of a padded source whose rows are the sequences
    sequence_start: torch.Tensor | None = None,  # [n] source row of each sequence's first token (documents)
    num_sequences: torch.Tensor | None = None,  # []: seqlens/sequence_start are capacity buffers, the first ones real
) -> PackPlan:
    """The one plan builder. Sequence ``i`` is ``seqlens[i]`` consecutive tokens: of the source rows from
    ``sequence_start[i]`` (documents), of a mask row (``mask_rows``), or of a jagged source (neither).

    One device->host read brings back the per-sequence lengths (and starts) with the value checks; the
    offsets are numpy on the host and travel back to the device in one copy.
    """
    if mask_rows is not None:
        per_sequence, device = mask_rows.device_stats, mask_rows.mask.device
    else:
        per_sequence = (seqlens,) if sequence_start is None else (seqlens, sequence_start)
        device = seqlens.device
    scalars = [value for value in (num_bad_values, num_sequences) if value is not None]
    # The one device->host sync of the plan.
    read = host.read_to_host(*per_sequence, *scalars)
    per_sequence_host, scalars_host = read[: len(per_sequence)], read[len(per_sequence) :]
    bad = scalars_host[0][0] if num_bad_values is not None else 0
    if bad:
        what = "seqlens must be >= 0" if source_shape is None else "attention_mask values must be 0 or 1"
        raise ValueError(f"{what}; found {bad} offending entries")
    gapped_rows = 0
    if mask_rows is not None:
        seqlens_host, first_column, last_column = mask_rows.extents(per_sequence_host)
        gapped_rows = int(((last_column - first_column + 1 != seqlens_host) & (seqlens_host > 0)).sum())
    else:
        seqlens_host = per_sequence_host[0]
    n = seqlens_host.size if num_sequences is None else int(scalars_host[-1][0])
    seqlens_host = seqlens_host[:n].copy()  # on the CPU the read is a view of the caller's tensor: own it
    _check_longest(int(seqlens_host.max(initial=0)))  # before any sum: lengths below 2**31 cannot overflow int64
    if not seqlens_host.any():
        raise ValueError("the batch has zero valid tokens: there is nothing to pack; skip this micro-batch")
    seqlens_padded = alignment.pad(seqlens_host)
    cu_seqlens, cu_seqlens_padded = run_offsets(seqlens_host), run_offsets(seqlens_padded)
    num_valid_tokens, total_length = int(cu_seqlens[-1]), int(cu_seqlens_padded[-1])
    if total_length >= 2**31:
        raise ValueError(f"the packed stream holds {total_length} positions; THD offsets are int32: split the batch")

    token_rows = None
    if mask_rows is not None and gapped_rows == 0:  # one run per row: it starts at the row's first token
        sequence_start_host = np.arange(n) * source_shape[1] + first_column
    elif mask_rows is not None:  # rows with gaps: tokens are looked up by their rank in row-major order
        token_rows = mask_rows.token_positions(num_valid_tokens)
        sequence_start_host = cu_seqlens[:-1]
    elif sequence_start is not None:
        sequence_start_host = per_sequence_host[1][:n].copy()
    else:
        sequence_start_host = cu_seqlens[:-1]
    offsets = host.tables_to_device([seqlens_host, seqlens_padded, cu_seqlens, cu_seqlens_padded], device, torch.int32)
    return PackPlan(
        ctx=ctx,
        layout=layout,
        alignment=alignment,
        batch_size=int(n),
        source_shape=source_shape,
        seqlens=offsets[0],
        seqlens_padded=offsets[1],
        cu_seqlens=offsets[2],
        cu_seqlens_padded=offsets[3],
        max_seqlen=int(seqlens_host.max()),
        max_seqlen_padded=int(seqlens_padded.max()),
        num_valid_tokens=num_valid_tokens,
        total_length=total_length,
        local_length=total_length // ctx.cp_size,
        tables=SequenceTables(seqlens_host, seqlens_padded, cu_seqlens, cu_seqlens_padded, sequence_start_host),
        token_rows=token_rows,
    )


def _check_longest(longest: int) -> None:
    if longest >= MAX_STREAM_POSITIONS:
        raise ValueError(
            f"a sequence of {longest} tokens cannot be packed: THD offsets are int32 (every stream < 2**31 positions); "
            "split the sequence or the batch"
        )
