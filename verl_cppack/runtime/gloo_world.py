"""Run a function in N processes of one ``torch.distributed`` group on this host: the project's one harness; a rank
that fails or exits without reporting, or Ctrl-C in the parent, stops every rank and raises ``RankFailed``."""

from __future__ import annotations

import datetime
import io
import os
import queue
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

COLLECTIVE_TIMEOUT_S = 600.0  # a collective that waits longer than this raises instead of hanging
STOP_GRACE_S = 5.0  # SIGTERM, then SIGKILL after this long
BACKENDS = ("gloo", "nccl")


class RankFailed(RuntimeError):
    """A rank raised or exited without reporting; the message names it and its exception's line."""

    def __init__(self, rank: int, message: str, report: str = "") -> None:
        super().__init__(f"rank {rank} {message}")
        self.rank, self.report = rank, report


def _rank_main(
    rank: int,
    world_size: int,
    rendezvous: str,
    backend: str,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    environment: Mapping[str, str],
    log_dir: str | None,
    torch_threads: int | None,
    results: Any,
) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's: it stops every rank
    if log_dir is not None:
        log = open(os.path.join(log_dir, f"worker-{rank}.log"), "a", encoding="utf-8")  # noqa: SIM115 - the process's
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    os.environ.update(environment)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # every rank on this host
    if torch_threads is not None:
        torch.set_num_threads(torch_threads)
    import torch.distributed as dist

    dist.init_process_group(
        backend,
        init_method=rendezvous,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )
    try:
        value = fn(rank, world_size, *args)
        buffer = io.BytesIO()
        torch.save(value, buffer)
        results.put((rank, "ok", buffer.getvalue()))
    except BaseException:  # reported to the parent, which stops the other ranks
        report = traceback.format_exc()
        print(report, file=sys.stderr, flush=True)
        results.put((rank, "error", report))
    finally:
        dist.barrier()
        dist.destroy_process_group()


def run_world(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    environment: Mapping[str, str] | None = None,
    log_dir: str | Path | None = None,
    torch_threads: int | None = None,
    poll_s: float = 0.2,
) -> list[Any]:
    """``fn(rank, world_size, *args)`` (a module-level function) in ``world_size`` spawned processes; their return
    values in rank order. ``environment`` is set in every rank, ``log_dir`` takes each rank's output."""
    import torch.multiprocessing as mp

    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    context = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="verl_cppack_world_") as folder:
        rendezvous = f"file://{os.path.join(folder, 'rendezvous')}"
        results = context.Queue()
        rank_args = (dict(environment or {}), None if log_dir is None else str(log_dir), torch_threads, results)
        processes = [
            context.Process(target=_rank_main, args=(rank, world_size, rendezvous, backend, fn, args, *rank_args))
            for rank in range(world_size)
        ]
        try:
            for process in processes:
                process.start()
            values = _collect(processes, results, poll_s)
            for process in processes:
                process.join()
        finally:
            _stop(processes)
            results.close()
            results.join_thread()
    return [torch.load(io.BytesIO(values[rank]), weights_only=False) for rank in range(world_size)]


def _collect(processes: Sequence[Any], results: Any, poll_s: float) -> dict[int, bytes]:
    """Every rank's serialized value, or ``RankFailed`` for the first rank that failed or exited silently."""
    values: dict[int, bytes] = {}
    while len(values) < len(processes):
        try:
            rank, status, payload = results.get(timeout=poll_s)
        except queue.Empty:
            silent = [
                rank for rank, process in enumerate(processes) if rank not in values and process.exitcode is not None
            ]
            if not silent:
                continue
            try:  # one more look: its report may still be on its way
                rank, status, payload = results.get(timeout=1.0)
            except queue.Empty:
                exit_code = processes[silent[0]].exitcode
                raise RankFailed(silent[0], f"exited with code {exit_code} without reporting") from None
        if status != "ok":
            raise RankFailed(rank, f"failed: {last_line(payload)}", payload)
        values[rank] = payload
    return values


def last_line(report: str) -> str:
    """The exception line of a traceback (its last non-empty line)."""
    lines = [line.strip() for line in report.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "unknown error"


def _stop(processes: Sequence[Any]) -> None:
    """SIGTERM every live rank, SIGKILL what is left after ``STOP_GRACE_S``, reap them all."""
    for process in processes:
        if process.pid is not None and process.is_alive():
            process.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    for process in processes:
        if process.pid is not None:
            process.join(max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.pid is not None and process.is_alive():
            process.kill()
            process.join()
