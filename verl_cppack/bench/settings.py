"""What ``verl-cppack bench`` measures: the grid of micro-batch shapes and CP sizes, and how many samples of each."""

from __future__ import annotations

from dataclasses import dataclass

import torch


def _require_count(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


FUNCTIONS = ("legacy", "engine")


@dataclass(frozen=True)
class BenchSettings:
    """The default grid is the sizes context-parallel users run: one to a few long sequences per micro-batch
    (B=1, 4) up to the large batches of short rollouts (B=256). A full default run took 6 minutes on a 2-core CPU
    machine."""

    batch_sizes: tuple[int, ...] = (1, 4, 16, 64, 256)
    seq_lens: tuple[int, ...] = (1024, 4096, 8192)
    cp_sizes: tuple[int, ...] = (1, 2, 4)
    repeats: int = 7  # timed micro-batches per point and run, each a new batch; medians
    runs: int = 5  # fresh process groups per CP size; times are medians over runs (a run's times drift together)
    warmup: int = 3  # untimed micro-batches per point before the timed ones (the allocator grows its heap)
    functions: str = "legacy"  # "legacy": preprocess/postprocess_packed_seqs; "engine": *_thd_engine (jagged)
    threads: int = 1
    device: str = "cpu"  # "cuda": one GPU per CP rank, nccl, CUDA-synchronised timings
    keep_freed_host_memory: bool = True  # CPU: glibc keeps freed buffers (see bench.host_allocator)

    def check(self) -> None:
        """Refuse settings this machine cannot run, before any process starts."""
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.functions not in FUNCTIONS:
            raise ValueError(f"functions must be one of {FUNCTIONS}, got {self.functions!r}")
        _require_count("repeats", self.repeats, 1)
        _require_count("runs", self.runs, 1)
        _require_count("warmup", self.warmup, 0)
        _require_count("threads", self.threads, 1)
        for name in ("batch_sizes", "seq_lens", "cp_sizes"):
            values = getattr(self, name)
            if not values or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in values):
                raise ValueError(f"{name} must be a non-empty tuple of positive ints, got {values!r}")
        odd = [s for s in self.seq_lens if s < 2]
        if odd:
            raise ValueError(f"seq_lens must be >= 2 (a prompt half and a response half), got {odd}")
        if self.device == "cuda":
            available = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if available < max(self.cp_sizes):
                raise ValueError(
                    f"device='cuda' needs one GPU per CP rank ({max(self.cp_sizes)}); this machine has {available}"
                )

    @classmethod
    def quick(cls) -> BenchSettings:
        """The smoke run: two batch sizes, one short S, CP 1 and 2, one timed micro-batch (seconds, not minutes)."""
        return cls(batch_sizes=(1, 16), seq_lens=(256,), cp_sizes=(1, 2), repeats=1, runs=1, warmup=1)
