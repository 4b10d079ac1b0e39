"""Building a ``PackPlan``, one builder per input mode, all ending in one assembly (``_assemble``):

- ``plan_from_mask``: a padded ``[B, S]`` batch, one sequence per mask row (``_plan_from_mask_rows``);
- ``plan_from_lengths`` / ``plan_from_nested``: jagged sequences (``_plan_from_host_lengths``);
- ``plan_from_documents``: documents of ``[B, S]`` tokens by their lengths and first positions (``packing.documents``).

Cost: one device->host read (``core.host.read_to_host``: per-sequence lengths and where each sequence starts,
with the value checks); the per-sequence arithmetic then runs on the host with numpy and the offsets travel
back in one copy. No Python loop over sequences. A mask is scanned where it lives (``packing.mask_rows``).
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
    kept_per_arguments,
    require_context,
    require_jagged,
    require_mask,
    require_stream_int,
)
from verl_cppack.core.layouts import Layout, LayoutName, get_layout
from verl_cppack.core.runs import counting, run_offsets
from verl_cppack.packing.indices import compiled_kernels
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
    return plan_from_checked_mask(require_mask("attention_mask", attention_mask), ctx, layout, alignment, fp8)


def plan_from_checked_mask(
    attention_mask: torch.Tensor,
    ctx: ParallelContext | None,
    layout: LayoutName | Layout = "zigzag",
    alignment: Alignment | int | None = None,
    fp8: bool = False,
    *,
    compiled: bool = True,
) -> PackPlan:
    """``plan_from_mask`` for a mask that already passed ``core.checks.require_mask`` (the drop-ins check theirs
    once, under the caller's argument name). ``compiled``: a CPU mask's tables and pack index in one compiled call
    where it applies (``packing.compiled``); ``False``: numpy's calls alone (the two agree, value for value)."""
    ctx, layout_, alignment_ = resolve_policy(ctx, layout, alignment, fp8)
    return _plan_from_mask_rows(ctx, layout_, alignment_, MaskRows(attention_mask), compiled)


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
    if seqlens.is_meta:
        raise ValueError("seqlens is a meta tensor (a shape without values): pass the lengths with data")
    ctx, layout_, alignment_ = resolve_policy(ctx, layout, alignment, fp8)
    (seqlens_host,) = host.read_to_host(seqlens)  # the plan's one device->host read
    return _plan_from_host_lengths(ctx, layout_, alignment_, seqlens_host.copy(), seqlens.device)


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
    offsets = require_jagged("nested", nested).offsets()  # [B+1] int64
    ctx, layout_, alignment_ = resolve_policy(ctx, layout, alignment, fp8)
    (offsets_host,) = host.read_to_host(offsets)  # the plan's one device->host read
    return _plan_from_host_lengths(ctx, layout_, alignment_, np.diff(offsets_host), offsets.device)


@kept_per_arguments  # every plan asks
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


def _plan_from_mask_rows(
    ctx: ParallelContext,
    layout: Layout,
    alignment: Alignment,
    mask_rows: MaskRows,  # the token mask of a padded [B, S] source: row b is sequence b
    compiled: bool = True,
) -> PackPlan:
    """A padded batch: each row's tokens, from its first token (one run) or by rank in row-major order (gaps)."""
    cut_here = mask_rows.device.type == "cpu" and (ctx.cp_size == 1 or layout.name == "zigzag")
    kernel = compiled_kernels() if compiled and cut_here else None
    found = kernel and kernel.mask_plan_tables(host.host_memory(mask_rows.given), alignment, ctx.cp_size, ctx.cp_rank)
    if found:
        *tables, index, zero_positions = found
        plan = _plan_of(ctx, layout, alignment, SequenceTables(*tables), mask_rows.shape, mask_rows.device)
        plan._copies["index", 0, False] = index, zero_positions  # what plan._pack_index(0, False) would build
        return plan
    seqlens_host, first_column, last_column = mask_rows.scan()  # the plan's one device->host read
    source_shape = mask_rows.shape
    device = mask_rows.device
    if ((last_column - first_column + 1 != seqlens_host) & (seqlens_host > 0)).any():  # rows with gaps
        token_rows = mask_rows.token_positions(int(seqlens_host.sum()))
        return _assemble(ctx, layout, alignment, seqlens_host, None, source_shape, device, token_rows)
    sequence_start = counting(seqlens_host.size) * source_shape[1] + first_column  # one run per row
    return _assemble(ctx, layout, alignment, seqlens_host, sequence_start, source_shape, device)


def _plan_from_host_lengths(
    ctx: ParallelContext,
    layout: Layout,
    alignment: Alignment,
    seqlens_host: np.ndarray,  # [n] int64 lengths, read to the host
    device: torch.device,
) -> PackPlan:
    """Jagged sequences, one after another in the source."""
    negative = int(np.count_nonzero(seqlens_host < 0))
    if negative:
        raise ValueError(f"seqlens must be >= 0; found {negative} offending entries")
    return _assemble(ctx, layout, alignment, seqlens_host, None, None, device)


def plan_from_documents(
    ctx: ParallelContext,
    layout: Layout,
    alignment: Alignment,
    lengths: torch.Tensor,  # [capacity] tokens of each document in row-major order, the first num_documents real
    starts: torch.Tensor,  # [capacity] flat [B*S] position of each document's first token
    num_documents: torch.Tensor,  # [] how many documents there are
    source_shape: tuple[int, int],  # (B, S) of the tokens
) -> PackPlan:
    """Documents of a ``[B, S]`` token batch (``packing.documents.segment_documents``), as sequences."""
    lengths_host, starts_host, count = host.read_to_host(lengths, starts, num_documents)  # the one sync
    n = int(count[0])
    return _assemble(
        ctx, layout, alignment, lengths_host[:n].copy(), starts_host[:n].copy(), source_shape, lengths.device
    )


def _assemble(
    ctx: ParallelContext,
    layout: Layout,
    alignment: Alignment,
    seqlens_host: np.ndarray,  # [n] tokens of each sequence
    sequence_start_host: np.ndarray | None,  # [n] source position of each sequence's first token; None: packed
    source_shape: tuple[int, int] | None,  # (B, S) of a padded source; None for a jagged one
    device: torch.device,
    token_rows: torch.Tensor | None = None,  # [T_valid] source position of every token (mask rows with gaps)
) -> PackPlan:
    """The plan every builder ends in: padding, offsets and totals on the host, the padded offsets sent to the
    device (what every ``PackedSeqParams`` carries; the real offsets go when first asked for)."""
    longest = int(seqlens_host.max(initial=0))
    _check_longest(longest)
    if not longest:
        raise ValueError("the batch has zero valid tokens: there is nothing to pack; skip this micro-batch")
    seqlens_padded = alignment.pad(seqlens_host)
    cu_seqlens, cu_seqlens_padded = run_offsets(seqlens_host), run_offsets(seqlens_padded)
    if int(cu_seqlens_padded[-1]) >= 2**31:
        raise ValueError(
            f"the packed stream holds {int(cu_seqlens_padded[-1])} positions; THD offsets are int32: split the batch"
        )
    if sequence_start_host is None:
        sequence_start_host = cu_seqlens[:-1]
    tables = SequenceTables(seqlens_host, seqlens_padded, cu_seqlens, cu_seqlens_padded, sequence_start_host)
    return _plan_of(ctx, layout, alignment, tables, source_shape, device, token_rows)


def _plan_of(
    ctx: ParallelContext,
    layout: Layout,
    alignment: Alignment,
    tables: SequenceTables,
    source_shape: tuple[int, int] | None,
    device: torch.device,
    token_rows: torch.Tensor | None = None,
) -> PackPlan:
    total_length = int(tables.cu_seqlens_padded[-1])
    return PackPlan(
        ctx=ctx,
        layout=layout,
        alignment=alignment,
        batch_size=int(tables.seqlens.size),
        source_shape=source_shape,
        cu_seqlens_padded=host.to_device(tables.cu_seqlens_padded, device, torch.int32),
        max_seqlen=int(tables.seqlens.max()),
        max_seqlen_padded=int(tables.seqlens_padded.max()),
        num_valid_tokens=int(tables.cu_seqlens[-1]),
        total_length=total_length,
        local_length=total_length // ctx.cp_size,
        tables=tables,
        token_rows=token_rows,
    )


def _check_longest(longest: int) -> None:
    if longest >= MAX_STREAM_POSITIONS:
        raise ValueError(
            f"a sequence of {longest} tokens cannot be packed: THD offsets are int32 (every stream < 2**31 positions); "
            "split the sequence or the batch"
        )
