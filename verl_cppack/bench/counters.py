"""Instruments: ATen ops dispatched, device->host syncs, and peak bytes allocated inside a region."""

from __future__ import annotations

import weakref
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# Ops that copy to the host, or whose output size depends on data (so they sync on an accelerator).
SYNCING_OPS = frozenset(
    {"aten._local_scalar_dense", "aten.nonzero", "aten.masked_select", "aten.unique", "aten._unique", "aten._unique2"}
)


class OpCounter(TorchDispatchMode):
    """Counts every ATen op dispatched inside the ``with`` block, and the syncing ones among them.

    ``peak_bytes``: the most bytes of storage allocated inside the block alive at once (a CPU stand-in for
    ``torch.cuda.max_memory_allocated``). ``torch.from_numpy`` tensors count too: they dispatch no op on the CPU,
    but on an accelerator their copy allocates."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.live_bytes = 0
        self.peak_bytes = 0
        self._seen_storages: set[int] = set()

    def __enter__(self) -> OpCounter:
        self._from_numpy = torch.from_numpy

        def tracked_from_numpy(array):
            tensor = self._from_numpy(array)
            self._track(tensor)
            return tensor

        torch.from_numpy = tracked_from_numpy
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        torch.from_numpy = self._from_numpy
        super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func.overloadpacket)
        self.ops[name] += 1
        if name == "aten.repeat_interleave" and func._overloadname != "self_int" and kwargs.get("output_size") is None:
            self.ops["sync:repeat_interleave_without_output_size"] += 1  # output size read from the repeats
        if name in ("aten.index", "aten.index_put", "aten.index_put_") and _has_bool_index(args):
            self.ops["sync:boolean_mask_indexing"] += 1  # x[mask] / x[mask] = y size their output from the mask
        out = func(*args, **kwargs)
        inputs = None
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(tensor, torch.Tensor) and not tensor.is_nested:
                if inputs is None:
                    inputs = _storages(args, kwargs)
                if tensor.untyped_storage().data_ptr() not in inputs:  # a view or an in-place op's result: not new
                    self._track(tensor)
        return out

    def _track(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self._seen_storages or storage.nbytes() == 0:
            return
        self._seen_storages.add(key)
        self.live_bytes += storage.nbytes()
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        weakref.finalize(tensor, self._release, key, storage.nbytes())

    def _release(self, key: int, nbytes: int) -> None:
        self._seen_storages.discard(key)
        self.live_bytes -= nbytes

    @property
    def total_ops(self) -> int:
        return sum(n for op, n in self.ops.items() if not op.startswith("sync:"))

    def syncs(self) -> int:
        return sum(n for op, n in self.ops.items() if op in SYNCING_OPS or op.startswith("sync:"))


def _storages(args: tuple, kwargs: dict) -> set[int]:
    """Where the storages of an op's tensor arguments (lists of tensors included) begin."""
    found = set()
    for value in (*args, *kwargs.values()):
        for tensor in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(tensor, torch.Tensor) and not tensor.is_nested:
                found.add(tensor.untyped_storage().data_ptr())
    return found


def _has_bool_index(args: tuple) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())


HOST_READS = ("read_to_host", "host_memory")  # verl_cppack.core.host: each stands for one device->host transfer


class HostReadCounter:
    """Host reads that dispatch no ATen op on the CPU, wrapped for the ``with`` block: ``Tensor.tolist`` and
    ``core.host``'s ``HOST_READS`` (each a waiting device->host copy on an accelerator); nested reads count once.
    ``RuntimeError`` when ``core.host`` has none of them (the library's reads would be missed)."""

    def __enter__(self) -> HostReadCounter:
        from verl_cppack.core import host

        names = [name for name in HOST_READS if hasattr(host, name)]
        if not names:
            raise RuntimeError(
                f"verl_cppack.core.host has none of {HOST_READS}: the library reads the host some other way; "
                "update bench/counters.py so its reads are counted"
            )
        self.calls = 0
        self._depth = 0
        self._originals = [(torch.Tensor, "tolist", torch.Tensor.tolist)]
        self._originals += [(host, name, getattr(host, name)) for name in names]
        for owner, name, original in self._originals:
            setattr(owner, name, self._counting(original))
        return self

    def _counting(self, original):
        def wrapper(*args, **kwargs):
            if self._depth == 0:
                self.calls += 1
            self._depth += 1
            try:
                return original(*args, **kwargs)
            finally:
                self._depth -= 1

        return wrapper

    def __exit__(self, *exc) -> None:
        for owner, name, original in self._originals:
            setattr(owner, name, original)
