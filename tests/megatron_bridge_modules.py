"""Megatron-Bridge's modules as installed, loaded on the CPU without the package ``__init__``.

``import megatron.bridge`` imports Transformer Engine (``peft/lora_layers.py``), which has no CPU build. A single
module needs none of that: empty package objects stand in ``sys.modules`` for ``megatron.bridge`` and the packages
above the module, each with its ``__path__`` at the installed folder, and the module itself is imported as it is.
The tests that use this skip where Megatron-Bridge is not installed (the pinned stack: it needs Python 3.12).
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import sys
import types
from pathlib import Path

import pytest

QWEN3_VL = "megatron.bridge.models.qwen_vl.modelling_qwen3_vl"


def bridge_root() -> Path | None:
    """The installed ``megatron/bridge`` folder, or None."""
    megatron = importlib.util.find_spec("megatron")
    for location in (megatron.submodule_search_locations or []) if megatron else []:
        candidate = Path(location) / "bridge"
        if (candidate / "__init__.py").is_file():
            return candidate
    return None


def load(module_name: str) -> types.ModuleType:
    """``module_name`` (under ``megatron.bridge``) as installed, its packages' ``__init__`` files not run."""
    root = bridge_root()
    if root is None:
        pytest.skip(
            "Megatron-Bridge is not installed (the current stack has it: STACK=current)", allow_module_level=True
        )
    if module_name in sys.modules:
        return sys.modules[module_name]
    import megatron.core  # noqa: F401 - megatron's own package first, as the bridge expects

    parts = module_name.split(".")
    for depth in range(2, len(parts)):
        package = ".".join(parts[:depth])
        if package not in sys.modules:
            stand_in = types.ModuleType(package)
            stand_in.__path__ = [str(root.joinpath(*parts[2:depth]))]
            stand_in.__spec__ = importlib.machinery.ModuleSpec(package, None, is_package=True)
            sys.modules[package] = stand_in
    return importlib.import_module(module_name)
