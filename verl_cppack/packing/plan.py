"""The packing plan: every offset and index of one micro-batch, computed once, applied to every tensor.

Vocabulary
----------
source
    What the caller holds: a padded ``[B, S, *]`` tensor (plans built from an attention mask) or a jagged
    nested tensor whose values are ``[N, *]`` (plans built from lengths). Flattened, it is a list of
    *source rows*: ``B * S`` of them for padded input, ``N`` for jagged input.
stream
    The global padded THD stream of ``T`` positions. Sequence ``i`` owns slot
    ``[cu_seqlens_padded[i], cu_seqlens_padded[i+1])``; its real tokens open the slot, padding closes it.
local stream
    The ``T / cp_size`` positions this CP rank holds, in the order the layout gives (``local_index``).
rank-major stream
    All ranks' local streams concatenated, rank 0 first: what an all-gather returns.

Cost: building a plan makes one device->host sync (the sizes needed to allocate), no Python loop over
sequences, three int8 reductions over the mask and O(N + T) integer work; ``pack`` is one ``index_select`` and one
``masked_fill``; ``unpack`` is one all-gather and one ``index_copy`` into zeros (a sink row takes padding).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
import torch.nn.functional as F

from verl_cppack.collectives.gather import GradientContract, all_gather_rank_major
from verl_cppack.context import ParallelContext
from verl_cppack.core.alignment import Alignment
from verl_cppack.core.checks import require_int, require_tensor
from verl_cppack.core.layouts import Layout, LayoutName, get_layout
from verl_cppack.core.runs import repeat_runs


@dataclass(frozen=True, eq=False)
class PackPlan:
    """Offsets and indices of one packed micro-batch for one CP rank (see the module docstring)."""

    ctx: ParallelContext
    layout: Layout
    alignment: Alignment
    batch_size: int  # number of sequences (slots)
    source_shape: tuple[int, int] | None  # (B, S) of a padded source; None for a jagged source
    seqlens: torch.Tensor  # [n] int32 real tokens per sequence
    seqlens_padded: torch.Tensor  # [n] int32 slot lengths
    cu_seqlens: torch.Tensor  # [n+1] int32, global
    cu_seqlens_padded: torch.Tensor  # [n+1] int32, global
    max_seqlen: int  # longest real sequence
    max_seqlen_padded: int  # longest slot
    num_valid_tokens: int  # N = cu_seqlens[-1]
    total_length: int  # T = cu_seqlens_padded[-1]
    local_length: int  # T / cp_size
    local_index: torch.Tensor  # [T_local] int64 stream position of each local position
    local_valid_mask: torch.Tensor  # [T_local] bool, True at real tokens
    local_source: torch.Tensor  # [T_local] int64 source row of each local position (0 at padding)
    stream_source: torch.Tensor  # [T] int64 source row of each stream position; ``source_rows`` at padding
    rank_major_source: torch.Tensor  # [T] int64 source row of each rank-major position; ``source_rows`` at padding
    token_rows: torch.Tensor | None  # [N] int64 source row of each real token, in stream order (None: jagged, identity)

    @property
    def source_rows(self) -> int:
        """Rows of the flattened source: ``B * S`` for a padded source, ``N`` for a jagged one."""
        return self.num_valid_tokens if self.source_shape is None else self.source_shape[0] * self.source_shape[1]

    @cached_property
    def local_slot(self) -> torch.Tensor:
        """[T_local] int64 sequence owning each local position."""
        return torch.searchsorted(self.cu_seqlens_padded, self.local_index, right=True) - 1

    @cached_property
    def local_position_ids(self) -> torch.Tensor:
        """[T_local] int64 offset inside the slot: restarts at 0 for every sequence (padding continues the count)."""
        return self.local_index - self.cu_seqlens_padded.long().index_select(0, self.local_slot)

    # ------------------------------------------------------------------ pack
    def pack(self, x: torch.Tensor, *, shift: int = 0, wrap: bool = False) -> torch.Tensor:
        """``x`` (``[B, S, *]`` or jagged ``[B, j, *]``, any dtype) -> ``[1, T_local, *]``, zeros at padding.

        ``shift=k`` packs, at each position, the token ``k`` places later *in the same sequence* (labels
        for ``k=1``, multi-token-prediction targets for ``k>1``), taken on the global stream before the CP
        cut; positions whose target lies past the sequence end get zero (see ``target_mask``). With
        ``wrap=True`` the target wraps around inside the sequence instead (verl's ``need_roll``).
        """
        rows = self._source_rows(x)
        if shift == 0:
            source, padding = self.local_source, self.local_padding_mask
        else:
            source, valid = self._shifted_source(shift, wrap)
            padding = ~valid
        packed = rows.index_select(0, source)  # [T_local, *] fresh, so filled in place
        return packed.masked_fill_(padding.view(-1, *([1] * (packed.dim() - 1))), 0).unsqueeze(0)

    @cached_property
    def local_padding_mask(self) -> torch.Tensor:
        """[T_local] bool, True at padding (``~local_valid_mask``, kept for ``pack``)."""
        return ~self.local_valid_mask

    def target_mask(self, shift: int = 1, wrap: bool = False) -> torch.Tensor:
        """``[1, T_local]`` bool: positions whose shifted target (see ``pack``) is a real token."""
        return self._shifted_source(shift, wrap)[1].unsqueeze(0)

    def _shifted_source(self, shift: int, wrap: bool) -> tuple[torch.Tensor, torch.Tensor]:
        require_int("shift", shift, minimum=0)
        if shift == 0:
            return self.local_source, self.local_valid_mask
        seqlens = self.seqlens.long().index_select(0, self.local_slot)  # [T_local]
        target = self.local_position_ids + shift  # [T_local] target offset inside the slot
        if wrap:
            target = target % seqlens.clamp(min=1)  # the clamp only touches empty slots, which hold no token
            valid = self.local_valid_mask
        else:
            valid = self.local_valid_mask & (target < seqlens)
        stream_position = self.cu_seqlens_padded.long().index_select(0, self.local_slot) + target
        source = self.stream_source.index_select(0, torch.where(valid, stream_position, 0))
        return torch.where(valid, source, 0), valid

    def _source_rows(self, x: torch.Tensor) -> torch.Tensor:
        require_tensor("x", x)
        if x.device != self.local_index.device:
            raise ValueError(f"x is on {x.device} but the plan was built on {self.local_index.device}; move one")
        if self.source_shape is None:
            if not x.is_nested:
                raise TypeError("this plan was built from sequence lengths: pass a jagged nested tensor")
            values = x.values()
            if x.size(0) != self.batch_size or values.shape[0] != self.num_valid_tokens:
                raise ValueError(
                    f"nested x has {x.size(0)} sequences / {values.shape[0]} tokens, the plan expects "
                    f"{self.batch_size} / {self.num_valid_tokens}; build a plan from this tensor's offsets"
                )
            return values
        if x.is_nested:
            raise TypeError("this plan was built from a [B, S] batch: pass a padded [B, S, *] tensor")
        if x.dim() < 2 or tuple(x.shape[:2]) != self.source_shape:
            raise ValueError(
                f"x must have shape [B, S, *] = [{self.source_shape[0]}, {self.source_shape[1]}, *] like the "
                f"batch the plan was built from, got {tuple(x.shape)}"
            )
        return x.reshape(self.source_rows, *x.shape[2:])

    # ---------------------------------------------------------------- unpack
    def unpack(self, y_local: torch.Tensor, *, gradient: GradientContract = "local") -> torch.Tensor:
        """This rank's ``[1, T_local, *]`` output -> the full batch on every CP rank.

        Padded-source plans return ``[B, S, *]``, jagged-source plans a jagged nested tensor. Padding is
        zero, the dtype is kept. The all-gather runs over ``ctx.cp_group``; with ``gradient="local"``
        (verl's contract) only this rank's chunk receives gradient, see ``all_gather_rank_major``.
        """
        local = self._check_local(y_local)
        return self._to_source_layout(self._scatter_rows(all_gather_rank_major(local, self.ctx, gradient)))

    def restore(self, local_outputs: Sequence[torch.Tensor]) -> torch.Tensor:
        """Pure, no process group: every rank's ``[1, T_local, *]`` output (rank order) -> what ``unpack`` returns."""
        if len(local_outputs) != self.ctx.cp_size:
            raise ValueError(f"restore needs one local output per CP rank ({self.ctx.cp_size}), got {len(local_outputs)}")
        return self._to_source_layout(self._scatter_rows(torch.cat([self._check_local(y) for y in local_outputs])))

    def unpack_nested(self, y_local: torch.Tensor, *, gradient: GradientContract = "local") -> torch.Tensor:
        """Like ``unpack`` but always a jagged nested tensor ``[n, j, *]`` of the real tokens of each sequence."""
        rows = self._scatter_rows(all_gather_rank_major(self._check_local(y_local), self.ctx, gradient))
        values = rows if self.token_rows is None else rows.index_select(0, self.token_rows)  # [N, *]
        return torch.nested.nested_tensor_from_jagged(values, offsets=self.cu_seqlens.long())

    def _check_local(self, y_local: torch.Tensor) -> torch.Tensor:
        require_tensor("y_local", y_local)
        if y_local.is_nested or y_local.dim() < 2 or y_local.shape[0] != 1 or y_local.shape[1] != self.local_length:
            raise ValueError(
                f"local output must have shape [1, T_local, *] with T_local={self.local_length} "
                f"(this plan's local length), got {tuple(y_local.shape)}"
            )
        return y_local[0]

    def _scatter_rows(self, gathered: torch.Tensor) -> torch.Tensor:
        """Rank-major ``[T, *]`` -> source rows ``[source_rows, *]``, zeros where no token lands (one extra sink row)."""
        rows = gathered.new_zeros((self.source_rows + 1, *gathered.shape[1:]))
        return rows.index_copy_(0, self.rank_major_source, gathered)[: self.source_rows]

    def _to_source_layout(self, rows: torch.Tensor) -> torch.Tensor:
        if self.source_shape is None:
            return torch.nested.nested_tensor_from_jagged(rows, offsets=self.cu_seqlens.long())
        return rows.view(*self.source_shape, *rows.shape[1:])

    # -------------------------------------------------------------- megatron
    def packed_seq_params(self, *, real_seqlens_in_attention: bool = False) -> Any:
        """Megatron ``PackedSeqParams`` (THD) for this plan; see ``integrations.megatron``."""
        from verl_cppack.integrations.megatron import packed_seq_params_from_plan

        return packed_seq_params_from_plan(self, real_seqlens_in_attention=real_seqlens_in_attention)


# ====================================================================== builders
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

    num_bad_values = torch.zeros((), dtype=torch.long, device=attention_mask.device)
    if attention_mask.dtype != torch.bool:
        num_bad_values = ((attention_mask != 0) & (attention_mask != 1)).sum()
        attention_mask = attention_mask != 0
    return build_plan(ctx, layout_, alignment_, None, (batch_size, seq_len), attention_mask, num_bad_values)


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
        if not isinstance(seqlens, Sequence) or not all(isinstance(n, int) and not isinstance(n, bool) for n in seqlens):
            raise TypeError("seqlens must be a 1-D integer tensor or a sequence of ints")
        seqlens = torch.tensor(list(seqlens), dtype=torch.long, device=device)
    if seqlens.dtype.is_floating_point or seqlens.dtype.is_complex or seqlens.dtype == torch.bool:
        raise TypeError(f"seqlens must be an integer tensor, got dtype {seqlens.dtype}")
    if seqlens.dim() != 1 or seqlens.numel() < 1:
        raise ValueError(f"seqlens must be 1-D with at least one sequence, got shape {tuple(seqlens.shape)}")
    ctx, layout_, alignment_ = resolve_policy(ctx, layout, alignment, fp8)
    return build_plan(ctx, layout_, alignment_, seqlens, None, None, (seqlens < 0).sum())


def plan_from_nested(
    nested: torch.Tensor,
    ctx: ParallelContext | None = None,
    *,
    layout: LayoutName | Layout = "zigzag",
    alignment: Alignment | int | None = None,
    fp8: bool = False,
) -> PackPlan:
    """Plan for a jagged nested tensor ``[B, j, *]`` (its ``offsets()`` give the lengths)."""
    require_tensor("nested", nested)
    if not nested.is_nested or nested.layout != torch.jagged:
        raise TypeError("nested must be a jagged nested tensor (torch.nested.nested_tensor(..., layout=torch.jagged))")
    return plan_from_lengths(nested.offsets().diff(), ctx, layout=layout, alignment=alignment, fp8=fp8)


def resolve_policy(
    ctx: ParallelContext | None, layout: LayoutName | Layout, alignment: Alignment | int | None, fp8: bool
) -> tuple[ParallelContext, Layout, Alignment]:
    """Default the context, look up the layout, and turn ``alignment``/``fp8`` into an ``Alignment`` the layout
    can cut for ``ctx`` (``ValueError`` otherwise), before any work."""
    ctx = ParallelContext() if ctx is None else ctx
    if not isinstance(ctx, ParallelContext):
        raise TypeError(f"ctx must be a ParallelContext, got {type(ctx).__name__}")
    layout_ = get_layout(layout)
    if alignment is None:
        alignment_ = layout_.default_alignment(ctx, fp8=fp8)
    elif fp8:
        raise ValueError("pass either fp8=True (verl's FP8 alignment) or an explicit alignment, not both")
    elif isinstance(alignment, Alignment):
        alignment_ = alignment
    else:
        alignment_ = Alignment.per_slot(require_int("alignment", alignment, minimum=1))
    layout_.check_alignment(alignment_, ctx)
    return ctx, layout_, alignment_


def _cumsum0(lengths: torch.Tensor) -> torch.Tensor:
    return F.pad(torch.cumsum(lengths, dim=0), (1, 0))


class _TokenRows:
    """Where the tokens of a ``[B, S]`` bool mask sit, read in row-major order.

    Rollout rows (left-padded prompt + right-padded response) hold one run of tokens each; then the
    positions follow from each row's first column in O(N). Rows with gaps take the general path: a rank
    per mask entry and a scatter, O(B*S). ``gapped_rows`` is read in the plan's one sync to choose.
    """

    def __init__(self, token_mask: torch.Tensor) -> None:
        self.mask = token_mask.contiguous()  # [B, S] bool
        as_int8 = self.mask.view(torch.int8)  # same bytes; int8 reductions are the cheap ones
        self.row_counts = as_int8.sum(dim=1, dtype=torch.int32).long()  # [B]
        self.first_column = as_int8.argmax(dim=1)  # [B] first token of each row (0 for an empty row)
        last_column = self.mask.shape[1] - 1 - as_int8.flip(1).argmax(dim=1)  # [B]
        one_run = last_column - self.first_column + 1 == self.row_counts
        self.gapped_rows = (~one_run & (self.row_counts > 0)).sum()  # [] rows whose tokens are not one run

    def positions(self, token_index: torch.Tensor, contiguous: bool) -> torch.Tensor:
        """``token_index`` = arange(N) -> [N] flat ``b * S + s`` of the n-th token."""
        batch_size, seq_len = self.mask.shape
        device = self.mask.device
        num_tokens = token_index.numel()
        if contiguous:
            row_start = torch.arange(batch_size, device=device) * seq_len + self.first_column  # [B]
            shift = row_start - _cumsum0(self.row_counts)[:-1]  # [B]
            return repeat_runs(shift, self.row_counts, num_tokens).add_(token_index)
        flat = self.mask.reshape(-1)
        rank = torch.where(flat, torch.cumsum(flat, 0) - 1, num_tokens)  # [B*S], non-tokens to a sink
        positions = torch.empty(num_tokens + 1, dtype=torch.long, device=device)
        return positions.index_copy_(0, rank, torch.arange(flat.numel(), device=device))[:num_tokens]


def build_plan(
    ctx: ParallelContext,
    layout: Layout,
    alignment: Alignment,
    seqlens: torch.Tensor | None,  # [n] any integer dtype: tokens of each sequence, in stream order; None: one per row
    source_shape: tuple[int, int] | None,  # (B, S) of a padded source; None for a jagged source
    token_mask: torch.Tensor | None,  # [B, S] bool: which source rows are tokens (None: jagged, all are)
    num_bad_values: torch.Tensor,  # [] count of invalid input values, reported after the sync
    num_sequences: torch.Tensor | None = None,  # []: seqlens is a capacity buffer, its first num_sequences are real
) -> PackPlan:
    """The one plan builder. The tokens of ``token_mask``, read in row-major order, are cut into sequences
    of ``seqlens`` tokens each: rows of a padded batch, documents of a token batch, or jagged sequences.
    ``seqlens`` must sum to the number of tokens (callers derive both from the same data)."""
    rows = _TokenRows(token_mask) if token_mask is not None else None
    seqlens = rows.row_counts if seqlens is None else seqlens.long()
    device = seqlens.device
    seqlens_padded = alignment.pad(seqlens, num_sequences)  # [n]
    cu_seqlens, cu_seqlens_padded = _cumsum0(seqlens), _cumsum0(seqlens_padded)  # [n+1]
    count = seqlens.new_tensor(seqlens.numel()) if num_sequences is None else num_sequences.long()

    # The one device->host sync of the plan: sizes to allocate, and the value checks.
    total_length, num_valid_tokens, max_seqlen, max_seqlen_padded, bad, n, gapped_rows = torch.stack(
        [
            cu_seqlens_padded[-1],
            cu_seqlens[-1],
            seqlens.max(),
            seqlens_padded.max(),
            num_bad_values.long(),
            count,
            count.new_zeros(()) if rows is None else rows.gapped_rows,
        ]
    ).tolist()
    if num_sequences is not None:  # keep the real sequences of the capacity buffer (views, no sync)
        seqlens, seqlens_padded, cu_seqlens, cu_seqlens_padded = (
            seqlens[:n], seqlens_padded[:n], cu_seqlens[: n + 1], cu_seqlens_padded[: n + 1]
        )
    if bad:
        what = "attention_mask values must be 0 or 1" if token_mask is not None else "seqlens must be >= 0"
        raise ValueError(f"{what}; found {bad} offending entries")
    if num_valid_tokens == 0:
        raise ValueError("the batch has zero valid tokens: there is nothing to pack; skip this micro-batch")
    local_length = total_length // ctx.cp_size
    source_rows = num_valid_tokens if source_shape is None else source_shape[0] * source_shape[1]

    # Source row and stream position of the n-th real token (tokens keep their order; sequences are consecutive).
    token_index = torch.arange(num_valid_tokens, device=device)  # [N]
    token_rows = None if rows is None else rows.positions(token_index, contiguous=gapped_rows == 0)  # [N]
    slot_shift = cu_seqlens_padded[:-1] - cu_seqlens[:-1]  # [n] padding before each slot
    token_stream_position = repeat_runs(slot_shift, seqlens, num_valid_tokens).add_(token_index)  # [N]

    # Inverse maps, with ``source_rows`` as the sink value at padding positions.
    stream_source = torch.full((total_length,), source_rows, dtype=torch.long, device=device)
    stream_source.index_copy_(0, token_stream_position, token_index if token_rows is None else token_rows)
    partition = layout.partition(cu_seqlens_padded, total_length, ctx.cp_size)  # [cp, T_local]
    rank_major_source = (
        stream_source if layout.keeps_stream_order(ctx.cp_size) else stream_source.index_select(0, partition.view(-1))
    )
    local_source = rank_major_source.narrow(0, ctx.cp_rank * local_length, local_length)
    local_valid_mask = local_source != source_rows

    return PackPlan(
        ctx=ctx,
        layout=layout,
        alignment=alignment,
        batch_size=seqlens.numel(),
        source_shape=source_shape,
        seqlens=seqlens.int(),
        seqlens_padded=seqlens_padded.int(),
        cu_seqlens=cu_seqlens.int(),
        cu_seqlens_padded=cu_seqlens_padded.int(),
        max_seqlen=max_seqlen,
        max_seqlen_padded=max_seqlen_padded,
        num_valid_tokens=num_valid_tokens,
        total_length=total_length,
        local_length=local_length,
        local_index=partition[ctx.cp_rank],
        local_valid_mask=local_valid_mask,
        local_source=torch.where(local_valid_mask, local_source, 0),
        stream_source=stream_source,
        rank_major_source=rank_major_source,
        token_rows=token_rows,
    )
