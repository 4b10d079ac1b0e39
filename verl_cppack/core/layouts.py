"""How the padded THD stream is cut across context-parallel ranks.

A layout maps the global padded stream (length ``T``, slots given by ``cu_seqlens_padded``) to
``cp_size`` local streams of ``T / cp_size`` tokens each. ``partition`` returns every rank's local
index at once, ``[cp_size, T / cp_size]``: row ``r`` lists, in local order, the global stream
positions rank ``r`` holds. Rows concatenated are a permutation of ``range(T)``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Literal

import torch

from verl_cppack.context import ParallelContext
from verl_cppack.core.alignment import Alignment
from verl_cppack.core.checks import check_cu_seqlens_padded, require_int
from verl_cppack.core.runs import repeat_runs

LayoutName = Literal["zigzag", "contiguous"]


class Layout(ABC):
    name: str

    def default_alignment(self, ctx: ParallelContext, fp8: bool = False) -> Alignment:
        """verl's default: every slot a multiple of ``TP*CP*2`` when CP>1, else ``TP`` (FP8: verl's FP8 policy).

        Shared by every layout so switching layouts never changes the stream.
        """
        base = ctx.tp_size * ctx.cp_size * 2 if ctx.cp_size > 1 else ctx.tp_size
        return Alignment.fp8(base) if fp8 else Alignment.per_slot(base)

    @abstractmethod
    def check_alignment(self, alignment: Alignment, ctx: ParallelContext) -> None:
        """Raise ``ValueError`` if streams padded with ``alignment`` cannot be cut for ``ctx``."""

    @abstractmethod
    def partition(self, cu_seqlens_padded: torch.Tensor, total_length: int, cp_size: int) -> torch.Tensor:
        """All ranks' local indices, ``[cp_size, total_length // cp_size]`` int64 (inputs assumed valid)."""

    def keeps_stream_order(self, cp_size: int) -> bool:
        """True when the ranks' local streams, concatenated, are the stream itself (no permutation)."""
        return cp_size == 1

    def _check_tp(self, alignment: Alignment, ctx: ParallelContext) -> None:
        needed = ctx.cp_size * ctx.tp_size
        if alignment.stream_multiple % needed:
            raise ValueError(
                f"{self.name} layout: the stream total must be a multiple of cp_size * tp_size = {needed} so "
                f"every CP rank holds a whole number of tokens divisible by tp_size; got stream_multiple="
                f"{alignment.stream_multiple}. Use a multiple of {needed}."
            )


class ZigzagLayout(Layout):
    """Ring / TE "DualChunkSwap": each slot is cut in ``2*CP`` chunks; rank r holds chunk r and chunk 2CP-1-r."""

    name = "zigzag"

    def check_alignment(self, alignment: Alignment, ctx: ParallelContext) -> None:
        if ctx.cp_size > 1 and alignment.slot_multiple % (2 * ctx.cp_size):
            raise ValueError(
                f"zigzag layout cuts every slot into 2 * cp_size = {2 * ctx.cp_size} chunks, so slot_multiple "
                f"must be divisible by {2 * ctx.cp_size}; got {alignment.slot_multiple}. "
                f"Use a multiple of {2 * ctx.cp_size * ctx.tp_size} (or the default alignment)."
            )
        self._check_tp(alignment, ctx)

    def partition(self, cu_seqlens_padded: torch.Tensor, total_length: int, cp_size: int) -> torch.Tensor:
        device = cu_seqlens_padded.device
        if cp_size == 1:
            return torch.arange(total_length, device=device).unsqueeze(0)
        # Every rank's local stream is 2n chunks (front and back chunk of each slot), each a run of
        # consecutive stream positions. Laid out rank after rank, position q of the rank-major order sits
        # in run j at offset q - run_start[j], so its stream position is q + (stream_start[j] - run_start[j]).
        cu = cu_seqlens_padded.long()
        chunk = (cu[1:] - cu[:-1]) // (2 * cp_size)  # [n] chunk length of each slot
        ranks = torch.arange(cp_size, device=device).view(cp_size, 1, 1)  # [cp, 1, 1]
        chunk_id = torch.cat([ranks, 2 * cp_size - 1 - ranks], dim=2)  # [cp, 1, 2] front, back
        stream_start = (cu[:-1].view(1, -1, 1) + chunk_id * chunk.view(1, -1, 1)).reshape(-1)  # [cp*n*2]
        run_lengths = chunk.view(1, -1, 1).expand(cp_size, -1, 2).reshape(-1)  # [cp*n*2]
        run_start = torch.cumsum(run_lengths, 0) - run_lengths  # [cp*n*2] in the rank-major order
        rank_major = repeat_runs(stream_start - run_start, run_lengths, total_length)  # [T]
        return rank_major.add_(torch.arange(total_length, device=device)).view(cp_size, -1)  # [cp, T_local]


class ContiguousLayout(Layout):
    """Ulysses / llama3-style: rank r holds ``[r*T/CP, (r+1)*T/CP)`` of the padded stream."""

    name = "contiguous"

    def check_alignment(self, alignment: Alignment, ctx: ParallelContext) -> None:
        self._check_tp(alignment, ctx)

    def keeps_stream_order(self, cp_size: int) -> bool:
        return True

    def partition(self, cu_seqlens_padded: torch.Tensor, total_length: int, cp_size: int) -> torch.Tensor:
        return torch.arange(total_length, device=cu_seqlens_padded.device).view(cp_size, -1)


_LAYOUTS: dict[str, Layout] = {"zigzag": ZigzagLayout(), "contiguous": ContiguousLayout()}


def get_layout(layout: LayoutName | Layout) -> Layout:
    if isinstance(layout, Layout):
        return layout
    if layout not in _LAYOUTS:
        raise ValueError(f"layout must be one of {sorted(_LAYOUTS)}, got {layout!r}")
    return _LAYOUTS[layout]


def zigzag_indices(cu_seqlens_padded: torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Rank ``cp_rank``'s global stream positions under the zigzag layout, ``[T / cp_size]`` int64.

    Index-for-index identical to ``transformer_engine_torch.thd_get_partitioned_indices(
    cu_seqlens_padded, T, cp_size, cp_rank)`` with ``T = cu_seqlens_padded[-1]``.
    """
    require_int("cp_size", cp_size, minimum=1)
    require_int("cp_rank", cp_rank, minimum=0)
    if cp_rank >= cp_size:
        raise ValueError(f"cp_rank must be < cp_size, got cp_rank={cp_rank}, cp_size={cp_size}")
    cu, total_length = check_cu_seqlens_padded(cu_seqlens_padded, slot_divisor=2 * cp_size)
    return ZigzagLayout().partition(cu, total_length, cp_size)[cp_rank]
