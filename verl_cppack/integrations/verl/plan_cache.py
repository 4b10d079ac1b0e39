"""Remember plans between the calls of one micro-batch, keyed by the tensor they were built from.

verl calls the util functions several times per micro-batch with the same attention mask (inputs, labels,
label masks, then the gather-back of every output). Re-planning each time would cost one host sync per
call; instead a plan is cached under the *identity and version* of its source tensor (the attention mask,
or the offsets of a nested batch). An in-place edit bumps ``tensor._version`` and misses the cache; an
entry dies with its source tensor (weak reference with a callback), so plans never outlive the micro-batch
and a new tensor at a recycled address cannot hit a stale entry.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

import torch

T = TypeVar("T")

# Attribute under which a drop-in records, on the PackedSeqParams it returns, the plan that made it.
PLAN_ATTRIBUTE = "_verl_cppack_plan"


class TensorKeyedCache:
    """A small LRU map from (source tensor, extra key) to a value built once."""

    def __init__(self, capacity: int = 8) -> None:
        self._capacity = capacity
        self._entries: OrderedDict[tuple, tuple[weakref.ref, Any]] = OrderedDict()

    def lookup(self, source: torch.Tensor, key: Hashable) -> Any | None:
        entry_key = (id(source), source._version, key)
        entry = self._entries.get(entry_key)
        if entry is None or entry[0]() is not source:
            return None
        self._entries.move_to_end(entry_key)
        return entry[1]

    def store(self, source: torch.Tensor, key: Hashable, value: T) -> T:
        entry_key = (id(source), source._version, key)
        entries = self._entries

        def forget(_reference: weakref.ref, entry_key: tuple = entry_key) -> None:
            entries.pop(entry_key, None)

        entries[entry_key] = (weakref.ref(source, forget), value)
        while len(self._entries) > self._capacity:
            self._entries.popitem(last=False)
        return value

    def get_or_build(self, source: torch.Tensor, key: Hashable, build: Callable[[], T]) -> T:
        value = self.lookup(source, key)
        return self.store(source, key, build()) if value is None else value

    def clear(self) -> None:
        self._entries.clear()


def attach_plan(packed_seq_params: Any, plan: Any, source: torch.Tensor) -> Any:
    """Record on ``packed_seq_params`` the plan that made it and the tensor (mask/offsets) it came from."""
    setattr(packed_seq_params, PLAN_ATTRIBUTE, (weakref.ref(source), source._version, plan))
    return packed_seq_params


def attached_plan(packed_seq_params: Any, source: torch.Tensor) -> tuple[Any | None, bool]:
    """``(plan, same_source)``: the recorded plan (or None) and whether ``source`` is the tensor it came from."""
    record = getattr(packed_seq_params, PLAN_ATTRIBUTE, None)
    if record is None:
        return None, False
    reference, version, plan = record
    return plan, reference() is source and source._version == version
