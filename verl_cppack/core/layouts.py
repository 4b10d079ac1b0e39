"""How the padded THD stream is cut across context-parallel ranks.

A layout maps the global padded stream (length ``T``, slots given by ``cu_seqlens_padded``) to
``cp_size`` local streams of ``T / cp_size`` tokens each. It describes each rank's local stream as
``Runs``: parts of slots (a slot, offsets ``[offset, offset + length)`` inside it) in local order. Every
per-position index a plan needs is expanded from these runs on the host (``core.runs``); ``partition`` is the stream
positions themselves, ``[cp_size, T / cp_size]``, whose rows concatenated are a permutation of ``range(T)``.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from verl_cppack.context import ParallelContext
from verl_cppack.core import host
from verl_cppack.core.alignment import Alignment
from verl_cppack.core.checks import check_cu_seqlens_padded, require_int
from verl_cppack.core.runs import count_up, counting

LayoutName = Literal["zigzag", "contiguous"]


@dataclass(frozen=True)
class Runs:
    """Parts of slots laid out one after another (host tables, one entry per run, in layout order): run ``k``
    holds offsets ``[offset[k], offset[k] + length[k])`` of slot ``slot[k]``."""

    slot: np.ndarray  # [k] int64 the slot each run belongs to
    offset: np.ndarray  # [k] int64 offset inside the slot where the run begins
    length: np.ndarray  # [k] int64, zero allowed
    total: int  # length.sum()

    @classmethod
    def whole_slots(cls, cu_seqlens_padded: np.ndarray) -> Runs:
        """The stream itself: one run per slot."""
        slot_lengths = cu_seqlens_padded[1:] - cu_seqlens_padded[:-1]
        n = slot_lengths.size
        return cls(counting(n), np.zeros(n, np.int64), slot_lengths, int(cu_seqlens_padded[-1]))

    def per_run(self, values: np.ndarray) -> np.ndarray:
        """``values`` [n] per slot -> [k], the value of each run's slot."""
        return values[self.slot]

    def stream_positions(self, cu_seqlens_padded: np.ndarray, device: torch.device) -> torch.Tensor:
        """[total] int64 global stream position of each position of the runs."""
        first = self.per_run(cu_seqlens_padded[:-1]) + self.offset
        return host.to_device(count_up(first, self.length), device)


class Layout(ABC):
    name: str

    def default_alignment(self, ctx: ParallelContext, fp8: bool = False) -> Alignment:
        """verl's default: every slot a multiple of ``TP*CP*2`` when CP>1, else ``TP`` (FP8: verl's FP8 policy).

        Shared by every layout so switching layouts never changes the stream.
        """
        base = ctx.default_slot_multiple
        return Alignment.fp8(base) if fp8 else Alignment.per_slot(base)

    @abstractmethod
    def check_alignment(self, alignment: Alignment, ctx: ParallelContext) -> None:
        """Raise ``ValueError`` if streams padded with ``alignment`` cannot be cut for ``ctx``."""

    @abstractmethod
    def runs(self, cu_seqlens_padded: np.ndarray, cp_size: int, ranks: Sequence[int]) -> Runs:
        """The local streams of ``ranks`` (in that order) as runs; ``cu_seqlens_padded`` [n+1] int64 host
        offsets, assumed valid."""

    def partition(self, cu_seqlens_padded: torch.Tensor, cp_size: int) -> torch.Tensor:
        """All ranks' local indices, ``[cp_size, T // cp_size]`` int64 on the offsets' device (``T`` =
        ``cu_seqlens_padded[-1]``; inputs assumed valid; reads the offsets to the host)."""
        (cu,) = host.read_to_host(cu_seqlens_padded)
        runs = self.runs(cu, cp_size, range(cp_size))
        return runs.stream_positions(cu, cu_seqlens_padded.device).view(cp_size, -1)

    def _check_tp(self, alignment: Alignment, ctx: ParallelContext) -> None:
        needed = ctx.cp_size * ctx.tp_size
        if alignment.stream_multiple % needed:
            raise ValueError(
                f"{self.name} layout: the stream total must be a multiple of cp_size * tp_size = {needed} so "
                f"every CP rank holds a whole number of tokens divisible by tp_size; got stream_multiple="
                f"{alignment.stream_multiple}. Use a multiple of {needed}."
            )


_FRONT_BACK = np.array([0, 1], np.int64)  # a rank's two zigzag chunks: the front one, then the back one


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

    def runs(self, cu_seqlens_padded: np.ndarray, cp_size: int, ranks: Sequence[int]) -> Runs:
        if cp_size == 1:
            return Runs.whole_slots(cu_seqlens_padded)
        # Rank r holds, for every slot, its front chunk r then its back chunk 2*CP-1-r: runs [R, n, 2] in that order.
        chunk = (cu_seqlens_padded[1:] - cu_seqlens_padded[:-1]) // (2 * cp_size)  # [n] chunk length of each slot
        slot, chunk_id = _zigzag_pattern(cp_size, tuple(ranks), chunk.size)
        length = chunk[slot]
        return Runs(
            slot=slot,
            offset=(chunk_id * length.reshape(len(chunk_id), chunk.size, 2)).reshape(-1),
            length=length,
            total=len(chunk_id) * (int(cu_seqlens_padded[-1]) // cp_size),
        )


@functools.lru_cache(maxsize=32)
def _zigzag_pattern(cp_size: int, ranks: tuple[int, ...], slots: int) -> tuple[np.ndarray, np.ndarray]:
    """``(slot [R*n*2], chunk_id [R, 1, 2])`` of the zigzag runs of ``ranks`` over ``slots`` slots, read-only: what
    depends on the batch size alone, made once per size (micro-batches of one size share it)."""
    rank = np.asarray(ranks, np.int64).reshape(-1, 1, 1)  # [R, 1, 1]
    chunk_id = rank + _FRONT_BACK * (2 * cp_size - 1 - 2 * rank)  # [R, 1, 2]: r, then 2*CP-1-r
    slot = counting(chunk_id.size * slots) // 2 % max(slots, 1)  # [R*n*2]
    slot.flags.writeable = chunk_id.flags.writeable = False
    return slot, chunk_id


class ContiguousLayout(Layout):
    """Ulysses / llama3-style: rank r holds ``[r*T/CP, (r+1)*T/CP)`` of the padded stream."""

    name = "contiguous"

    def check_alignment(self, alignment: Alignment, ctx: ParallelContext) -> None:
        self._check_tp(alignment, ctx)

    def runs(self, cu_seqlens_padded: np.ndarray, cp_size: int, ranks: Sequence[int]) -> Runs:
        # Rank r holds [r*L, (r+1)*L) of the stream (L = T / CP): every slot clipped to that window, runs [R, n].
        local_length = int(cu_seqlens_padded[-1]) // cp_size
        window_start = np.array([r * local_length for r in ranks]).reshape(-1, 1)  # [R, 1]
        start = np.maximum(cu_seqlens_padded[:-1], window_start)  # [R, n]
        end = np.minimum(cu_seqlens_padded[1:], window_start + local_length)  # [R, n]
        return Runs(
            slot=np.broadcast_to(np.arange(start.shape[1]), start.shape).reshape(-1),
            offset=(start - cu_seqlens_padded[:-1]).reshape(-1),
            length=np.maximum(end - start, 0).reshape(-1),
            total=len(window_start) * local_length,
        )


_LAYOUTS: dict[str, Layout] = {"zigzag": ZigzagLayout(), "contiguous": ContiguousLayout()}


def get_layout(layout: LayoutName | Layout) -> Layout:
    if isinstance(layout, Layout):
        return layout
    if not isinstance(layout, str):
        raise TypeError(
            f"layout must be one of {sorted(_LAYOUTS)} (a str) or a Layout, got {type(layout).__name__} ({layout!r})"
        )
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
    cu, _ = check_cu_seqlens_padded(cu_seqlens_padded, slot_divisor=2 * cp_size)
    (cu_host,) = host.read_to_host(cu)
    return ZigzagLayout().runs(cu_host, cp_size, [cp_rank]).stream_positions(cu_host, cu.device)
