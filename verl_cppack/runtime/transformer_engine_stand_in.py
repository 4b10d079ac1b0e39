"""Row 21: stand-ins for Transformer Engine, which Megatron-Bridge imports at package import and the host lacks;
they exist only inside ``transformer_engine_scope()``, where ``megatron.bridge``'s package body runs."""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Iterator
from types import ModuleType
from typing import Any

PACKAGE = "transformer_engine"


class Absent:
    """A Transformer Engine name on the host: attributes are ``Absent``, usable as a base class; calling it raises."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attribute: str) -> Absent:
        if attribute.startswith("__"):
            raise AttributeError(attribute)
        return Absent(f"{self._name}.{attribute}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"{self._name} belongs to Transformer Engine, which is not installed: verl_cppack's CPU runtime stood in "
            "for it only so that Megatron-Bridge could be imported, and nothing may call it. Use a layer spec without "
            "Transformer Engine (the runtime's fix 'bridge-local-layer-spec')."
        )

    def __mro_entries__(self, bases: tuple[Any, ...]) -> tuple[type, ...]:
        return ()

    def __repr__(self) -> str:
        return f"<absent Transformer Engine name {self._name}>"


class _StandInModule(ModuleType):
    __version__ = "0.0.0"

    def __getattr__(self, attribute: str) -> Absent:
        return Absent(self.__name__).__getattr__(attribute)


class _StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname == PACKAGE or fullname.startswith(PACKAGE + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = _StandInModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: ModuleType) -> None:
        pass


@contextlib.contextmanager
def transformer_engine_scope() -> Iterator[None]:
    """Inside: ``import transformer_engine...`` gives stand-ins. After: neither the finder nor a stand-in is left."""
    finder = _StandInFinder()
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)
        for name in [name for name, module in sys.modules.items() if isinstance(module, _StandInModule)]:
            del sys.modules[name]
