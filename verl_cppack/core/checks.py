"""Argument checks shared by every public entry point: one wording, raised before any work."""

from __future__ import annotations

import torch

_INTEGER_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def require_tensor(name: str, value: object) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def require_integer_tensor(name: str, value: object, ndim: int | None = None) -> torch.Tensor:
    tensor = require_tensor(name, value)
    if tensor.dtype not in _INTEGER_DTYPES:
        raise TypeError(f"{name} must be an integer tensor (int32 or int64), got dtype {tensor.dtype}")
    if ndim is not None and tensor.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(tensor.shape)}")
    return tensor


def require_int(name: str, value: object, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def check_cu_seqlens_padded(cu_seqlens_padded: object, slot_divisor: int) -> tuple[torch.Tensor, int]:
    """Validate cumulative padded offsets: integer, 1-D, starts at 0, non-decreasing, slots divisible.

    Returns the offsets and the stream total. Costs one device->host sync (the values are inspected); used by public helpers, not by plans,
    whose offsets are correct by construction.
    """
    cu = require_integer_tensor("cu_seqlens_padded", cu_seqlens_padded, ndim=1)
    if cu.numel() < 2:
        raise ValueError(f"cu_seqlens_padded needs at least 2 entries ([0, total]), got {cu.numel()}")
    slot_lengths = cu[1:] - cu[:-1]
    first, total, decreasing, indivisible = torch.stack(
        [cu[0].long(), cu[-1].long(), (slot_lengths < 0).sum().long(), (slot_lengths % slot_divisor != 0).sum().long()]
    ).tolist()
    if first != 0:
        raise ValueError(f"cu_seqlens_padded must start at 0, got {first}")
    if decreasing:
        raise ValueError("cu_seqlens_padded must be non-decreasing (every slot length >= 0)")
    if indivisible:
        raise ValueError(
            f"every slot length in cu_seqlens_padded must be divisible by {slot_divisor} "
            f"(2 * cp_size for the zigzag layout); pad each sequence to a multiple of {slot_divisor}"
        )
    return cu, total
