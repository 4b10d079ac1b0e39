"""The parallel shape of a job: TP, CP and DP sizes and the Ray nodes the ``tp * cp * dp`` workers span."""

from __future__ import annotations

from dataclasses import dataclass

from verl_cppack.core.checks import require_int


@dataclass(frozen=True)
class ParallelShape:
    tp: int = 1
    cp: int = 2
    dp: int = 1
    nnodes: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "cp", "dp", "nnodes"):
            require_int(name, getattr(self, name), minimum=1)
        if self.workers % self.nnodes:
            raise ValueError(
                f"nnodes={self.nnodes} does not divide the {self.workers} workers (tp {self.tp} x cp {self.cp} x dp "
                f"{self.dp}): every node runs the same number of workers; pick nnodes among "
                f"{[n for n in range(1, self.workers + 1) if self.workers % n == 0]}"
            )

    @property
    def workers(self) -> int:
        """Ray worker slots: one Megatron rank each (verl's world size)."""
        return self.tp * self.cp * self.dp

    @property
    def workers_per_node(self) -> int:
        return self.workers // self.nnodes

    def describe(self) -> str:
        return f"tp {self.tp} x cp {self.cp} x dp {self.dp} = {self.workers} workers on {self.nnodes} node(s)"
