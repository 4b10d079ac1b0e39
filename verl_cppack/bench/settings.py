"""What ``verl-cppack bench`` measures: the grid of micro-batch shapes and CP sizes, and how many samples of each."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

import torch


def require_count(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


MIN_SEQ_LEN = 2  # a rollout batch (``bench.batches``) has a prompt half and a response half


def check_grid(batch_sizes: tuple[int, ...], seq_lens: tuple[int, ...], cp_sizes: tuple[int, ...]) -> None:
    """Micro-batch shapes the rollout batches (``bench.batches``) can be made at: positive sizes, S >= 2."""
    for name, values in (("batch_sizes", batch_sizes), ("seq_lens", seq_lens), ("cp_sizes", cp_sizes)):
        if not values or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in values):
            raise ValueError(f"{name} must be a non-empty tuple of positive ints, got {values!r}")
    odd = [s for s in seq_lens if s < MIN_SEQ_LEN]
    if odd:
        raise ValueError(f"seq_lens must be >= {MIN_SEQ_LEN} (a prompt half and a response half), got {odd}")


def require_sizes(**options: int) -> None:
    """A benchmark script's sizes: each >= 1, ``seq_len`` >= ``MIN_SEQ_LEN``; errors name the flag (``--seq-len``)."""
    for name, value in options.items():
        minimum = MIN_SEQ_LEN if name == "seq_len" else 1
        if value < minimum:
            raise ValueError(f"--{name.replace('_', '-')} must be >= {minimum}, got {value}")


def refuse(message: str) -> int:
    """A benchmark script's bad argument: one ``error:`` line on stderr; returns the exit status, 2."""
    print(f"error: {message}", file=sys.stderr)
    return 2


def parse_point(description: str, *, cp: int, repeats: int) -> argparse.Namespace:
    """The command line of a script that measures one point (``--batch-size``, ``--seq-len``, ``--cp``,
    ``--repeats``; ``cp`` and ``repeats`` its defaults), checked: bad sizes are one ``error:`` line and exit 2."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--cp", type=int, default=cp)
    parser.add_argument("--repeats", type=int, default=repeats)
    args = parser.parse_args()
    try:
        require_sizes(batch_size=args.batch_size, seq_len=args.seq_len, cp=args.cp, repeats=args.repeats)
    except ValueError as error:
        sys.exit(refuse(str(error)))
    return args


def int_list(name: str, text: str) -> tuple[int, ...]:
    """A comma-separated option value (``--batch-sizes 1,4``) as ints; ``name`` is the option's attribute name."""
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ValueError(
            f"--{name.replace('_', '-')} takes comma-separated integers like 1,2,4; got {text!r}"
        ) from None


FUNCTIONS = ("legacy", "engine")


@dataclass(frozen=True)
class BenchSettings:
    """The default grid is the sizes context-parallel users run: one to a few long sequences per micro-batch
    (B=1, 4) up to the large batches of short rollouts (B=256)."""

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
        require_count("repeats", self.repeats, 1)
        require_count("runs", self.runs, 1)
        require_count("warmup", self.warmup, 0)
        require_count("threads", self.threads, 1)
        check_grid(self.batch_sizes, self.seq_lens, self.cp_sizes)
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
