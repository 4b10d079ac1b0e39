"""``install()`` / ``uninstall()``: swap verl's util functions for the drop-ins in every module that bound them.

verl's callers bind the functions at import time (``from .util import preprocess_packed_seqs`` in
``model_forward``, ``model_forward_fused``, ``model_forward_1f1b_overlap``, ``router_replay_utils``, the
distillation losses, VLM model files, recipes...). Replacing the attribute on ``util`` alone changes nothing
for a module that already imported it, so ``install``:

1. patches ``verl.models.mcore.util`` if it is imported, and every loaded module whose namespace holds one
   of the original function objects (found by identity, through ``vars(module)`` — no lazy ``__getattr__``
   is triggered);
2. asks ``integrations.import_hooks.after_import`` to patch ``verl.models.mcore.util`` the moment it finishes
   executing — so modules imported later bind the drop-ins directly. Nothing of verl is
   imported by ``install`` itself: it is safe while ``verl/__init__`` is still running
   (``VERL_USE_EXTERNAL_MODULES``).

The originals are kept (``originals()``) for fallback and A/B runs; ``uninstall`` puts them back everywhere.
``VERL_CPPACK_DISABLE=1`` makes ``install`` a no-op.
"""

from __future__ import annotations

import inspect
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from verl_cppack.integrations.import_hooks import after_import, cancel
from verl_cppack.integrations.verl import dropins
from verl_cppack.integrations.verl.call_counts import counted

UTIL_MODULE = "verl.models.mcore.util"
DISABLE_ENV = "VERL_CPPACK_DISABLE"

# verl name -> drop-in, for every name any verl release defines (only the names util has are replaced).
DROPINS: dict[str, Callable[..., Any]] = {
    "preprocess_packed_seqs": dropins.preprocess_packed_seqs,
    "postprocess_packed_seqs": dropins.postprocess_packed_seqs,
    "preprocess_bshd": dropins.preprocess_bshd,
    "postprocess_bshd": dropins.postprocess_bshd,
    "postprocess_packed_seqs_for_dict_output": dropins.postprocess_packed_seqs_for_dict_output,
    "preprocess_thd_no_padding": dropins.preprocess_thd_no_padding,
    "postprocess_thd_no_padding": dropins.postprocess_thd_no_padding,
    "preprocess_bshd_no_padding": dropins.preprocess_bshd_no_padding,
    "postprocess_bshd_no_padding": dropins.postprocess_bshd_no_padding,
    "preprocess_thd_engine": dropins.preprocess_thd_engine,
    "postprocess_thd_engine": dropins.postprocess_thd_engine,
    "preprocess_bshd_engine": dropins.preprocess_bshd_engine,
    "postprocess_bshd_engine": dropins.postprocess_bshd_engine,
}


@dataclass
class PatchState:
    installed: bool = False
    generation: str | None = None  # detected verl util API generation, once util is loaded
    originals: dict[str, Callable[..., Any]] = field(default_factory=dict)  # verl name -> verl's function
    replacements: dict[str, Callable[..., Any]] = field(default_factory=dict)  # verl name -> what we put in
    covered: dict[str, list[str]] = field(default_factory=dict)  # module name -> drop-in names it holds
    patched: set[str] = field(default_factory=set)  # modules where install replaced an original


_STATE = PatchState()
_LOCK = threading.RLock()


# ================================================================ generations
def detect_generation(util: ModuleType) -> str:
    """verl util API generation from the names it defines: 'engine' (>=0.8), 'no_padding' (0.7.1, 3-tuple),
    'no_padding_pair' (0.7.0, 2-tuple) or 'legacy' (padded names only)."""
    names = vars(util)
    if "preprocess_thd_engine" in names:
        return "engine"
    if "preprocess_thd_no_padding" in names:
        parameters = inspect.signature(names["preprocess_thd_no_padding"]).parameters
        return "no_padding" if "use_fp8_padding" in parameters else "no_padding_pair"
    return "legacy"


def _replacements_for(util: ModuleType, generation: str) -> dict[str, Callable[..., Any]]:
    names = vars(util)
    chosen = {name: dropin for name, dropin in DROPINS.items() if callable(names.get(name))}
    if generation == "no_padding_pair":
        chosen["preprocess_thd_no_padding"] = dropins.preprocess_thd_no_padding_pair
    return {name: counted(name, dropin) for name, dropin in chosen.items()}  # counted only when asked


# =================================================================== patching
def _patch_util(util: ModuleType) -> None:
    with _LOCK:
        if not _STATE.installed:
            return
        if not _STATE.originals:
            namespace = vars(util)
            _STATE.generation = detect_generation(util)
            _STATE.replacements = _replacements_for(util, _STATE.generation)
            _STATE.originals = {name: namespace[name] for name in _STATE.replacements}
        _patch_loaded_modules()


def _own(module_name: str) -> bool:
    return module_name == "verl_cppack" or module_name.startswith("verl_cppack.")


def _patch_module(module: ModuleType) -> None:
    namespace = getattr(module, "__dict__", None)
    module_name = getattr(module, "__name__", None)
    if not isinstance(namespace, dict) or not isinstance(module_name, str) or _own(module_name):
        return
    replaced = []
    for name, original in _STATE.originals.items():
        if namespace.get(name) is original:
            namespace[name] = _STATE.replacements[name]
            replaced.append(name)
            _STATE.patched.add(module_name)
        elif namespace.get(name) is _STATE.replacements[name]:
            replaced.append(name)
    if replaced:
        _STATE.covered[module_name] = sorted(replaced)


def _patch_loaded_modules() -> None:
    for module in list(sys.modules.values()):
        if module is not None:
            _patch_module(module)




# ================================================================= public API
def disabled_by_env() -> bool:
    """``VERL_CPPACK_DISABLE`` set to 1/true/yes/on: ``install`` does nothing."""
    return os.environ.get(DISABLE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def install() -> bool:
    """Patch verl (now and on later imports). Idempotent. Returns False when ``VERL_CPPACK_DISABLE=1``."""
    if disabled_by_env():
        return False
    with _LOCK:
        _STATE.installed = True
        after_import(UTIL_MODULE, _patch_util)  # now if util is loaded, else right after it executes
    return True


def uninstall() -> None:
    """Put verl's original functions back and cancel the pending patch of util. Idempotent.

    Restored: every module where ``install`` replaced an original, and every ``verl.*`` / ``recipe.*``
    module that bound a drop-in from util after the install. Other modules that imported the drop-ins by
    their ``verl_cppack`` names keep them (that is what they asked for).
    """
    with _LOCK:
        cancel(UTIL_MODULE, _patch_util)
        for module_name, module in list(sys.modules.items()):
            namespace = getattr(module, "__dict__", None) if module is not None else None
            if not isinstance(namespace, dict) or _own(module_name):
                continue
            if module_name not in _STATE.patched and not module_name.startswith(("verl.", "recipe.")):
                continue
            for name, replacement in _STATE.replacements.items():
                if namespace.get(name) is replacement and name in _STATE.originals:
                    namespace[name] = _STATE.originals[name]
        _STATE.installed = False
        _STATE.originals, _STATE.replacements, _STATE.covered, _STATE.patched = {}, {}, {}, set()
        _STATE.generation = None
        dropins.clear_plan_caches()


def is_installed() -> bool:
    return _STATE.installed


def originals() -> dict[str, Callable[..., Any]]:
    """verl's own functions (by verl name) that ``install`` replaced; empty until util is loaded."""
    return dict(_STATE.originals)


def status() -> dict[str, Any]:
    """What ``install`` did: installed, the verl API generation, and the modules (and names) patched."""
    with _LOCK:
        if _STATE.installed and _STATE.originals:
            _patch_loaded_modules()  # modules that imported the drop-ins from util after install
        return {
            "installed": _STATE.installed,
            "generation": _STATE.generation,
            "util_loaded": UTIL_MODULE in sys.modules,
            "covered": {name: list(names) for name, names in sorted(_STATE.covered.items())},
            "disabled_by_env": disabled_by_env(),
        }
