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
sequences, and O(source rows + T) device work; ``pack`` is one ``index_select`` and one
``masked_fill``; ``unpack`` is one all-gather, one ``index_select`` and one ``masked_fill``.
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


@dataclass(frozen=True, eq=False)
class PackPlan:
    """Offsets and indices of one packed micro-batch for one CP rank (see the module docstring)."""

    ctx: ParallelContext
    layout: Layout
    alignment: Alignment
    batch_size: int  # B: number of sequences (slots)
    seq_len: int | None  # S of a padded [B, S] source; None for a jagged source
    seqlens: torch.Tensor  # [B] int32 real tokens per sequence
    seqlens_padded: torch.Tensor  # [B] int32 slot lengths
    cu_seqlens: torch.Tensor  # [B+1] int32, global
    cu_seqlens_padded: torch.Tensor  # [B+1] int32, global
    max_seqlen: int  # longest real sequence
    max_seqlen_padded: int  # longest slot
    num_valid_tokens: int  # N = cu_seqlens[-1]
    total_length: int  # T = cu_seqlens_padded[-1]
    local_length: int  # T / cp_size
    local_index: torch.Tensor  # [T_local] int64 stream position of each local position
    local_valid_mask: torch.Tensor  # [T_local] bool, True at real tokens
    local_position_ids: torch.Tensor  # [T_local] int64 offset inside the slot (restarts per sequence)
    local_source: torch.Tensor  # [T_local] int64 source row of each local position (0 at padding)
    gather_index: torch.Tensor  # [source rows] int64 rank-major position of each source row (0 if invalid)
    source_valid_mask: torch.Tensor | None  # [B*S] bool for a padded source; None for jagged (all valid)
    stream_source: torch.Tensor  # [T] int64 source row of each stream position, -1 at padding
    rank_major_position: torch.Tensor  # [T] int64 where each stream position lands after the all-gather
    local_slot: torch.Tensor  # [T_local] int64 sequence owning each local position

    # ------------------------------------------------------------------ pack
    def pack(self, x: torch.Tensor, *, shift: int = 0, wrap: bool = False) -> torch.Tensor:
        """``x`` (``[B, S, *]`` or jagged ``[B, j, *]``, any dtype) -> ``[1, T_local, *]``, zeros at padding.

        ``shift=k`` packs, at each position, the token ``k`` places later *in the same sequence* (labels
        for ``k=1``, multi-token-prediction targets for ``k>1``), taken on the global stream before the CP
        cut; positions whose target lies past the sequence end get zero (see ``target_mask``). With
        ``wrap=True`` the target wraps around inside the sequence instead (verl's ``need_roll``).
        """
        rows = self._source_rows(x)
        source, valid = self._shifted_source(shift, wrap)
        packed = rows.index_select(0, source)  # [T_local, *]
        packed = packed.masked_fill(~valid.view(-1, *([1] * (packed.dim() - 1))), 0)
        return packed.unsqueeze(0)

    def target_mask(self, shift: int = 1, wrap: bool = False) -> torch.Tensor:
        """``[1, T_local]`` bool: positions whose shifted target (see ``pack``) is a real token."""
        return self._shifted_source(shift, wrap)[1].unsqueeze(0)

    def _shifted_source(self, shift: int, wrap: bool) -> tuple[torch.Tensor, torch.Tensor]:
        require_int("shift", shift, minimum=0)
        if shift == 0:
            return self.local_source, self.local_valid_mask
        seqlens = self.seqlens.long()[self.local_slot]  # [T_local]
        target = self.local_position_ids + shift  # [T_local] target offset inside the slot
        if wrap:
            target = target % seqlens.clamp(min=1)  # the clamp only touches empty slots, which hold no token
            valid = self.local_valid_mask
        else:
            valid = self.local_valid_mask & (target < seqlens)
        stream_position = self.cu_seqlens_padded.long()[self.local_slot] + target
        source = self.stream_source.index_select(0, torch.where(valid, stream_position, 0))
        return source.clamp(min=0), valid

    def _source_rows(self, x: torch.Tensor) -> torch.Tensor:
        require_tensor("x", x)
        if x.device != self.local_index.device:
            raise ValueError(f"x is on {x.device} but the plan was built on {self.local_index.device}; move one")
        if self.seq_len is None:
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
            raise TypeError("this plan was built from a [B, S] attention mask: pass a padded [B, S, *] tensor")
        if x.dim() < 2 or tuple(x.shape[:2]) != (self.batch_size, self.seq_len):
            raise ValueError(
                f"x must have shape [B, S, *] = [{self.batch_size}, {self.seq_len}, *] like the attention mask, "
                f"got {tuple(x.shape)}"
            )
        return x.reshape(self.batch_size * self.seq_len, *x.shape[2:])

    # ---------------------------------------------------------------- unpack
    def unpack(self, y_local: torch.Tensor, *, gradient: GradientContract = "local") -> torch.Tensor:
        """This rank's ``[1, T_local, *]`` output -> the full batch on every CP rank.

        Padded-source plans return ``[B, S, *]``, jagged-source plans a jagged nested tensor. Padding is
        zero, the dtype is kept. The all-gather runs over ``ctx.cp_group``; with ``gradient="local"``
        (verl's contract) only this rank's chunk receives gradient, see ``all_gather_rank_major``.
        """
        local = self._check_local(y_local)
        return self._scatter_back(all_gather_rank_major(local, self.ctx, gradient))

    def restore(self, local_outputs: Sequence[torch.Tensor]) -> torch.Tensor:
        """Pure, no process group: every rank's ``[1, T_local, *]`` output (rank order) -> what ``unpack`` returns."""
        if len(local_outputs) != self.ctx.cp_size:
            raise ValueError(f"restore needs one local output per CP rank ({self.ctx.cp_size}), got {len(local_outputs)}")
        return self._scatter_back(torch.cat([self._check_local(y) for y in local_outputs]))

    def unpack_nested(self, y_local: torch.Tensor, *, gradient: GradientContract = "local") -> torch.Tensor:
        """Like ``unpack`` but always returns a jagged nested tensor ``[B, j, *]`` of the real tokens."""
        gathered = all_gather_rank_major(self._check_local(y_local), self.ctx, gradient)
        return torch.nested.nested_tensor_from_jagged(
            gathered.index_select(0, self.valid_gather_index), offsets=self.cu_seqlens.long()
        )

    @cached_property
    def valid_gather_index(self) -> torch.Tensor:
        """[N] int64 rank-major position of each real token, sequences in order."""
        if self.source_valid_mask is None:
            return self.gather_index
        sequence = torch.repeat_interleave(
            torch.arange(self.batch_size, device=self.seqlens.device), self.seqlens.long(), output_size=self.num_valid_tokens
        )
        offset = torch.arange(self.num_valid_tokens, device=sequence.device) - self.cu_seqlens.long()[sequence]
        return self.rank_major_position.index_select(0, self.cu_seqlens_padded.long()[sequence] + offset)

    def _check_local(self, y_local: torch.Tensor) -> torch.Tensor:
        require_tensor("y_local", y_local)
        if y_local.is_nested or y_local.dim() < 2 or y_local.shape[0] != 1 or y_local.shape[1] != self.local_length:
            raise ValueError(
                f"local output must have shape [1, T_local, *] with T_local={self.local_length} "
                f"(this plan's local length), got {tuple(y_local.shape)}"
            )
        return y_local[0]

    def _scatter_back(self, gathered: torch.Tensor) -> torch.Tensor:
        rows = gathered.index_select(0, self.gather_index)  # [source rows, *]
        if self.source_valid_mask is None:
            return torch.nested.nested_tensor_from_jagged(rows, offsets=self.cu_seqlens.long())
        rows = rows.masked_fill(~self.source_valid_mask.view(-1, *([1] * (rows.dim() - 1))), 0)
        return rows.view(self.batch_size, self.seq_len, *rows.shape[1:])

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
    ctx, layout_, alignment_ = _resolve(ctx, layout, alignment, fp8)

    is_bool = attention_mask.dtype == torch.bool
    num_bad_values = torch.zeros((), dtype=torch.long, device=attention_mask.device)
    if not is_bool:
        num_bad_values = ((attention_mask != 0) & (attention_mask != 1)).sum()
    valid = attention_mask if is_bool else attention_mask != 0  # [B, S]
    seqlens = valid.sum(dim=1)  # [B]
    sequence_of_row = torch.where(valid, torch.arange(batch_size, device=valid.device).unsqueeze(1), -1).view(-1)
    return _build(ctx, layout_, alignment_, seqlens, seq_len, sequence_of_row, num_bad_values)


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
    ctx, layout_, alignment_ = _resolve(ctx, layout, alignment, fp8)
    return _build(ctx, layout_, alignment_, seqlens, None, None, (seqlens < 0).sum())


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


def _resolve(
    ctx: ParallelContext | None, layout: LayoutName | Layout, alignment: Alignment | int | None, fp8: bool
) -> tuple[ParallelContext, Layout, Alignment]:
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


def _build(
    ctx: ParallelContext,
    layout: Layout,
    alignment: Alignment,
    seqlens: torch.Tensor,  # [B] any integer dtype
    seq_len: int | None,
    sequence_of_row: torch.Tensor | None,  # [B*S] sequence owning each source row, -1 if padding; None = jagged
    num_bad_values: torch.Tensor,  # [] count of invalid input values (reported after the sync)
) -> PackPlan:
    device = seqlens.device
    seqlens = seqlens.long()
    seqlens_padded = alignment.pad(seqlens)  # [B]
    cu_seqlens, cu_seqlens_padded = _cumsum0(seqlens), _cumsum0(seqlens_padded)  # [B+1]

    # The one device->host sync of the plan: sizes to allocate, and the value checks.
    total_length, num_valid_tokens, max_seqlen, max_seqlen_padded, bad = torch.stack(
        [cu_seqlens_padded[-1], cu_seqlens[-1], seqlens.max(), seqlens_padded.max(), num_bad_values.long()]
    ).tolist()
    if bad:
        what = "attention_mask values must be 0 or 1" if sequence_of_row is not None else "seqlens must be >= 0"
        raise ValueError(f"{what}; found {bad} offending entries")
    if num_valid_tokens == 0:
        raise ValueError("the batch has zero valid tokens: there is nothing to pack; skip this micro-batch")
    local_length = total_length // ctx.cp_size

    # Stream position of every source row (padding rows go to a sink at T).
    if sequence_of_row is None:  # jagged: all rows valid, sequences in order
        sequence_of_row = torch.repeat_interleave(
            torch.arange(seqlens.numel(), device=device), seqlens, output_size=num_valid_tokens
        )
        row_is_token = None
    else:
        row_is_token = sequence_of_row >= 0
    sequence = sequence_of_row.clamp(min=0)
    valid_rank = torch.arange(sequence.numel(), device=device) if row_is_token is None else torch.cumsum(row_is_token, 0) - 1
    stream_position = cu_seqlens_padded[sequence] + valid_rank - cu_seqlens[sequence]  # [rows]
    if row_is_token is not None:
        stream_position = torch.where(row_is_token, stream_position, total_length)

    # Inverse: source row of every stream position (-1 = padding). Only the sink sees duplicate writes.
    stream_source = torch.full((total_length + 1,), -1, dtype=torch.long, device=device)
    stream_source.scatter_(0, stream_position, torch.arange(stream_position.numel(), device=device))
    stream_source = stream_source[:total_length]

    partition = layout.partition(cu_seqlens_padded, total_length, ctx.cp_size)  # [cp, T_local]
    rank_major_position = torch.empty(total_length, dtype=torch.long, device=device)
    rank_major_position[partition.reshape(-1)] = torch.arange(total_length, device=device)
    local_index = partition[ctx.cp_rank]
    local_slot = torch.searchsorted(cu_seqlens_padded, local_index, right=True) - 1
    local_source = stream_source.index_select(0, local_index)
    gather_index = rank_major_position.index_select(0, stream_position.clamp(max=total_length - 1))

    return PackPlan(
        ctx=ctx,
        layout=layout,
        alignment=alignment,
        batch_size=seqlens.numel(),
        seq_len=seq_len,
        seqlens=seqlens.int(),
        seqlens_padded=seqlens_padded.int(),
        cu_seqlens=cu_seqlens.int(),
        cu_seqlens_padded=cu_seqlens_padded.int(),
        max_seqlen=max_seqlen,
        max_seqlen_padded=max_seqlen_padded,
        num_valid_tokens=num_valid_tokens,
        total_length=total_length,
        local_length=local_length,
        local_index=local_index,
        local_valid_mask=local_source >= 0,
        local_position_ids=local_index - cu_seqlens_padded[local_slot],
        local_source=local_source.clamp(min=0),
        gather_index=gather_index,
        source_valid_mask=row_is_token,
        stream_source=stream_source,
        rank_major_position=rank_major_position,
        local_slot=local_slot,
    )
