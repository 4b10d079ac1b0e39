"""Run a callback on a module the moment it has finished executing, whether it is imported now or later.

A ``sys.meta_path`` finder wraps the module's loader (nothing is imported to find out); a callback's exception
propagates through the import."""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import sys
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from types import ModuleType
from typing import Any

Callback = Callable[[ModuleType], None]

_LOCK = threading.RLock()
_PENDING: dict[str, list[Callback]] = {}
_AROUND: dict[str, Callable[[], AbstractContextManager[Any]]] = {}


def around_import(module_name: str, scope: Callable[[], AbstractContextManager[Any]]) -> bool:
    """Run ``module_name``'s body inside ``with scope():`` when first imported; False (nothing done) if it is."""
    with _LOCK:
        if module_name in sys.modules:
            return False
        _AROUND[module_name] = scope
        if _FINDER not in sys.meta_path:
            sys.meta_path.insert(0, _FINDER)
        return True


def after_import(module_name: str, callback: Callback) -> None:
    """Call ``callback(module)`` once ``module_name`` has executed: now if it has, else when it does."""
    with _LOCK:
        module = sys.modules.get(module_name)
        if module is not None and not getattr(getattr(module, "__spec__", None), "_initializing", False):
            callback(module)
            return
        pending = _PENDING.setdefault(module_name, [])
        if callback not in pending:
            pending.append(callback)
        if _FINDER not in sys.meta_path:
            sys.meta_path.insert(0, _FINDER)


def cancel(module_name: str, callback: Callback) -> None:
    """Forget a pending ``after_import(module_name, callback)`` (no-op if it already ran or was never asked)."""
    with _LOCK:
        pending = _PENDING.get(module_name, [])
        if callback in pending:
            pending.remove(callback)
        if not pending:
            _PENDING.pop(module_name, None)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _PENDING and fullname not in _AROUND:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is None:
                continue
            if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                spec.loader = _CallbackLoader(spec.loader)
            return spec
        return None


class _CallbackLoader(importlib.abc.Loader):
    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        with _LOCK:
            scope = _AROUND.pop(module.__name__, contextlib.nullcontext)
        with scope():
            self._loader.exec_module(module)
        with _LOCK:
            callbacks = _PENDING.pop(module.__name__, [])
        for callback in callbacks:
            callback(module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_code, ... for tools that ask
        return getattr(self._loader, name)


_FINDER = _Finder()
