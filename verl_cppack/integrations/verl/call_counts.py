"""Opt-in count of the drop-in calls verl makes in this process, for jobs that must prove the drop-ins ran.

With ``VERL_CPPACK_CALL_COUNT_DIR=DIR`` set, ``counted(name, dropin)`` wraps a drop-in so that every call adds
one to its count and rewrites ``DIR/<host>-<pid>.json`` (``{"pid", "counts": {name: calls}}``, replaced
atomically), so the counts survive a worker that is killed rather than shut down. Without the variable the
drop-ins are installed unwrapped: nothing is counted and nothing costs.
"""

from __future__ import annotations

import functools
import json
import os
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

COUNT_DIR_ENV = "VERL_CPPACK_CALL_COUNT_DIR"

_LOCK = threading.Lock()
_COUNTS: dict[str, int] = {}


def count_directory() -> Path | None:
    value = os.environ.get(COUNT_DIR_ENV, "").strip()
    return Path(value) if value else None


def counted(name: str, dropin: Callable[..., Any]) -> Callable[..., Any]:
    """``dropin`` itself when counting is off, else a wrapper that counts its calls under ``name``."""
    directory = count_directory()
    if directory is None:
        return dropin

    @functools.wraps(dropin)
    def counting(*args: Any, **kwargs: Any) -> Any:
        result = dropin(*args, **kwargs)
        _record(directory, name)
        return result

    return counting


def _record(directory: Path, name: str) -> None:
    with _LOCK:
        _COUNTS[name] = _COUNTS.get(name, 0) + 1
        payload = json.dumps({"pid": os.getpid(), "counts": dict(_COUNTS)}, sort_keys=True)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"{socket.gethostname()}-{os.getpid()}.json"
        staging = path.with_suffix(".tmp")
        staging.write_text(payload)
        os.replace(staging, path)


def read_call_counts(directory: str | Path) -> dict[str, int]:
    """Sum of the counts every process wrote into ``directory`` (drop-in name -> calls)."""
    totals: dict[str, int] = {}
    for path in sorted(Path(directory).glob("*.json")):
        for name, calls in json.loads(path.read_text())["counts"].items():
            totals[name] = totals.get(name, 0) + int(calls)
    return totals
