"""Run a function in N real gloo processes on this machine (no mocks) and collect what each rank returns."""

from __future__ import annotations

import os
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _detached(value: Any) -> Any:
    """Results cross a process boundary: plain copies of tensors, containers walked."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (list, tuple)):
        return type(value)(_detached(v) for v in value)
    if isinstance(value, dict):
        return {k: _detached(v) for k, v in value.items()}
    return value


def _worker(rank: int, world_size: int, rendezvous: str, fn: Callable, args: tuple, results: Any) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo talks over loopback only
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=world_size)
    try:
        results[rank] = ("ok", _detached(fn(rank, world_size, *args)))
    except BaseException:  # reported to the parent, which raises
        results[rank] = ("error", traceback.format_exc())
    finally:
        dist.barrier()
        dist.destroy_process_group()


def run_gloo(fn: Callable, world_size: int, *args: Any) -> list[Any]:
    """``fn(rank, world_size, *args)`` in ``world_size`` spawned processes; returns the per-rank results.

    ``fn`` must be a module-level function; its return value must be picklable (tensors are fine).
    """
    with tempfile.TemporaryDirectory() as folder, mp.Manager() as manager:
        results = manager.dict()
        rendezvous = f"file://{os.path.join(folder, 'rendezvous')}"  # no port to race for
        mp.spawn(_worker, args=(world_size, rendezvous, fn, args, results), nprocs=world_size, join=True)
        ordered = [results[rank] for rank in range(world_size)]
    errors = [payload for status, payload in ordered if status == "error"]
    if errors:
        raise AssertionError("a gloo rank failed:\n" + "\n".join(errors))
    return [payload for _, payload in ordered]
