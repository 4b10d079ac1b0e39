"""The boundary between the device and the host: one read per plan, and the tables sent back.

A plan reads, once, everything the host must know (per-sequence lengths and where they start, the value
checks); all per-sequence arithmetic then runs on the host with numpy, and each table the device needs travels
pinned and non-blocking, so the copy never waits on the device.
"""

from __future__ import annotations

import numpy as np
import torch

_NUMPY_DTYPES = {torch.long: np.int64, torch.int32: np.int32, torch.bool: np.bool_}


def read_to_host(*tensors: torch.Tensor) -> tuple[np.ndarray, ...]:
    """The one device->host transfer: the tensors' values as int64 numpy arrays (flattened).

    On the CPU these are views of the tensors where their dtype is int64 (no copy); on an accelerator the
    tensors travel as one buffer in one copy (``read_as_one_buffer``), which waits for the device (the sync
    every plan pays once); one int64 tensor costs no op beyond that copy.
    """
    if all(tensor.device.type == "cpu" for tensor in tensors):
        return tuple(host_memory(tensor.long()).reshape(-1) for tensor in tensors)
    return read_as_one_buffer(*tensors)


def host_memory(tensor: torch.Tensor) -> np.ndarray:
    """``read_to_host`` for a CPU tensor read where it is: its own memory as numpy, dtype and shape kept."""
    if tensor.device.type != "cpu":
        raise ValueError(f"host_memory reads CPU tensors only, got one on {tensor.device}")
    return (tensor.detach() if tensor.requires_grad else tensor).numpy()


def read_as_one_buffer(*tensors: torch.Tensor) -> tuple[np.ndarray, ...]:
    """``read_to_host`` off the CPU: the tensors concatenated on their device, one copy, split on the host."""
    flat = [tensor.long() for tensor in tensors]  # no op for int64 (which records no gradient)
    one = flat[0] if len(flat) == 1 else torch.cat([tensor.reshape(-1) for tensor in flat])
    return tuple(np.split(host_memory(one.cpu()).reshape(-1), np.cumsum([tensor.numel() for tensor in flat])[:-1]))


def to_device(array: np.ndarray, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A host table as a contiguous tensor on ``device`` (``dtype``: converted on the host first; pinned,
    non-blocking copy off the CPU; on the CPU the tensor shares the array's memory where neither a conversion nor a
    contiguous copy is needed)."""
    tensor = torch.from_numpy(np.ascontiguousarray(array, None if dtype is None else _NUMPY_DTYPES[dtype]))
    if device.type == "cpu":
        return tensor
    try:
        pinned = tensor.pin_memory()
    except RuntimeError:  # this accelerator offers no pinned host memory: a plain copy (it waits for the device)
        return tensor.to(device)
    return pinned.to(device, non_blocking=True)
