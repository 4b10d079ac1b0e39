"""A job's count of the drop-in calls verl makes in each process, for jobs that must prove the drop-ins ran.

Each process's record goes to Ray's key-value store under ``$VERL_CPPACK_CALL_COUNT_RAY_KEY`` (when connected),
else to ``$VERL_CPPACK_CALL_COUNT_DIR/<host>-<pid>.json``; without either variable nothing is counted."""

from __future__ import annotations

import functools
import json
import os
import socket
import sys
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from verl_cppack.integrations.verl import patching

COUNT_DIR_ENV = "VERL_CPPACK_CALL_COUNT_DIR"
COUNT_RAY_KEY_ENV = "VERL_CPPACK_CALL_COUNT_RAY_KEY"
RAY_NAMESPACE = "verl_cppack"

_LOCK = threading.Lock()
_COUNTS: dict[str, int] = {}
_ROLES: dict[str, int] = {}
_PACKAGE_DIR = os.path.dirname(os.path.abspath(sys.modules[__name__.partition(".")[0]].__file__))  # verl_cppack/
CRITIC_ENGINE_SUFFIX = "ValueHead"  # verl 0.9: MegatronEngineWithValueHead (FSDP: ...ValueHead too)


def count_directory() -> Path | None:
    value = os.environ.get(COUNT_DIR_ENV, "").strip()
    return Path(value) if value else None


def _ray_key() -> str | None:
    return os.environ.get(COUNT_RAY_KEY_ENV, "").strip() or None


def counted(name: str, dropin: Callable[..., Any]) -> Callable[..., Any]:
    """``dropin`` itself when counting is off, else a wrapper that counts its calls under ``name``."""
    if count_directory() is None and _ray_key() is None:
        return dropin

    @functools.wraps(dropin)
    def counting(*args: Any, **kwargs: Any) -> Any:
        result = dropin(*args, **kwargs)
        _record(name)
        return result

    return counting


# Ray's key-value store has no public API: private ray.experimental.internal_kv functions (Ray 2.x), checked first
RAY_KV_FUNCTIONS = ("_internal_kv_put", "_internal_kv_get", "_internal_kv_list", "_internal_kv_del")


def ray_key_value() -> Any:
    """``ray.experimental.internal_kv``, checked to have ``RAY_KV_FUNCTIONS`` (else a ``RuntimeError`` naming them)."""
    from ray.experimental import internal_kv

    missing = [name for name in RAY_KV_FUNCTIONS if not callable(getattr(internal_kv, name, None))]
    if missing:
        import ray

        raise RuntimeError(
            f"{COUNT_RAY_KEY_ENV} needs ray.experimental.internal_kv.{', '.join(missing)}, which Ray "
            f"{getattr(ray, '__version__', '?')} lacks (Ray 2.x has them); unset {COUNT_RAY_KEY_ENV} and set "
            f"{COUNT_DIR_ENV} to a shared directory instead"
        )
    return internal_kv


def caller_role(max_depth: int = 40) -> str:
    """'critic' if a caller up the stack is a method of verl's value-model engine, else 'policy'."""
    get_frame = getattr(sys, "_getframe", None)  # CPython's (and PyPy's); documented, yet an implementation detail
    if get_frame is None:
        raise RuntimeError(
            "counting drop-in calls by role reads the caller's frames (sys._getframe), which this Python lacks; "
            f"unset {COUNT_DIR_ENV} and {COUNT_RAY_KEY_ENV}"
        )
    frame = get_frame(2)
    for _ in range(max_depth):
        if frame is None:
            break
        owner = frame.f_locals.get("self")
        if owner is not None and type(owner).__name__.endswith(CRITIC_ENGINE_SUFFIX):
            return "critic"
        frame = frame.f_back
    return "policy"


def _connected_ray() -> Any:
    """The ``ray`` module when this process is connected to a Ray cluster (it is never imported here)."""
    ray = sys.modules.get("ray")
    return ray if ray is not None and ray.is_initialized() else None


def _record(name: str) -> None:
    role = caller_role()
    with _LOCK:
        _COUNTS[name] = _COUNTS.get(name, 0) + 1
        _ROLES[role] = _ROLES.get(role, 0) + 1
        ray, key = _connected_ray(), _ray_key()
        node = ray.get_runtime_context().get_node_id() if ray is not None else socket.gethostname()
        payload = json.dumps(
            {
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "node": node,
                "gloo_interface": os.environ.get("GLOO_SOCKET_IFNAME"),
                "working_dir": os.getcwd(),
                "package_dir": _PACKAGE_DIR,
                "counts": dict(_COUNTS),
                "roles": dict(_ROLES),
            },
            sort_keys=True,
        )
        if ray is not None and key is not None:
            ray_key_value()._internal_kv_put(f"{key}/{node}/{os.getpid()}", payload, namespace=RAY_NAMESPACE)
            return
        directory = count_directory()
        if directory is None:  # asked for Ray's store outside Ray: a process verl runs without a cluster
            return
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"{socket.gethostname()}-{os.getpid()}.json"
        staging = path.with_suffix(".tmp")
        staging.write_text(payload)
        os.replace(staging, path)


def read_call_records(directory: str | Path) -> list[dict[str, Any]]:
    """Every process's record written into ``directory`` (none if it does not exist)."""
    return [json.loads(path.read_text()) for path in sorted(Path(directory).glob("*.json"))]


def read_ray_call_records(key: str, delete: bool = False) -> list[dict[str, Any]]:
    """Every process's record published under ``key`` in the connected Ray cluster (``delete``: then remove them)."""
    internal_kv = ray_key_value()
    names = sorted(internal_kv._internal_kv_list(f"{key}/", namespace=RAY_NAMESPACE))
    records = []
    for entry in names:
        value = internal_kv._internal_kv_get(entry, namespace=RAY_NAMESPACE)
        if value is not None:
            records.append(json.loads(value))
        if delete:
            internal_kv._internal_kv_del(entry, namespace=RAY_NAMESPACE)
    return records


def sum_calls(records: Iterable[dict[str, Any]], key: str = "counts") -> dict[str, int]:
    """Sum over records: drop-in name -> calls (``key="roles"``: role -> calls)."""
    totals: dict[str, int] = {}
    for record in records:
        for name, calls in record.get(key, {}).items():
            totals[name] = totals.get(name, 0) + int(calls)
    return totals


def read_call_counts(directory: str | Path, key: str = "counts") -> dict[str, int]:
    """Sum over every process that wrote into ``directory``: drop-in name -> calls (``key="roles"``: role -> calls)."""
    return sum_calls(read_call_records(directory), key)


patching.wrap_dropins(counted)
