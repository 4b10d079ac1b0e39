"""The boundary between the device and the host: one read per plan, and the small tables sent back.

A plan reads, once, everything the host must know (sizes, per-sequence lengths, the value checks); all
per-sequence arithmetic then runs on the host with numpy, and only what the device needs (run tables,
offsets) is copied back, pinned and non-blocking, so the copy never waits on the device.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

_NUMPY_DTYPES = {torch.long: np.int64, torch.int32: np.int32}


def read_to_host(*tensors: torch.Tensor) -> tuple[np.ndarray, ...]:
    """The one device->host transfer: the tensors' values as numpy arrays (int64, flattened).

    On the CPU these are views of the tensors (no copy); on an accelerator the tensors travel as one
    buffer in one copy, which waits for the device (the sync every plan pays once).
    """
    if all(tensor.device.type == "cpu" for tensor in tensors):
        return tuple(tensor.detach().reshape(-1).long().numpy() for tensor in tensors)
    return read_as_one_buffer(*tensors)


def read_as_one_buffer(*tensors: torch.Tensor) -> tuple[np.ndarray, ...]:
    """``read_to_host`` off the CPU: the tensors concatenated on their device, one copy, split on the host."""
    flat = [tensor.detach().reshape(-1).long() for tensor in tensors]
    buffer = torch.cat(flat).cpu().numpy()
    return tuple(np.split(buffer, np.cumsum([t.numel() for t in flat])[:-1]))


def to_device(array: np.ndarray, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """A host table as a ``dtype`` tensor on ``device`` (pinned, non-blocking copy off the CPU)."""
    tensor = torch.from_numpy(np.ascontiguousarray(array)).to(dtype)
    if device.type == "cpu":
        return tensor
    try:
        pinned = tensor.pin_memory()
    except RuntimeError:  # this accelerator offers no pinned host memory: a plain copy (it waits for the device)
        return tensor.to(device)
    return pinned.to(device, non_blocking=True)


def tables_to_device(
    arrays: Sequence[np.ndarray], device: torch.device, dtype: torch.dtype = torch.long
) -> tuple[torch.Tensor, ...]:
    """1-D host tables as ``dtype`` (int64 or int32) tensors on ``device``. Off the CPU: one buffer, one copy, one
    view each. On the CPU each tensor shares its table's memory (converted only if the dtype differs; no tensor
    op): the caller hands the tables over and must not change them afterwards."""
    numpy_dtype = _NUMPY_DTYPES[dtype]
    if device.type == "cpu":
        return tuple(torch.from_numpy(np.ascontiguousarray(array, numpy_dtype)) for array in arrays)
    buffer = np.concatenate(arrays, dtype=numpy_dtype)
    return to_device(buffer, device, dtype).split([array.size for array in arrays])
