"""The parallel context every core function takes explicitly (never a module-level global).

Built by hand, or read from megatron-core by ``integrations.megatron.parallel_context_from_megatron()``.
"""

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
        if self.cp_group is not None:
            import torch.distributed as dist

            if not dist.is_available() or not isinstance(self.cp_group, dist.ProcessGroup):
                raise TypeError(
                    f"cp_group must be a torch.distributed.ProcessGroup or None, got {type(self.cp_group).__name__} "
                    f"({self.cp_group!r}); e.g. torch.distributed.group.WORLD after init_process_group"
                )

    def check_group(self) -> None:
        """``ValueError`` unless ``cp_group`` has ``cp_size`` ranks with this process at ``cp_rank`` (checked
        when a group is set and torch.distributed is initialised; a few microseconds, no communication)."""
        if self.cp_group is None:
            return
        import torch.distributed as dist

        if not dist.is_initialized():
            return
        group_size, group_rank = dist.get_world_size(self.cp_group), dist.get_rank(self.cp_group)
        if group_size != self.cp_size or group_rank != self.cp_rank:
            raise ValueError(
                f"ctx.cp_group has size {group_size} and this process is its rank {group_rank}, but ctx says "
                f"cp_size={self.cp_size}, cp_rank={self.cp_rank}; build the context from the same group"
            )
