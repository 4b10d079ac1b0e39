"""The parallel context every core function takes explicitly (never a module-level global)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


def _require_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")


@dataclass(frozen=True)
class ParallelContext:
    """Tensor- and context-parallel sizes of the calling rank.

    ``cp_group`` is the process group the CP ranks all-gather over; it may stay ``None`` while
    ``cp_size == 1`` (nothing is communicated) and must be set before a collective with ``cp_size > 1``.
    """

    tp_size: int = 1
    cp_size: int = 1
    cp_rank: int = 0
    cp_group: Any = None

    def __post_init__(self) -> None:
        _require_positive_int("tp_size", self.tp_size)
        _require_positive_int("cp_size", self.cp_size)
        if isinstance(self.cp_rank, bool) or not isinstance(self.cp_rank, int):
            raise TypeError(f"cp_rank must be an int, got {type(self.cp_rank).__name__} ({self.cp_rank!r})")
        if not 0 <= self.cp_rank < self.cp_size:
            raise ValueError(
                f"cp_rank must satisfy 0 <= cp_rank < cp_size, got cp_rank={self.cp_rank}, cp_size={self.cp_size}"
            )

    @classmethod
    def from_megatron(cls) -> "ParallelContext":
        """Read TP/CP sizes, CP rank and CP group from an initialised ``megatron.core.parallel_state``."""
        from verl_cppack.integrations.megatron import parallel_context_from_megatron

        return parallel_context_from_megatron()
