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

Cost: building a plan makes one device->host read (``core.host.read_to_host``: per-sequence lengths and
where each sequence starts, with the value checks); the per-sequence arithmetic then runs on the host with
numpy and only run tables travel back. No Python loop over sequences. The mask is scanned as 8-byte words
(by numpy on a CPU mask's memory, see ``_MaskRows``). ``pack`` copies windows of up to 32 consecutive source rows
per index entry (``core.blocks``: one ``index_select`` over an overlapping strided view, then the few positions
the windows get wrong, then zeros where there is no token), so it never builds a per-position index; its tables
are expanded on the host and sent in one copy. ``unpack`` is the same block copy the other way: one all-gather
into the rank-major stream followed by a block of zero rows, then the source rows in source order, each
sequence's chunks copied from where the layout put them and the gaps between them (padding) from the zero block.
"""

from __future__ import annotations

from collections.abc import Sequence
import dataclasses
import functools
import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np
import torch

from verl_cppack.collectives.gather import GradientContract, all_gather_rank_major
from verl_cppack.context import ParallelContext
from verl_cppack.core import host
from verl_cppack.core.alignment import Alignment
from verl_cppack.core.blocks import BlockGather, block_copy
from verl_cppack.core.checks import (
    MAX_STREAM_POSITIONS,
    require_context,
    require_jagged,
    require_stream_int,
    require_tensor,
)
from verl_cppack.core.layouts import Layout, LayoutName, Runs, get_layout
from verl_cppack.core.runs import linear_runs, repeat_runs, run_offsets, run_starts

# The most rows ``pack`` copies per index entry (``core.blocks``): 32 makes the index 32 times shorter than one
# entry per position and a byte-sized source (label masks) ~5x faster to copy; 64 gains little more on int64 rows.
MAX_COPY_BLOCK = 32
# Below this many local positions ``pack`` gathers row by row with a per-position index instead: the index is
# cheap to expand there, and the block copy's fixed cost (a few more small ops per pack) would dominate.
MIN_BLOCK_COPY_POSITIONS = 1 << 14


@dataclass(frozen=True)
class SequenceTables:
    """Per-sequence numbers of a plan on the host (numpy int64), read back in the plan's one sync."""

    seqlens: np.ndarray  # [n] real tokens per sequence
    seqlens_padded: np.ndarray  # [n] slot lengths
    cu_seqlens: np.ndarray  # [n+1]
    cu_seqlens_padded: np.ndarray  # [n+1]
    sequence_start: np.ndarray  # [n] token-space row of each sequence's first token


@dataclass(frozen=True, eq=False)
class PackPlan:
    """Offsets and indices of one packed micro-batch for one CP rank (see the module docstring).

    Where the tokens come from is kept per sequence (``tables``): sequence ``i``'s ``k``-th real token is
    token-space row ``sequence_start[i] + k``, and token-space rows are source rows (``token_rows`` is
    ``None``) or are looked up in ``token_rows``. Every per-position index (``local_source``,
    ``local_index``, ...) is expanded on the device from those host tables and the layout's runs the first
    time it is asked for, then kept.
    """

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
    tables: SequenceTables  # the per-sequence numbers above (and where each sequence's tokens start), on the host
    token_rows: torch.Tensor | None  # [N] int64 source row of each token in stream order; None: token space = source
    _local_packings: dict = field(default_factory=dict, init=False, repr=False)  # (shift, wrap) -> _LocalPacking
    _copy_backs: dict = field(default_factory=dict, init=False, repr=False)  # token space? -> BlockGather
    _packed_seq_params_arguments: dict = field(default_factory=dict, init=False, repr=False)  # (real?, class) -> (cls, kwargs)

    @property
    def source_rows(self) -> int:
        """Rows of the flattened source: ``B * S`` for a padded source, ``N`` for a jagged one."""
        return self.num_valid_tokens if self.source_shape is None else self.source_shape[0] * self.source_shape[1]

    @property
    def has_padding(self) -> bool:
        """Whether the stream holds padding positions (``T > N``)."""
        return self.total_length > self.num_valid_tokens

    @property
    def device(self) -> torch.device:
        return self.cu_seqlens_padded.device

    # ------------------------------------------------------- per-position indices
    @cached_property
    def local_runs(self) -> Runs:
        """This rank's local stream as runs of slot pieces (the layout's cut), host tables."""
        return self.layout.runs(self.tables.cu_seqlens_padded, self.ctx.cp_size, [self.ctx.cp_rank])

    @cached_property
    def local_index(self) -> torch.Tensor:
        """[T_local] int64 global stream position of each local position."""
        return self.local_runs.stream_positions(self.tables.cu_seqlens_padded, self.device)

    @cached_property
    def local_slot(self) -> torch.Tensor:
        """[T_local] int64 sequence owning each local position."""
        runs = self.local_runs
        slots = runs.flat(runs.per_slot(np.arange(self.batch_size)))
        return repeat_runs(slots, runs.flat(runs.length), runs.total, self.device)

    @cached_property
    def local_position_ids(self) -> torch.Tensor:
        """[T_local] int64 offset inside the slot: restarts at 0 for every sequence (padding continues the count)."""
        runs = self.local_runs
        return linear_runs(runs.flat(runs.offset), runs.flat(runs.length), runs.total, self.device)

    @cached_property
    def local_source(self) -> torch.Tensor:
        """[T_local] source row of each local position (an arbitrary in-range row at padding): int32 when the
        source has fewer than 2**31 rows, else int64. ``pack`` itself copies blocks of rows (``_local_packing``)."""
        return self._block_copy(self._pieces(self.local_runs), 1).gather.windows

    @property
    def local_valid_mask(self) -> torch.Tensor:
        """[T_local] bool, True at real tokens."""
        return self.target_mask(0)[0]

    @cached_property
    def stream_source(self) -> torch.Tensor:
        """[T] int64 source row of each stream position; distinct rows ``>= source_rows`` at padding."""
        pieces = self._pieces(Runs.whole_slots(self.tables.cu_seqlens_padded))
        sink = self.num_valid_tokens if self.token_rows is not None else self.source_rows  # past the token space
        values = pieces.expand(sink + run_starts(np.where(pieces.has_target, 0, pieces.length)), self.device)
        if self.token_rows is not None:  # token index -> source row; the sinks go past the source rows
            num_sinks = self.total_length - self.num_valid_tokens
            sinks = torch.arange(self.source_rows, self.source_rows + num_sinks, device=self.device)
            values = torch.cat([self.token_rows, sinks]).index_select(0, values)
        return values

    def _all_ranks_runs(self) -> Runs:
        return self.layout.runs(self.tables.cu_seqlens_padded, self.ctx.cp_size, range(self.ctx.cp_size))

    def _local_packing(self, shift: int, wrap: bool) -> "_LocalPacking":
        """How ``pack(x, shift, wrap)`` reads this rank's positions; built once per (shift, wrap)."""
        key = (shift, wrap and shift > 0)
        if key not in self._local_packings:
            pieces = self._pieces(self.local_runs, shift=shift, wrap=key[1])
            whole_blocks = (
                self.token_rows is None
                and self.source_rows >= MAX_COPY_BLOCK
                and self.local_length >= MIN_BLOCK_COPY_POSITIONS
            )
            self._local_packings[key] = self._block_copy(pieces, _copy_block(pieces) if whole_blocks else 1)
        return self._local_packings[key]

    def _block_copy(self, pieces: "_Pieces", block: int) -> "_LocalPacking":
        """``pieces`` copied in windows of ``block`` rows (``core.blocks``); with ``block=1`` the windows are the
        source row of each position (looked up in ``token_rows`` when it is set)."""
        rows = self.num_valid_tokens if self.token_rows is not None else self.source_rows  # token space
        dtype = torch.int32 if self.source_rows < 2**31 else torch.long
        gather = block_copy(pieces.first, pieces.length, pieces.has_target, block, rows, self.device, dtype)
        if self.token_rows is not None:
            gather = dataclasses.replace(gather, windows=self.token_rows.index_select(0, gather.windows).to(dtype))
        return _LocalPacking(gather, pieces)

    def _pieces(self, runs: Runs, *, shift: int = 0, wrap: bool = False, token_order: bool = False) -> "_Pieces":
        """Split ``runs`` (host arithmetic) into pieces that count up by one: targets ``shift`` places ahead in
        the same sequence, targets wrapped round inside it (``wrap`` only), then positions without a target
        (past the sequence end, or padding). Values are source rows, or token indices with ``token_order`` or
        when the tokens are looked up in ``token_rows``."""
        tables = self.tables  # sequence_start is in token space already when token_rows is set
        first_token = runs.per_slot(tables.cu_seqlens[:-1] if token_order else tables.sequence_start)
        offset, length = runs.offset, runs.length
        seqlen = runs.per_slot(tables.seqlens)
        shift_ = shift % np.maximum(seqlen, 1) if wrap else shift  # per slot, or an int
        ahead = np.minimum(np.maximum(seqlen - shift_ - offset, 0), length)  # target o + shift < seqlen
        firsts, lengths, used = [first_token + offset + shift_], [ahead], ahead
        if wrap:
            used = np.minimum(np.maximum(seqlen - offset, 0), length)  # every real token of the run
            firsts.append(first_token + offset + ahead + shift_ - seqlen)  # target o + shift - seqlen
            lengths.append(used - ahead)
        firsts.append(np.zeros_like(offset))
        lengths.append(length - used)
        shape = (*offset.shape, len(firsts))  # the pieces of each run, in order
        first, piece_length = np.empty(shape, np.int64), np.empty(shape, np.int64)
        for piece, (piece_first, piece_len) in enumerate(zip(firsts, lengths)):
            first[..., piece], piece_length[..., piece] = piece_first, piece_len
        has_target = np.arange(first.size) % len(firsts) != len(firsts) - 1  # the last piece of each run has none
        return _Pieces(first.reshape(-1), piece_length.reshape(-1), has_target, runs.total)

    # ------------------------------------------------------------------ pack
    def pack(self, x: torch.Tensor, *, shift: int = 0, wrap: bool = False, name: str = "x") -> torch.Tensor:
        """``x`` (``[B, S, *]`` or jagged ``[B, j, *]``, any dtype) -> ``[1, T_local, *]``, zeros at padding.

        ``shift=k`` packs, at each position, the token ``k`` places later *in the same sequence* (labels
        for ``k=1``, multi-token-prediction targets for ``k>1``), taken on the global stream before the CP
        cut; positions whose target lies past the sequence end get zero (see ``target_mask``). With
        ``wrap=True`` the target wraps around inside the sequence instead (verl's ``need_roll``). Every dtype is
        copied as is (those the index kernels lack, e.g. float8, as same-size integers). ``name``: what errors
        call ``x``.
        """
        require_stream_int("shift", shift)
        rows = self._source_rows(x, name)
        return _as_dtype(self._local_packing(shift, wrap).gather.gather(_copyable(rows)), rows.dtype).unsqueeze(0)

    def target_mask(self, shift: int = 1, wrap: bool = False) -> torch.Tensor:
        """``[1, T_local]`` bool: positions whose shifted target (see ``pack``) is a real token."""
        require_stream_int("shift", shift)
        return self._local_packing(shift, wrap).target_flags.unsqueeze(0)

    def _source_rows(self, x: torch.Tensor, name: str) -> torch.Tensor:
        require_tensor(name, x)
        if x.device != self.device:
            raise ValueError(f"{name} is on {x.device} but the plan was built on {self.device}; move one")
        if self.source_shape is None:
            if not x.is_nested:
                raise TypeError(f"this plan was built from sequence lengths: pass {name} as a jagged nested tensor")
            x = require_jagged(name, x)
            values = x.values()
            if x.size(0) != self.batch_size or values.shape[0] != self.num_valid_tokens:
                raise ValueError(
                    f"nested {name} has {x.size(0)} sequences / {values.shape[0]} tokens, the plan expects "
                    f"{self.batch_size} / {self.num_valid_tokens}; build a plan from this tensor's offsets"
                )
            return values
        if x.is_nested:
            raise TypeError(f"this plan was built from a [B, S] batch: pass {name} as a padded [B, S, *] tensor")
        if x.dim() < 2 or tuple(x.shape[:2]) != self.source_shape:
            raise ValueError(
                f"{name} must have shape [B, S, *] = [{self.source_shape[0]}, {self.source_shape[1]}, *] like the "
                f"batch the plan was built from, got {tuple(x.shape)}"
            )
        return x.reshape(self.source_rows, *x.shape[2:])

    # ---------------------------------------------------------------- unpack
    def unpack(self, y_local: torch.Tensor, *, gradient: GradientContract = "local", name: str = "y_local") -> torch.Tensor:
        """This rank's ``[1, T_local, *]`` output -> the full batch on every CP rank.

        Padded-source plans return ``[B, S, *]``, jagged-source plans a jagged nested tensor. Padding is
        zero, the dtype is kept. The all-gather runs over ``ctx.cp_group``; with ``gradient="local"``
        (verl's contract) only this rank's chunk receives gradient, see ``all_gather_rank_major``. Every dtype is
        copied as is, as in ``pack``. ``name``: what errors call ``y_local``.
        """
        local = self._check_local(y_local, name)
        rows = self._gather_back(_copyable(local), gradient, token_order=False)
        return self._to_source_layout(_as_dtype(rows, local.dtype))

    def restore(self, local_outputs: Sequence[torch.Tensor]) -> torch.Tensor:
        """Pure, no process group: every rank's ``[1, T_local, *]`` output (rank order) -> what ``unpack`` returns."""
        if isinstance(local_outputs, torch.Tensor) or not isinstance(local_outputs, Sequence):
            raise TypeError(
                f"restore takes a list of every CP rank's [1, T_local, *] output ({self.ctx.cp_size} tensors, rank "
                f"order), got {type(local_outputs).__name__}; for this rank's output alone use unpack"
            )
        if len(local_outputs) != self.ctx.cp_size:
            raise ValueError(f"restore needs one local output per CP rank ({self.ctx.cp_size}), got {len(local_outputs)}")
        outputs = [self._check_local(y, f"local_outputs[{rank}]") for rank, y in enumerate(local_outputs)]
        if len({(y.dtype, y.shape[1:]) for y in outputs}) > 1:
            raise ValueError("every rank's local output must have the same dtype and trailing dimensions")
        copyable = [_copyable(y) for y in outputs]
        zeros = copyable[0].new_zeros((self._copy_back_tables(token_order=False).block, *outputs[0].shape[1:]))
        rows = self._copy_back(torch.cat([*copyable, zeros]), token_order=False)
        return self._to_source_layout(_as_dtype(rows, outputs[0].dtype))

    def unpack_nested(
        self, y_local: torch.Tensor, *, gradient: GradientContract = "local", name: str = "y_local"
    ) -> torch.Tensor:
        """Like ``unpack`` but always a jagged nested tensor ``[n, j, *]`` of the real tokens of each sequence."""
        local = self._check_local(y_local, name)
        values = _as_dtype(self._gather_back(_copyable(local), gradient, token_order=True), local.dtype)  # [N, *]
        return torch.nested.nested_tensor_from_jagged(values, offsets=self.cu_seqlens.long())

    def _check_local(self, y_local: torch.Tensor, name: str) -> torch.Tensor:
        require_tensor(name, y_local)
        if y_local.is_nested or y_local.dim() < 2 or y_local.shape[0] != 1 or y_local.shape[1] != self.local_length:
            raise ValueError(
                f"{name} must have shape [1, T_local, *] with T_local={self.local_length} "
                f"(this plan's local length), got {tuple(y_local.shape)}"
            )
        if y_local.device != self.device:
            raise ValueError(f"{name} is on {y_local.device} but the plan was built on {self.device}; move one")
        return y_local[0]

    def _gather_back(self, local: torch.Tensor, gradient: GradientContract, token_order: bool) -> torch.Tensor:
        """This rank's ``[T_local, *]`` -> what ``_copy_back`` returns, all ranks' rows gathered straight into the
        stream and zero block it reads."""
        block = self._copy_back_tables(token_order).block
        stream = all_gather_rank_major(local, self.ctx, gradient, zero_rows=block)  # [T + block, *]
        return self._copy_back(stream, token_order)

    def _copy_back(self, stream: torch.Tensor, token_order: bool) -> torch.Tensor:
        """Rank-major ``[T, *]`` followed by a zero block (``_copy_back_tables``) -> source rows ``[source_rows, *]``
        (``token_order``: the N tokens in stream order), zeros where no token lands."""
        values = self._copy_back_tables(token_order).gather(stream)  # [source_rows or N, *]
        if self.token_rows is not None and not token_order:  # tokens -> their source rows (rows with gaps)
            rows = values.new_zeros((self.source_rows, *values.shape[1:]))
            return rows.index_copy_(0, self.token_rows, values)
        return values

    def _copy_back_tables(self, token_order: bool) -> BlockGather:
        """How ``_copy_back`` reads the stream, built once per space (token space with ``token_order`` or when the
        tokens are looked up in ``token_rows``, else source rows)."""
        token_space = token_order or self.token_rows is not None
        if token_space not in self._copy_backs:
            self._copy_backs[token_space] = self._source_order_copy(token_space)
        return self._copy_backs[token_space]

    def _source_order_copy(self, token_space: bool) -> BlockGather:
        """The rows (or tokens) in their own order as pieces: each chunk of a sequence, read from where the layout
        put it in the rank-major stream, and the gaps around the chunks, which have no target (the blocks they own
        read the zero block after the stream; their few other positions are zeroed)."""
        pieces = self._pieces(self._all_ranks_runs(), token_order=token_space)  # rank-major: [tokens, padding]...
        stream_start = run_starts(pieces.length)  # rank-major position of every piece
        chunks = pieces.has_target & (pieces.length > 0)
        order = np.argsort(pieces.first[chunks], kind="stable")  # chunks are disjoint: sorted = source order
        first, start, length = pieces.first[chunks][order], stream_start[chunks][order], pieces.length[chunks][order]
        rows = self.num_valid_tokens if token_space else self.source_rows
        gaps = np.append(first, rows) - np.concatenate([[0], first + length])  # before each chunk, then after the last
        piece_first, piece_length = np.zeros(2 * first.size + 1, np.int64), np.empty(2 * first.size + 1, np.int64)
        piece_first[1::2], piece_length[1::2], piece_length[0::2] = start, length, gaps
        has_target = np.arange(piece_first.size) % 2 == 1
        source_order = _Pieces(piece_first, piece_length, has_target, rows)
        block = _copy_block(source_order) if rows >= MIN_BLOCK_COPY_POSITIONS else 1
        stream = self.total_length  # the source of the copy: the stream, then ``block`` zero rows
        dtype = torch.int32 if stream + block < 2**31 else torch.long
        return block_copy(piece_first, piece_length, has_target, block, stream + block, self.device, dtype, zero_rows=stream)

    def _to_source_layout(self, rows: torch.Tensor) -> torch.Tensor:
        if self.source_shape is None:
            return torch.nested.nested_tensor_from_jagged(rows, offsets=self.cu_seqlens.long())
        return rows.view(*self.source_shape, *rows.shape[1:])

    # -------------------------------------------------------------- megatron
    def packed_seq_params(self, *, real_seqlens_in_attention: bool = False) -> Any:
        """A new Megatron ``PackedSeqParams`` (THD) for this plan per call; see ``integrations.megatron``."""
        from verl_cppack.integrations.megatron import packed_seq_params_arguments, packed_seq_params_class

        key = (real_seqlens_in_attention, packed_seq_params_class())  # the class as megatron holds it now
        arguments = self._packed_seq_params_arguments.get(key)
        if arguments is None:
            arguments = packed_seq_params_arguments(self, real_seqlens_in_attention=real_seqlens_in_attention)
            self._packed_seq_params_arguments[key] = arguments
        cls, kwargs = arguments
        return cls(**kwargs)


@dataclass(frozen=True)
class _Pieces:
    """Host table of a stream cut into pieces that each count up by one from ``first`` over ``length``
    positions; ``has_target`` marks the pieces whose positions hold a token (the others are filled in)."""

    first: np.ndarray  # [p] int64, meaningful where has_target
    length: np.ndarray  # [p] int64, zero allowed
    has_target: np.ndarray  # [p] bool
    total: int  # length.sum()

    def expand(self, filler_first: np.ndarray | int, device: torch.device) -> torch.Tensor:
        """[total] int64 values; pieces without a target count up from ``filler_first`` instead."""
        first = np.where(self.has_target, self.first, filler_first)
        return linear_runs(first, self.length, self.total, device)


def _copy_block(pieces: _Pieces) -> int:
    """Rows per window for ``pieces``: a piece of ``L`` rows costs about ``L / b`` windows plus ``b / 2`` fix-ups,
    least at ``b = sqrt(2 L)``; a power of two between 2 and ``MAX_COPY_BLOCK`` near that for the mean piece."""
    target_lengths = np.where(pieces.has_target, pieces.length, 0)
    num_pieces = np.count_nonzero(target_lengths)
    mean_length = float(target_lengths.sum()) / num_pieces if num_pieces else 1.0
    return min(max(2 ** round(math.log2(math.sqrt(2 * mean_length))), 2), MAX_COPY_BLOCK)


# dtypes the index kernels (index_copy_, index_fill_) lack are copied as the same-size integer: the bytes move as is.
_COPY_AS_INTEGER = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_INDEXABLE_DTYPES = frozenset(
    {torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16,
     torch.float32, torch.float64, torch.complex32, torch.complex64, torch.complex128}
)


def _copyable(rows: torch.Tensor) -> torch.Tensor:
    """``rows`` itself, or a same-size integer view of it where the index kernels lack its dtype (float8, uint16...)."""
    if rows.dtype in _INDEXABLE_DTYPES:
        return rows
    integer = _COPY_AS_INTEGER.get(rows.dtype.itemsize)
    if integer is None:
        raise TypeError(
            f"cannot pack or unpack dtype {rows.dtype}: supported are every dtype of 1, 2, 4 or 8 bytes and the "
            "complex dtypes"
        )
    return rows.view(integer)


def _as_dtype(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Undo ``_copyable``."""
    return rows if rows.dtype == dtype else rows.view(dtype)


@dataclass(frozen=True)
class _LocalPacking:
    """What ``pack(x, shift, wrap)`` needs on this rank: the copy of its pieces (``core.blocks``), and the pieces."""

    gather: BlockGather
    pieces: _Pieces

    @cached_property
    def target_flags(self) -> torch.Tensor:
        """[T_local] bool, True where the position holds its target."""
        pieces = self.pieces
        device = self.gather.windows.device
        flags = repeat_runs(pieces.has_target.astype(np.int8), pieces.length, pieces.total, device, torch.int8)
        return flags.view(torch.bool)


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

    num_bad_values = None  # a bool mask has no bad values
    if attention_mask.dtype != torch.bool:
        num_bad_values = ((attention_mask != 0) & (attention_mask != 1)).sum()
        attention_mask = attention_mask != 0
    return build_plan(
        ctx, layout_, alignment_, None, (batch_size, seq_len), num_bad_values, mask_rows=_MaskRows(attention_mask)
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
        if not isinstance(seqlens, Sequence) or not all(isinstance(n, int) and not isinstance(n, bool) for n in seqlens):
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


class _MaskRows:
    """Where the tokens of a ``[B, S]`` bool mask sit: per-row counts, first and last token column.

    The device computes a few ``[B]`` statistics (``device_stats``, read back in the plan's one sync); the
    host turns them into columns (``extents``). A row whose tokens form one run (rollouts: left-padded
    prompt + right-padded response) is then fully described by its first column and count; rows with gaps
    need the general O(B*S) rank-and-scatter of ``token_positions``.

    When ``S % 8 == 0`` the mask is read as 8-byte words (8 columns each) so the scans run over ``S/8``
    words: the first and last non-zero word of each row, whose bytes the host inspects, and token counts as
    lane-wise word sums (a byte lane counts its column's tokens, below 128 per group of words, so lanes never
    carry) read back as bytes. A CPU mask is scanned by numpy on the mask's own memory (``scan_on_host``: no
    tensor op, nothing to read back; ``argmax`` stops at the first non-zero word), and its counts are the rows'
    spans when one ``count_nonzero`` of the whole mask shows every row is one run (else the same lane sums).
    """

    scan_cpu_masks_on_host = True  # tests turn it off to run the device scan on CPU tensors

    def __init__(self, token_mask: torch.Tensor) -> None:
        self.mask = token_mask.contiguous()  # [B, S] bool
        batch_size, seq_len = self.mask.shape
        self.by_words = seq_len % 8 == 0 and self.mask.storage_offset() % 8 == 0
        self.scan_on_host = self.by_words and self.mask.device.type == "cpu" and self.scan_cpu_masks_on_host
        if self.scan_on_host:
            self.device_stats = ()  # nothing to read back: ``extents`` scans the mask's memory
        elif self.by_words:
            words = self.mask.view(torch.int64)  # [B, W]: word w holds columns 8w .. 8w+7, one byte each
            group = _lane_group(words.shape[1])
            counts = words.view(batch_size, -1, group).sum(dim=2).view(torch.int8).sum(dim=1, dtype=torch.int32)
            occupied = (words != 0).view(torch.int8)  # [B, W]
            last = (words.shape[1] - 1) - occupied.flip(1).argmax(dim=1)
            edges = torch.stack([occupied.argmax(dim=1), last], dim=1)  # [B, 2] first/last non-zero word
            self.device_stats = (counts, edges, words.gather(1, edges))  # [B], [B, 2], their words
        else:
            as_int8 = self.mask.view(torch.int8)
            first = as_int8.argmax(dim=1)
            last = (seq_len - 1) - as_int8.flip(1).argmax(dim=1)
            self.device_stats = (as_int8.sum(dim=1, dtype=torch.int32), torch.stack([first, last], 1))

    def extents(self, host_stats: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The read-back ``device_stats`` -> (tokens, first token column, last token column) per row, [B]
        (an empty row has 0 tokens; its columns are meaningless)."""
        if self.scan_on_host:
            mask_host = self.mask.numpy()  # [B, S] the mask's memory
            words = mask_host.view(np.int64)  # [B, W]
            occupied = words != 0
            edges = np.empty((words.shape[0], 2), np.int64)  # first/last non-zero word of each row
            occupied.argmax(axis=1, out=edges[:, 0])
            np.subtract(words.shape[1] - 1, _reversed_rows(occupied).argmax(axis=1), out=edges[:, 1])
            edge_words = words[np.arange(words.shape[0])[:, None], edges]  # [B, 2]
        elif not self.by_words:
            edges = host_stats[1].reshape(-1, 2)
            return host_stats[0], edges[:, 0], edges[:, 1]
        else:
            edges, edge_words = host_stats[1].reshape(-1, 2), host_stats[2].reshape(-1, 2)
        edge_bytes = edge_words.view(np.uint8).reshape(-1, 2, 8) != 0  # memory order = columns
        first = edges[:, 0] * 8 + edge_bytes[:, 0].argmax(axis=1)
        last = edges[:, 1] * 8 + (7 - edge_bytes[:, 1, ::-1].argmax(axis=1))
        if not self.scan_on_host:
            return host_stats[0], first, last
        # A row's span (first to last token) is at least its token count, equal only if it is one run: when the
        # spans add up to the mask's token count every row is one run and the spans are the counts.
        spans = np.where(edge_words[:, 0] != 0, last - first + 1, 0)
        if spans.sum() == np.count_nonzero(mask_host):
            return spans, first, last
        return self._word_counts_on_host(words), first, last

    @staticmethod
    def _word_counts_on_host(words: np.ndarray) -> np.ndarray:
        """Tokens per row of a ``[B, W]`` word view of the mask: lane sums of groups of words, then of the lanes."""
        return words.reshape(words.shape[0], -1, _lane_group(words.shape[1])).sum(axis=2).view(np.int8).sum(axis=1)

    def token_positions(self, num_tokens: int) -> torch.Tensor:
        """[N] flat ``b * S + s`` of the n-th token in row-major order (any mask)."""
        flat = self.mask.reshape(-1)
        rank = torch.where(flat, torch.cumsum(flat, 0) - 1, num_tokens)  # [B*S], non-tokens to a sink
        positions = torch.empty(num_tokens + 1, dtype=torch.long, device=flat.device)
        return positions.index_copy_(0, rank, torch.arange(flat.numel(), device=flat.device))[:num_tokens]


def _reversed_rows(flags: np.ndarray) -> np.ndarray:
    """``flags[:, ::-1]`` as a contiguous copy; rows of whole 8-byte groups are reversed group by group with the
    bytes of each group swapped (numpy copies reversed bytes one at a time, 8-byte groups ~3x faster)."""
    if flags.shape[1] % 8:
        return np.ascontiguousarray(flags[:, ::-1])
    return flags.view(np.uint64)[:, ::-1].byteswap().view(bool)


def _check_longest(longest: int) -> None:
    if longest >= MAX_STREAM_POSITIONS:
        raise ValueError(
            f"a sequence of {longest} tokens cannot be packed: THD offsets are int32 (every stream < 2**31 positions); "
            "split the sequence or the batch"
        )


@functools.lru_cache(maxsize=64)
def _lane_group(num_words: int) -> int:
    """The most words (a divisor of ``num_words``, at most 127) whose byte-lane sums stay below 128."""
    return max(d for d in range(1, min(num_words, 127) + 1) if num_words % d == 0)


def build_plan(
    ctx: ParallelContext,
    layout: Layout,
    alignment: Alignment,
    seqlens: torch.Tensor | None,  # [n] any integer dtype: tokens of each sequence, in stream order; None: one per mask row
    source_shape: tuple[int, int] | None,  # (B, S) of a padded source; None for a jagged source
    num_bad_values: torch.Tensor | None,  # [] count of invalid input values, reported after the sync; None: none possible
    *,
    mask_rows: _MaskRows | None = None,  # the token mask of a padded source whose rows are the sequences
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
