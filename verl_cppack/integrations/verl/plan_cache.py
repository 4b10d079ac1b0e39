"""Remember plans between the calls of one micro-batch (one host sync per micro-batch, not per call), keyed by the
*identity and version* of their source tensor (the mask, or a nested batch's offsets). On the CPU a hit also compares
the contents with a copy kept at planning time, catching writes the version counter misses; on an accelerator it
does not (build a new tensor per batch, as verl does). Entries die with their source (a weak reference), so a
recycled address cannot hit a stale entry."""

from __future__ import annotations

import ctypes
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

import numpy as np
import torch

from verl_cppack.core.host import host_memory

T = TypeVar("T")

# Attribute under which a drop-in records, on the PackedSeqParams it returns, the plan that made it.
PLAN_ATTRIBUTE = "_verl_cppack_plan"


try:
    _MEMCMP = ctypes.CDLL(None).memcmp
    _MEMCMP.restype, _MEMCMP.argtypes = ctypes.c_int, (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
except (OSError, AttributeError, TypeError):  # no C library to load this way (e.g. Windows)
    _MEMCMP = None


class SourceSnapshot:
    """The tensor a plan was built from: a weak reference, its version, a copy of its contents, and the values the
    cache keeps for it (extra key -> value)."""

    __slots__ = ("reference", "version", "kept", "values")

    def __init__(self, source: torch.Tensor, reference: weakref.ref, keep_contents: bool | None) -> None:
        self.reference, self.version, self.values = reference, source._version, {}
        # the contents compared on every hit (``keep_contents=None``: on the CPU only): bytes for ``memcmp`` where
        # contiguous, else a numpy copy
        keep = source.device.type == "cpu" if keep_contents is None else keep_contents
        if not keep:
            self.kept = None
        elif _MEMCMP is not None and source.is_contiguous():
            self.kept = ctypes.string_at(source.data_ptr(), source.nbytes)
        else:
            self.kept = np.array(host_memory(source), order="C")

    def matches(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is the source, unchanged: same object and version, and (kept contents) the same bytes,
        by ``memcmp`` with no ATen op (far cheaper than ``torch.equal``; on an accelerator it would cost a sync)."""
        if self.reference() is not tensor or tensor._version != self.version:
            return False
        kept = self.kept
        if isinstance(kept, bytes):  # the source was contiguous: a tensor that is not now is not it, unchanged
            same_size = tensor.is_contiguous() and tensor.nbytes == len(kept)
            return same_size and (not kept or _MEMCMP(tensor.data_ptr(), kept, len(kept)) == 0)
        return kept is None or bool(np.array_equal(host_memory(tensor), kept))  # masks, offsets: integers, no NaN


class TensorKeyedCache:
    """A small LRU map from (source tensor, extra key) to a value built once; one source's entries share a snapshot,
    which holds their values. A dead source's values are released in its weakref callback (its snapshot's own dict,
    which no loop walks), its entries dropped at the next call: the callback may run inside a GC during this cache's
    own loop over its entries (mutating the OrderedDict mid-iteration)."""

    def __init__(self, capacity: int = 8, keep_contents: bool | None = None) -> None:
        self._capacity, self._keep_contents = capacity, keep_contents  # keep_contents: as ``SourceSnapshot`` takes it
        self._entries: OrderedDict[tuple, SourceSnapshot] = OrderedDict()  # (id, version, key) -> its snapshot
        self._snapshots: dict[tuple[int, int], SourceSnapshot] = {}
        self._dead: list[tuple[tuple[int, int], SourceSnapshot]] = []  # appended to by the callbacks alone

    def _drop_dead(self) -> None:  # the entries of the sources that died since the last call
        while self._dead:
            source_key, snapshot = self._dead.pop()
            if self._snapshots.get(source_key) is snapshot:
                del self._snapshots[source_key]
            for entry_key in [k for k, kept in self._entries.items() if kept is snapshot]:  # registered or evicted
                del self._entries[entry_key]

    def _hit(self, source: torch.Tensor, key: Hashable) -> tuple[SourceSnapshot, Any] | None:
        self._drop_dead()
        entry_key = (id(source), source._version, key)
        found = self._entries.get(entry_key)
        if found is None:
            return None
        if not found.matches(source):
            self._forget(entry_key[:2])  # another tensor at a recycled address, or changed contents
            return None
        self._entries.move_to_end(entry_key)
        return found, found.values[key]

    def entry(self, source: torch.Tensor, key: Hashable, build: Callable[[], T]) -> tuple[T, SourceSnapshot]:
        """``(value, snapshot of source)``: the cached value, or ``build()`` stored when there is none."""
        found = self._hit(source, key)
        if found is not None:
            return found[1], found[0]
        value = build()
        return value, self.store(source, key, value)

    def lookup(self, source: torch.Tensor, key: Hashable) -> Any | None:
        found = self._hit(source, key)
        return None if found is None else found[1]

    def find(self, source: torch.Tensor, accept: Callable[[Any], bool]) -> Any | None:
        """A cached value of ``source`` (unchanged, any extra key) that ``accept`` takes, or None."""
        self._drop_dead()
        for (source_id, version, key), snapshot in reversed(list(self._entries.items())):
            value = snapshot.values.get(key)
            if source_id == id(source) and version == source._version and value is not None and accept(value):
                return value if snapshot.matches(source) else None
        return None

    def store(self, source: torch.Tensor, key: Hashable, value: Any) -> SourceSnapshot:
        """Keep ``value`` for ``source`` and ``key``; returns the snapshot of ``source`` its entries share."""
        self._drop_dead()
        snapshot = self._snapshot(source)
        snapshot.values[key] = value
        self._entries[(id(source), source._version, key)] = snapshot
        while len(self._entries) > self._capacity:
            evicted, evicted_snapshot = self._entries.popitem(last=False)
            evicted_snapshot.values.pop(evicted[2], None)
            # its source has no entry left (a snapshot holds one value per entry; a dead source's entries go in
            # _drop_dead whether or not its snapshot is still registered)
            if not evicted_snapshot.values and self._snapshots.get(evicted[:2]) is evicted_snapshot:
                del self._snapshots[evicted[:2]]
        return snapshot

    def _snapshot(self, source: torch.Tensor) -> SourceSnapshot:
        """The snapshot ``source``'s entries share, if it still matches; else a new one (a copy of the contents)."""
        source_key = (id(source), source._version)
        snapshot = self._snapshots.get(source_key)
        if snapshot is not None:
            if snapshot.matches(source):
                return snapshot
            self._forget(source_key)  # (a source without a snapshot has no entry)
        dead = self._dead

        def forget(_reference: weakref.ref, source_key: tuple = source_key) -> None:  # values go, entries noted
            snapshot.values.clear()
            dead.append((source_key, snapshot))

        snapshot = SourceSnapshot(source, weakref.ref(source, forget), self._keep_contents)
        self._snapshots[source_key] = snapshot
        return snapshot

    def _forget(self, source_key: tuple) -> None:
        snapshot = self._snapshots.pop(source_key, None)
        if snapshot is not None:
            snapshot.values.clear()
        for entry_key in [k for k in self._entries if k[:2] == source_key]:
            del self._entries[entry_key]

    def clear(self) -> None:
        self._entries.clear()
        self._snapshots.clear()
        self._dead.clear()


def attach_plan(packed_seq_params: Any, plan: Any, snapshot: SourceSnapshot) -> Any:
    """Record on ``packed_seq_params`` the plan that made it and the snapshot of the tensor it came from."""
    setattr(packed_seq_params, PLAN_ATTRIBUTE, (snapshot, plan))
    return packed_seq_params


def attached_plan(packed_seq_params: Any, source: torch.Tensor) -> tuple[Any | None, bool]:
    """``(plan, same_source)``: the recorded plan (or None), whether ``source`` is its unchanged source tensor."""
    record = getattr(packed_seq_params, PLAN_ATTRIBUTE, None)
    if record is None:
        return None, False
    snapshot, plan = record
    return plan, snapshot.matches(source)
