"""Opt-in count of the drop-in calls verl makes in this process, for jobs that must prove the drop-ins ran.

With ``VERL_CPPACK_CALL_COUNT_DIR=DIR`` set, ``counted(name, dropin)`` wraps a drop-in so that every call adds
one to its count and rewrites ``DIR/<host>-<pid>.json`` (``{"pid", "counts": {name: calls}, "roles": {role:
calls}}``, replaced atomically), so the counts survive a worker that is killed rather than shut down. The role is
``critic`` when the call comes from verl's value-model engine (a caller frame's ``self`` is a
``*ValueHead`` engine: actor, reference and critic can share one worker process), else ``policy``. Without the
variable the drop-ins are installed unwrapped: nothing is counted and nothing costs.
"""

from __future__ import annotations

import functools
import json
import os
import socket
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

COUNT_DIR_ENV = "VERL_CPPACK_CALL_COUNT_DIR"

_LOCK = threading.Lock()
_COUNTS: dict[str, int] = {}
_ROLES: dict[str, int] = {}
CRITIC_ENGINE_SUFFIX = "ValueHead"  # verl 0.9: MegatronEngineWithValueHead (FSDP: ...ValueHead too)


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


def caller_role(max_depth: int = 40) -> str:
    """'critic' if a caller up the stack is a method of verl's value-model engine, else 'policy'."""
    frame = sys._getframe(2)
    for _ in range(max_depth):
        if frame is None:
            break
        owner = frame.f_locals.get("self")
        if owner is not None and type(owner).__name__.endswith(CRITIC_ENGINE_SUFFIX):
            return "critic"
        frame = frame.f_back
    return "policy"


def _record(directory: Path, name: str) -> None:
    role = caller_role()
    with _LOCK:
        _COUNTS[name] = _COUNTS.get(name, 0) + 1
        _ROLES[role] = _ROLES.get(role, 0) + 1
        payload = json.dumps({"pid": os.getpid(), "counts": dict(_COUNTS), "roles": dict(_ROLES)}, sort_keys=True)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"{socket.gethostname()}-{os.getpid()}.json"
        staging = path.with_suffix(".tmp")
        staging.write_text(payload)
        os.replace(staging, path)


def read_call_counts(directory: str | Path, key: str = "counts") -> dict[str, int]:
    """Sum over every process that wrote into ``directory``: drop-in name -> calls (``key="roles"``: role -> calls)."""
    totals: dict[str, int] = {}
    for path in sorted(Path(directory).glob("*.json")):
        for name, calls in json.loads(path.read_text()).get(key, {}).items():
            totals[name] = totals.get(name, 0) + int(calls)
    return totals
