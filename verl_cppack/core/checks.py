"""Argument checks shared by every public entry point: one wording, raised before any work."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import torch

from verl_cppack.core.jagged import has_holes, is_jagged

if TYPE_CHECKING:
    from verl_cppack.context import ParallelContext

F = TypeVar("F", bound=Callable)

_INTEGER_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)
OFFSET_DTYPES = (torch.int32, torch.int64)  # what cumulative offsets (cu_seqlens) may be: they hold stream totals
# THD offsets are int32 (Transformer Engine, Megatron): every length, multiple and total stays below this.
MAX_STREAM_POSITIONS = 2**31


def require_tensor(name: str, value: object) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def require_integer_tensor(
    name: str, value: object, ndim: int | None = None, dtypes: tuple[torch.dtype, ...] = _INTEGER_DTYPES
) -> torch.Tensor:
    tensor = require_tensor(name, value)
    if tensor.dtype not in dtypes:
        raise TypeError(
            f"{name} must be an integer tensor of dtype {' or '.join(str(d).removeprefix('torch.') for d in dtypes)}"
            f", got dtype {tensor.dtype}"
        )
    if ndim is not None and tensor.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(tensor.shape)}")
    return tensor


def require_mask(name: str, value: object) -> torch.Tensor:
    """A padded batch's token mask: a 2-D ``[B, S]`` tensor (B, S >= 1), bool or integer (its values are checked
    when the plan reads it back)."""
    mask = require_tensor(name, value)
    if mask.is_nested or mask.dim() != 2:
        raise ValueError(f"{name} must be a 2-D [B, S] tensor, got shape {tuple(mask.shape)}")
    if mask.dtype.is_floating_point or mask.dtype.is_complex:
        raise TypeError(f"{name} must be bool or integer 0/1, got dtype {mask.dtype}")
    if mask.shape[0] < 1 or mask.shape[1] < 1:
        raise ValueError(f"{name} must have B >= 1 and S >= 1, got shape {tuple(mask.shape)}")
    if mask.is_meta:
        raise ValueError(f"{name} is a meta tensor (a shape without values): a plan reads the mask; pass it with data")
    return mask


def require_int(name: str, value: object, minimum: int = 0, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}")
    return value


def require_stream_int(name: str, value: object, minimum: int = 0) -> int:
    """An int that counts stream positions: below ``2**31``, as THD offsets are int32."""
    require_int(name, value, minimum)
    if value >= MAX_STREAM_POSITIONS:
        raise ValueError(f"{name} must be < 2**31 (THD offsets are int32, no packed stream is that long), got {value}")
    return value


def require_context(value: object, name: str = "ctx", allow_none: bool = True) -> ParallelContext:
    """A ``ParallelContext``; ``None`` is the default context (no parallelism) where ``allow_none``."""
    from verl_cppack.context import ParallelContext

    if value is None and allow_none:
        return ParallelContext()
    if not isinstance(value, ParallelContext):
        raise TypeError(
            f"{name} must be a ParallelContext (e.g. ParallelContext(cp_size=2, cp_rank=r, cp_group=group)), "
            f"got {type(value).__name__}"
        )
    return value


def require_token_id(name: str, value: object, dtype: torch.dtype) -> int:
    """A token id that a tensor of ``dtype`` can hold (otherwise comparisons would match a wrapped value)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int token id, got {type(value).__name__} ({value!r})")
    info = torch.iinfo(dtype)
    if not info.min <= value <= info.max:
        raise ValueError(
            f"{name}={value} does not fit the tokens' dtype {dtype} ({info.min}..{info.max}); pass an id the tokens "
            "can hold, or tokens of a wider dtype"
        )
    return value


def require_jagged(name: str, value: object) -> torch.Tensor:
    """A jagged nested tensor whose sequences fill its values one after another.

    A view with holes (``torch.nested.narrow``: ``lengths()`` differ from ``offsets().diff()``) is copied into
    that form (``.contiguous()``), so its real lengths are the ones used. (Read through ``core.jagged``: no dispatch.)
    """
    if not is_jagged(value):
        require_tensor(name, value)
        raise TypeError(
            f"{name} must be a jagged nested tensor [B, j, *] (torch.nested.nested_tensor(..., layout=torch.jagged))"
        )
    return value.contiguous() if has_holes(value) else value


def require_true(condition: torch.Tensor, message: str) -> None:
    """Raise ``ValueError(message)`` unless the bool tensor ``condition`` is True.

    On the CPU the value is read from the tensor's memory (numpy: nothing to wait for, no ATen op); on an
    accelerator it is read back (one sync) — never a device-side assertion, which would lose the device context.
    """
    value = condition.numpy().item() if condition.device.type == "cpu" else bool(condition)
    if not value:
        raise ValueError(message)


def check_cu_seqlens_padded(cu_seqlens_padded: object, slot_divisor: int) -> tuple[torch.Tensor, int]:
    """Cumulative padded offsets checked (int32/int64, 1-D, from 0, non-decreasing, slots divisible) and the stream
    total: one device->host sync, for public helpers (a plan's offsets are correct by construction)."""
    cu = require_integer_tensor("cu_seqlens_padded", cu_seqlens_padded, ndim=1, dtypes=OFFSET_DTYPES)
    if cu.numel() < 2:
        raise ValueError(f"cu_seqlens_padded needs at least 2 entries ([0, total]), got {cu.numel()}")
    wide = cu.long()  # differences of int32 offsets can overflow int32; of values in [0, 2**31), never int64
    slot_lengths = wide[1:] - wide[:-1]
    first, total, outside, decreasing, indivisible = torch.stack(
        [
            wide[0],
            wide[-1],
            ((wide < 0) | (wide >= MAX_STREAM_POSITIONS)).sum(),
            (slot_lengths < 0).sum(),
            (slot_lengths % slot_divisor != 0).sum(),
        ]
    ).tolist()
    if outside:
        raise ValueError(
            f"cu_seqlens_padded values must lie in [0, 2**31) (THD offsets are int32); {outside} entries do not"
        )
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


def kept_per_arguments(function: F) -> F:
    """``function`` (a policy every call asks for: checks its arguments, returns a frozen answer) with its answers
    kept per arguments (``lru_cache``, 64, typed); arguments that cannot be a key (a list) are answered, or refused
    with the function's own error, unkept."""
    kept = functools.lru_cache(maxsize=64, typed=True)(function)

    @functools.wraps(function)
    def answer(*args, **kwargs):
        try:
            return kept(*args, **kwargs)
        except TypeError:  # unhashable arguments (or the function's own TypeError, raised again here)
            return function(*args, **kwargs)

    return answer  # type: ignore[return-value]
