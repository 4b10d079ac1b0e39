"""The parallel context every core function takes explicitly (never a module-level global)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def _require_int(name: str, value: object, minimum: int | None = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


_NOT_A_GROUP = (str, bytes, int, float, complex)


def _refuse_non_group(cp_group: object) -> None:
    """A string or a number is never a process group, whatever torch.distributed or a stand-in would answer."""
    if isinstance(cp_group, _NOT_A_GROUP):
        raise TypeError(
            f"cp_group must be a torch.distributed.ProcessGroup (or an object torch.distributed accepts as a group) "
            f"or None, got {type(cp_group).__name__} ({cp_group!r}); e.g. torch.distributed.group.WORLD after "
            "init_process_group"
        )


def group_size_and_rank(cp_group: object) -> tuple[int, int]:
    """``(size, this process's rank)`` of ``cp_group`` as the caller's ``torch.distributed`` (or a stand-in) answers
    them; a failure to answer, or a string or number, is a ``TypeError`` naming ``cp_group``."""
    _refuse_non_group(cp_group)
    import torch.distributed as dist

    try:
        size, rank = dist.get_world_size(group=cp_group), dist.get_rank(group=cp_group)
    except Exception as error:  # noqa: BLE001 - whatever torch.distributed raises, the answer is "not a group"
        raise TypeError(
            f"cp_group must be a torch.distributed.ProcessGroup (or an object torch.distributed accepts as a group) "
            f"or None; torch.distributed could not tell the size and rank of {type(cp_group).__name__} "
            f"({cp_group!r}): {type(error).__name__}: {error}"
        ) from error
    if isinstance(size, bool) or isinstance(rank, bool) or not isinstance(size, int) or not isinstance(rank, int):
        raise TypeError(
            f"cp_group: torch.distributed answered size {size!r} and rank {rank!r} for {type(cp_group).__name__}, "
            "not integers; pass a process group"
        )
    return size, rank


@dataclass(frozen=True)
class ParallelContext:
    """Tensor- and context-parallel sizes of the calling rank (by hand or ``parallel_context_from_megatron()``).

    ``cp_group`` may stay ``None`` while ``cp_size == 1``; a group given by hand must tell its size and rank through
    ``torch.distributed`` when the context is made. ``group_from_megatron=True`` trusts megatron's answers as verl
    does (verl's unit tests stand in a group torch.distributed does not know)."""

    tp_size: int = 1
    cp_size: int = 1
    cp_rank: int = 0
    cp_group: Any = None
    group_from_megatron: bool = field(default=False, repr=False, compare=False, kw_only=True)
    # (size, rank) torch.distributed gave for cp_group when the context was made; None without a group
    group_answer: tuple[int, int] | None = field(default=None, init=False, repr=False, compare=False)
    # the hash of the compared fields, computed once: plans are cached under contexts, looked up on every call
    _hash: int = field(default=0, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _require_int("tp_size", self.tp_size)
        _require_int("cp_size", self.cp_size)
        _require_int("cp_rank", self.cp_rank, minimum=None)  # the range is checked next, naming both
        if not 0 <= self.cp_rank < self.cp_size:
            raise ValueError(
                f"cp_rank must satisfy 0 <= cp_rank < cp_size, got cp_rank={self.cp_rank}, cp_size={self.cp_size}"
            )
        if not isinstance(self.group_from_megatron, bool):
            raise TypeError(f"group_from_megatron must be True or False, got {self.group_from_megatron!r}")
        if self.group_from_megatron:
            _refuse_non_group(self.cp_group)
        elif self.cp_group is not None:
            object.__setattr__(self, "group_answer", group_size_and_rank(self.cp_group))
        object.__setattr__(self, "_hash", hash((self.tp_size, self.cp_size, self.cp_rank, self.cp_group)))

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self) -> tuple:  # made anew where it is unpickled: the hash of None differs between processes
        return (_made_again, (self.tp_size, self.cp_size, self.cp_rank, self.cp_group, self.group_from_megatron))

    @property
    def default_slot_multiple(self) -> int:
        """verl's slot alignment, the one formula: ``TP*CP*2`` when CP>1 (every slot cut into ``2*CP`` zigzag chunks,
        each a multiple of TP), else ``TP``."""
        return self.tp_size * self.cp_size * 2 if self.cp_size > 1 else self.tp_size

    def check_group(self) -> None:
        """``ValueError`` unless ``cp_group`` has ``cp_size`` ranks with this process at ``cp_rank`` (as
        ``torch.distributed`` answered when the context was made; no communication)."""
        if self.group_answer is None:
            return
        group_size, group_rank = self.group_answer
        if group_size != self.cp_size or group_rank != self.cp_rank:
            raise ValueError(
                f"ctx.cp_group has size {group_size} and this process is its rank {group_rank}, but ctx says "
                f"cp_size={self.cp_size}, cp_rank={self.cp_rank}; build the context from the same group"
            )


def _made_again(tp_size: int, cp_size: int, cp_rank: int, cp_group: Any, group_from_megatron: bool) -> ParallelContext:
    return ParallelContext(tp_size, cp_size, cp_rank, cp_group, group_from_megatron=group_from_megatron)
