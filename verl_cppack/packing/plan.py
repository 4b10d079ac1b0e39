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

Steps: ``packing.builders`` builds a plan (one device->host read, numpy on the host, no Python loop over sequences),
``packing.indices`` expands the layout's runs into per-position indices, ``packing.copies`` copies.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import torch

from verl_cppack.collectives.gather import GradientContract, gather_stream
from verl_cppack.context import ParallelContext
from verl_cppack.core.alignment import Alignment
from verl_cppack.core.checks import require_jagged, require_stream_int, require_tensor
from verl_cppack.core.host import to_device
from verl_cppack.core.jagged import is_jagged, jagged_from_values, jagged_values
from verl_cppack.core.layouts import Layout, Runs
from verl_cppack.core.runs import count_up
from verl_cppack.packing.copies import RowCopy, RowScatter, as_dtype, communicable, copyable
from verl_cppack.packing.indices import compiled_kernels, pack_index, token_index, with_sinks


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
    ``None``) or are looked up in ``token_rows``. Every per-position index is expanded on the host from those
    tables and the layout's runs the first time it is asked for, sent to the device in one copy, and kept.
    """

    ctx: ParallelContext
    layout: Layout
    alignment: Alignment
    batch_size: int  # number of sequences (slots)
    source_shape: tuple[int, int] | None  # (B, S) of a padded source; None for a jagged source
    cu_seqlens_padded: torch.Tensor  # [n+1] int32, global
    max_seqlen: int  # longest real sequence
    max_seqlen_padded: int  # longest slot
    num_valid_tokens: int  # N = cu_seqlens[-1]
    total_length: int  # T = cu_seqlens_padded[-1]
    local_length: int  # T / cp_size
    tables: SequenceTables  # the per-sequence numbers above (and where each sequence's tokens start), on the host
    token_rows: torch.Tensor | None  # [N] int64 source row of each token in stream order; None: token space = source
    _copies: dict = field(default_factory=dict, init=False, repr=False)  # what each copy reads, built once
    # what integrations derive from the plan once, under keys of their own (Megatron's PackedSeqParams arguments)
    derived: dict = field(default_factory=dict, init=False, repr=False)

    @property
    def source_rows(self) -> int:
        """Rows of the flattened source: ``B * S`` for a padded source, ``N`` for a jagged one."""
        return self.num_valid_tokens if self.source_shape is None else self.source_shape[0] * self.source_shape[1]

    @cached_property
    def device(self) -> torch.device:
        return self.cu_seqlens_padded.device

    @cached_property
    def cu_seqlens(self) -> torch.Tensor:
        """[n+1] int32 global offsets of the real tokens."""
        return to_device(self.tables.cu_seqlens, self.device, torch.int32)

    @cached_property
    def seqlens(self) -> torch.Tensor:
        """[n] int32 real tokens per sequence."""
        return to_device(self.tables.seqlens, self.device, torch.int32)

    @cached_property
    def seqlens_padded(self) -> torch.Tensor:
        """[n] int32 slot lengths."""
        return to_device(self.tables.seqlens_padded, self.device, torch.int32)

    # ------------------------------------------------------- per-position indices
    @cached_property
    def local_runs(self) -> Runs:
        """This rank's local stream as runs of slot parts (the layout's cut), host tables."""
        return self.layout.runs(self.tables.cu_seqlens_padded, self.ctx.cp_size, [self.ctx.cp_rank])

    @cached_property
    def local_index(self) -> torch.Tensor:
        """[T_local] int64 global stream position of each local position."""
        return self.local_runs.stream_positions(self.tables.cu_seqlens_padded, self.device)

    @cached_property
    def local_slot(self) -> torch.Tensor:
        """[T_local] int64 sequence owning each local position."""
        runs = self.local_runs
        return to_device(np.repeat(runs.slot, runs.length), self.device)

    def _local_offsets(self) -> np.ndarray:
        """[T_local] int64 offset of each local position inside its slot (host, a new array each call)."""
        runs = self.local_runs
        return count_up(runs.offset, runs.length)

    @cached_property
    def local_position_ids(self) -> torch.Tensor:
        """[T_local] int64 offset inside the slot: restarts at 0 for every sequence (padding continues the count)."""
        return to_device(self._local_offsets(), self.device)

    @cached_property
    def local_token_positions(self) -> torch.Tensor:
        """[1, T_local] int64 verl's engine position ids: the offset inside the sequence at real tokens, 0 at padding
        — except, under zigzag CP, in each slot's front chunk, whose padding verl numbers with its slot offsets
        (callers that hand it out clone it)."""
        positions = self._local_offsets()
        padding = self._pack_index(0, False)[1]
        if self.layout.name == "zigzag" and self.ctx.cp_size > 1:
            runs = self.local_runs
            front = runs.offset < runs.per_run(self.tables.seqlens_padded) // 2  # [k] the slot's front chunk
            padding = padding[~np.repeat(front, runs.length)[padding]]
        positions[padding] = 0
        return to_device(positions, self.device).view(1, -1)

    @cached_property
    def jagged_offsets(self) -> torch.Tensor:
        """[n+1] int64 offsets of the sequences' real tokens: what jagged outputs are built on (once per plan)."""
        return to_device(self.tables.cu_seqlens.copy(), self.device)

    @property
    def local_valid_mask(self) -> torch.Tensor:
        """[T_local] bool, True at real tokens."""
        return self.target_mask(0)[0]

    @cached_property
    def stream_source(self) -> torch.Tensor:
        """[T] int64 source row of each stream position; distinct rows ``>= source_rows`` at padding."""
        return self._rows_written(self._read_index(Runs.whole_slots(self.tables.cu_seqlens_padded)))

    @property
    def _token_space_rows(self) -> int:
        """Rows the plan's indices read: source rows, or the ``N`` tokens when they are looked up in ``token_rows``."""
        return self.source_rows if self.token_rows is None else self.num_valid_tokens

    def _read_index(self, runs: Runs, shift: int = 0, wrap: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """``packing.indices.pack_index`` of ``runs`` over this plan's token space: ``(index, zero_positions)``."""
        tables = self.tables
        return pack_index(runs, tables.sequence_start, tables.seqlens, self._token_space_rows, shift=shift, wrap=wrap)

    def _rows_written(self, read: tuple[np.ndarray, np.ndarray]) -> torch.Tensor:
        """``_read_index`` at ``shift=0`` as a scatter's index on the device: each position on the source row it
        reads, each padding position on a source row of its own past the last (``packing.indices.with_sinks``)."""
        index, padding = read
        written = to_device(with_sinks(index, padding, self._token_space_rows), self.device)
        if self.token_rows is None:
            return written
        past = torch.arange(self.source_rows, self.source_rows + padding.size, device=self.device)
        return torch.cat([self.token_rows, past]).index_select(0, written)  # token index -> source row

    @cached_property
    def _stream_runs(self) -> Runs:
        """Every rank's local stream as runs, rank 0 first: the rank-major stream an all-gather returns (at CP=1 this
        rank's)."""
        if self.ctx.cp_size == 1:
            return self.local_runs
        return self.layout.runs(self.tables.cu_seqlens_padded, self.ctx.cp_size, range(self.ctx.cp_size))

    @cached_property
    def _stream_read(self) -> tuple[np.ndarray, np.ndarray]:
        """``_read_index`` of the rank-major stream: every rank's ``pack`` at shift 0, which the copy back writes
        back (made once; at CP=1 this rank's stream is the stream)."""
        return self._pack_index(0, False) if self.ctx.cp_size == 1 else self._read_index(self._stream_runs)

    def _pack_index(self, shift: int, wrap: bool) -> tuple[np.ndarray, np.ndarray]:
        """This rank's ``(index, zero_positions)`` for ``pack(x, shift, wrap)`` (host tables), made once per key from
        this rank's runs alone (a builder may have put the unshifted one here: ``packing.compiled``)."""
        key = ("index", shift, wrap and shift > 0)
        if key not in self._copies:
            self._copies[key] = self._read_index(self.local_runs, shift, key[2])
        return self._copies[key]

    def _pack_copy(self, shift: int, wrap: bool) -> RowCopy:
        """What ``pack(x, shift, wrap)`` reads on this rank; built once per (shift, wrap)."""
        key = ("pack", shift, wrap and shift > 0)
        copy = self._copies.get(key)
        if copy is None:
            copy = RowCopy.of(*self._pack_index(shift, wrap), self.device, bool(shift) or self._may_pad)
            if self.token_rows is not None:  # token index -> its source row
                copy = RowCopy(self.token_rows.index_select(0, copy.index), copy.zero_positions)
            self._copies[key] = copy
        return copy

    def _copy_back(self, jagged: bool) -> RowCopy | RowScatter:
        """What the copy back makes of the rank-major stream, built once per kind: the ``N`` tokens in sequence order
        (``jagged``), or the padded source's rows."""
        key = ("unpack", jagged)
        copy = self._copies.get(key)
        if copy is None:
            copy = self._copies[key] = self._token_reads() if jagged else self._row_writes()
        return copy

    def _token_reads(self) -> RowCopy:
        """The tokens read from the rank-major stream where the layout put them: one ``index_select`` of an ``[N]``
        index (a jagged output holds only tokens)."""
        index = token_index(self._stream_runs, self.tables.cu_seqlens[:-1], self.tables.seqlens)
        return RowCopy(to_device(index, self.device), None)

    def _row_writes(self) -> RowScatter:
        """Each position of the rank-major stream written on its source row, into zeros: one scatter of a ``[T]``
        index (a padded output has many more rows than the stream has positions): the row ``pack`` read there."""
        gaps = self.source_rows > self.num_valid_tokens  # a padded source's rows that hold no token stay zero
        sinks = self.total_length - self.num_valid_tokens
        kernels = compiled_kernels()
        if kernels is not None and self.token_rows is None and (self.ctx.cp_size == 1 or self.layout.name == "zigzag"):
            tables = self.tables
            written = kernels.copy_back_index(
                tables.seqlens, tables.seqlens_padded, tables.sequence_start, self.source_rows, self.ctx.cp_size
            )
            written = to_device(written, self.device)
        else:
            written = self._rows_written(self._stream_read)
        return RowScatter(written, self.source_rows, sinks, zeroed=gaps, trim=bool(sinks) or self._may_pad)

    @cached_property
    def _may_pad(self) -> bool:
        """Whether the padding policy can leave positions without a token. A copy's ops follow it, not the batch's
        lengths: the op count of a micro-batch is the same for every batch of one policy."""
        alignment = self.alignment
        lengths = alignment.min_slot_length or alignment.min_stream_length
        return alignment.slot_multiple > 1 or alignment.stream_multiple > 1 or lengths > 0

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
        if shift:
            require_stream_int("shift", shift)
        rows = self._source_rows(x, name)  # [R, *]
        return as_dtype(self._pack_copy(shift, wrap)(copyable(rows)), rows.dtype).unsqueeze(0)

    def target_mask(self, shift: int = 1, wrap: bool = False) -> torch.Tensor:
        """``[1, T_local]`` bool: positions whose shifted target (see ``pack``) is a real token."""
        require_stream_int("shift", shift)
        key = ("targets", shift, wrap and shift > 0)
        if key not in self._copies:
            flags = np.ones(self.local_length, np.bool_)
            flags[self._pack_index(shift, wrap)[1]] = False
            self._copies[key] = to_device(flags, self.device).view(1, -1)
        return self._copies[key]

    def _source_rows(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """``x`` as ``[R, *]`` source rows (a view), checked against the plan."""
        if self.source_shape is None:
            if not is_jagged(x):
                require_tensor(name, x)
                raise TypeError(f"this plan was built from sequence lengths: pass {name} as a jagged nested tensor")
            values = jagged_values(require_jagged(name, x))  # [N, *]
            if values.device != self.device:
                raise ValueError(f"{name} is on {values.device} but the plan was built on {self.device}; move one")
            if x.size(0) != self.batch_size or values.shape[0] != self.num_valid_tokens:
                raise ValueError(
                    f"nested {name} has {x.size(0)} sequences / {values.shape[0]} tokens, the plan expects "
                    f"{self.batch_size} / {self.num_valid_tokens}; build a plan from this tensor's offsets"
                )
            return values
        require_tensor(name, x)
        if x.is_nested:
            raise TypeError(f"this plan was built from a [B, S] batch: pass {name} as a padded [B, S, *] tensor")
        if x.device != self.device:
            raise ValueError(f"{name} is on {x.device} but the plan was built on {self.device}; move one")
        if x.shape[:2] != self.source_shape:
            raise ValueError(
                f"{name} must have shape [B, S, *] = [{self.source_shape[0]}, {self.source_shape[1]}, *] like the "
                f"batch the plan was built from, got {tuple(x.shape)}"
            )
        return x.flatten(0, 1)

    # ---------------------------------------------------------------- unpack
    def unpack(
        self, y_local: torch.Tensor, *, gradient: GradientContract = "local", name: str = "y_local"
    ) -> torch.Tensor:
        """This rank's ``[1, T_local, *]`` output -> the full batch on every CP rank.

        Padded-source plans return ``[B, S, *]``, jagged-source plans a jagged nested tensor. Padding is
        zero, the dtype is kept. The all-gather runs over ``ctx.cp_group``; with ``gradient="local"``
        (verl's contract) only this rank's chunk receives gradient, see ``all_gather_rank_major``. Every dtype is
        copied as is, as in ``pack``. ``name``: what errors call ``y_local``.
        """
        local = self._check_local(y_local, name)[0]  # [T_local, *]
        jagged = self.source_shape is None
        # [T, *]; the copy back's index is built while the all-gather is in flight
        stream = gather_stream(communicable(local), self.ctx, gradient, lambda: self._copy_back(jagged))
        return self._to_source_layout(as_dtype(self._copy_back(jagged)(copyable(stream)), local.dtype))

    def restore(self, local_outputs: Sequence[torch.Tensor]) -> torch.Tensor:
        """Pure, no process group: every rank's ``[1, T_local, *]`` output (rank order) -> what ``unpack`` returns."""
        if isinstance(local_outputs, torch.Tensor) or not isinstance(local_outputs, Sequence):
            raise TypeError(
                f"restore takes a list of every CP rank's [1, T_local, *] output ({self.ctx.cp_size} tensors, rank "
                f"order), got {type(local_outputs).__name__}; for this rank's output alone use unpack"
            )
        if len(local_outputs) != self.ctx.cp_size:
            raise ValueError(
                f"restore needs one local output per CP rank ({self.ctx.cp_size}), got {len(local_outputs)}"
            )
        outputs = [copyable(self._check_local(y, f"local_outputs[{rank}]"))[0] for rank, y in enumerate(local_outputs)]
        if len({(y.dtype, y.shape[1:]) for y in outputs}) > 1:
            raise ValueError("every rank's local output must have the same dtype and trailing dimensions")
        stream = outputs[0] if len(outputs) == 1 else torch.cat(outputs)  # [T, *] (the copy back writes a new tensor)
        return self._to_source_layout(
            as_dtype(self._copy_back(self.source_shape is None)(stream), local_outputs[0].dtype)
        )

    def unpack_nested(
        self, y_local: torch.Tensor, *, gradient: GradientContract = "local", name: str = "y_local"
    ) -> torch.Tensor:
        """Like ``unpack`` but always a jagged nested tensor ``[n, j, *]`` of the real tokens of each sequence."""
        local = self._check_local(y_local, name)[0]
        stream = gather_stream(communicable(local), self.ctx, gradient, lambda: self._copy_back(True))  # [T, *]
        values = as_dtype(self._copy_back(True)(copyable(stream)), local.dtype)  # [N, *]
        return jagged_from_values(values, self.jagged_offsets)

    def _check_local(self, y_local: torch.Tensor, name: str) -> torch.Tensor:
        require_tensor(name, y_local)
        if y_local.is_nested or y_local.dim() < 2 or y_local.shape[0] != 1 or y_local.shape[1] != self.local_length:
            raise ValueError(
                f"{name} must have shape [1, T_local, *] with T_local={self.local_length} "
                f"(this plan's local length), got {tuple(y_local.shape)}"
            )
        if y_local.device != self.device:
            raise ValueError(f"{name} is on {y_local.device} but the plan was built on {self.device}; move one")
        return y_local

    def _to_source_layout(self, rows: torch.Tensor) -> torch.Tensor:
        if self.source_shape is None:
            return jagged_from_values(rows, self.jagged_offsets)
        return rows.view(*self.source_shape, *rows.shape[1:])
