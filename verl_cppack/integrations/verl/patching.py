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

Before a function is replaced, its signature is compared with the drop-in's (``signatures.incompatibility``): a
function with parameters the drop-in does not know stays verl's, and ``status()["left_to_verl"]`` (and
``verl-cppack doctor``) says why. Where releases kept a name but changed what it returns or pads, ``DROPINS``
holds one variant per behaviour and the first that fits verl's function is taken.

On a verl release the release matrix does not test, and with ``VERL_CPPACK_VERIFY=1``, each drop-in is installed
inside a ``verification.VerifiedDropIn``: it checks its first calls against verl's function and, on a difference,
verl's function is put back in every module that bound it (``status()["put_back"]``); once verified, the plain
drop-in replaces the wrapper. On the tested releases (the default) the drop-ins are bound unwrapped.

The originals are kept (``originals()``) for fallback and A/B runs; ``uninstall`` puts them back everywhere.
``VERL_CPPACK_DISABLE=1`` makes ``install`` a no-op.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import os
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from verl_cppack.integrations import megatron_bridge
from verl_cppack.integrations.import_hooks import after_import, cancel
from verl_cppack.integrations.verl import dropins, release_names, verification, vlm_masks
from verl_cppack.integrations.verl.call_counts import counted
from verl_cppack.integrations.verl.signatures import VerlFunction, incompatibility

UTIL_MODULE = "verl.models.mcore.util"
DISABLE_ENV = "VERL_CPPACK_DISABLE"


@dataclass(frozen=True)
class DropIn:
    """One drop-in for a verl name. ``fits``: for variants whose signature is the same as another's, what tells
    verl's function apart (``misfit`` says it when it does not hold)."""

    function: Callable[..., Any]
    fits: Callable[[VerlFunction], bool] | None = None
    misfit: str = ""


def _reads_parallel_sizes(verl: VerlFunction) -> bool:
    """verl 0.9.1's ``build_vlm_attn_mask_thd`` rounds its rows up to TP/CP sizes it reads; 0.8.0/0.9.0's does not."""
    return "get_context_parallel_world_size" in verl.names


# verl name -> its drop-ins, preferred first; every name a verl release from 0.6.1 to 0.9.1 defines for packing.
DROPINS: dict[str, tuple[DropIn, ...]] = {
    "preprocess_packed_seqs": (DropIn(dropins.preprocess_packed_seqs),),
    "postprocess_packed_seqs": (DropIn(dropins.postprocess_packed_seqs),),
    "postprocess_packed_seqs_for_dict_output": (DropIn(dropins.postprocess_packed_seqs_for_dict_output),),
    "preprocess_bshd": (DropIn(dropins.preprocess_bshd),),
    "postprocess_bshd": (DropIn(dropins.postprocess_bshd),),
    "preprocess_thd_engine": (DropIn(dropins.preprocess_thd_engine),),
    "postprocess_thd_engine": (DropIn(dropins.postprocess_thd_engine),),
    "preprocess_bshd_engine": (DropIn(dropins.preprocess_bshd_engine),),
    "postprocess_bshd_engine": (DropIn(dropins.postprocess_bshd_engine),),
    "build_vlm_attn_mask_thd": (
        DropIn(vlm_masks.build_vlm_attn_mask_thd, _reads_parallel_sizes, "verl's does not round rows to TP/CP"),
        DropIn(
            vlm_masks.build_vlm_attn_mask_thd_unaligned,
            lambda verl: not _reads_parallel_sizes(verl),
            "verl's rounds rows to TP/CP",
        ),
    ),
    "build_vlm_attn_mask_bshd": (DropIn(vlm_masks.build_vlm_attn_mask_bshd),),
    # verl 0.7
    "preprocess_thd_no_padding": (
        DropIn(release_names.preprocess_thd_no_padding_pair),  # 0.7.0: the pair
        DropIn(release_names.preprocess_thd_no_padding),  # 0.7.1: the triple
    ),
    "postprocess_thd_no_padding": (DropIn(release_names.postprocess_thd_no_padding),),
    "preprocess_bshd_no_padding": (DropIn(release_names.preprocess_bshd_no_padding),),
    "postprocess_bshd_no_padding": (DropIn(release_names.postprocess_bshd_no_padding),),
    # verl 0.6
    "preprocess_packed_seqs_no_padding": (DropIn(release_names.preprocess_packed_seqs_no_padding),),
    "postprocess_packed_seqs_no_padding": (DropIn(release_names.postprocess_packed_seqs_no_padding),),
    "remove_left_padding": (DropIn(release_names.remove_left_padding),),
    "recover_left_padding": (DropIn(release_names.recover_left_padding),),
}


# util's public functions that pack nothing (an Ascend hook that returns None); any other public util function
# without a drop-in is reported by ``verl-cppack doctor`` as unknown (and stays verl's)
NOT_PACKING = frozenset({"preprocess_for_mindspeed"})


@dataclass
class PatchState:
    installed: bool = False
    generation: str | None = None  # detected verl util API generation, once util is loaded
    originals: dict[str, Callable[..., Any]] = field(default_factory=dict)  # verl name -> verl's function
    replacements: dict[str, Callable[..., Any]] = field(default_factory=dict)  # verl name -> what we put in
    left_to_verl: dict[str, str] = field(default_factory=dict)  # verl name -> why its drop-in does not stand in
    covered: dict[str, list[str]] = field(default_factory=dict)  # module name -> drop-in names it holds
    patched: set[str] = field(default_factory=set)  # modules where install replaced an original
    release: str | None = None  # verl's version, read beside util once util is loaded
    verifying: bool = False  # the drop-ins were installed inside a VerifiedDropIn
    checks: dict[str, verification.VerifiedDropIn] = field(default_factory=dict)  # verl name -> its check
    put_back: dict[str, str] = field(default_factory=dict)  # verl name -> the difference that put verl's back
    plain: dict[str, Callable[..., Any]] = field(default_factory=dict)  # verl name -> the drop-in, unwrapped


_STATE = PatchState()
_LOCK = threading.RLock()


# ================================================================ generations
def detect_generation(functions: Mapping[str, VerlFunction]) -> str:
    """verl util API generation from the packing functions it defines: 'engine' (>=0.8), 'no_padding' (0.7.1,
    3-tuple), 'no_padding_pair' (0.7.0, 2-tuple), 'packed_no_padding' (0.6) or 'legacy' (padded names only)."""
    if "preprocess_thd_engine" in functions:
        return "engine"
    if "preprocess_thd_no_padding" in functions:
        signature = functions["preprocess_thd_no_padding"].signature
        return (
            "no_padding" if signature is not None and "use_fp8_padding" in signature.parameters else "no_padding_pair"
        )
    if "preprocess_packed_seqs_no_padding" in functions:
        return "packed_no_padding"
    return "legacy"


def choose(name: str, verl: VerlFunction) -> tuple[DropIn | None, str | None]:
    """The first drop-in for ``name`` that stands in for verl's function, or ``(None, why none does)``."""
    reasons = []
    for candidate in DROPINS[name]:
        if verl.signature is None:
            return None, "verl's function has no readable signature"
        reason = incompatibility(verl.signature, inspect.signature(candidate.function))
        if reason is None and candidate.fits is not None and not candidate.fits(verl):
            reason = candidate.misfit
        if reason is None:
            return candidate, None
        if reason not in reasons:
            reasons.append(reason)
    return None, "; ".join(reasons)


def plan_replacements(functions: Mapping[str, VerlFunction]) -> tuple[dict[str, DropIn], dict[str, str]]:
    """For verl's packing functions (by name): the drop-in each gets, and why the others stay verl's."""
    chosen, left = {}, {}
    for name, verl in functions.items():
        if name not in DROPINS:
            continue
        dropin, reason = choose(name, verl)
        if dropin is None:
            left[name] = reason
        else:
            chosen[name] = dropin
    return chosen, left


def release_of(util: ModuleType) -> str | None:
    """verl's version as its package states it (``verl/version/version``, what ``verl.__version__`` reads), read
    beside util's file without importing ``verl`` (its ``__init__`` may still be running); else the installed
    distribution's version; None when neither is there."""
    util_file = getattr(util, "__file__", None)
    if util_file:
        try:
            text = (Path(util_file).resolve().parents[2] / "version" / "version").read_text().strip()
        except (OSError, IndexError):
            text = ""
        if text:
            return text
    try:
        return importlib.metadata.version("verl")
    except importlib.metadata.PackageNotFoundError:
        return None


def util_functions(util: ModuleType) -> dict[str, VerlFunction]:
    """The functions util defines under a ``DROPINS`` name (a name imported into util from elsewhere counts too)."""
    return {name: VerlFunction.of(value) for name, value in vars(util).items() if name in DROPINS and callable(value)}


# =================================================================== patching
def _patch_util(util: ModuleType) -> None:
    with _LOCK:
        if not _STATE.installed:
            return
        if _STATE.generation is None:  # not planned yet
            namespace, functions = vars(util), util_functions(util)
            _STATE.generation = detect_generation(functions)
            chosen, _STATE.left_to_verl = plan_replacements(functions)
            _STATE.release = release_of(util)
            _STATE.verifying = verification.wanted(_STATE.release)
            _STATE.originals = {name: namespace[name] for name in chosen}
            for name, dropin in chosen.items():
                # counted only when asked (call_counts); the signature was checked on the drop-in itself
                plain = counted(name, dropin.function)
                _STATE.plain[name] = plain
                if _STATE.verifying:
                    check = verification.VerifiedDropIn(
                        name, namespace[name], plain, _STATE.release, on_put_back=_put_back, on_step_aside=_rebind
                    )
                    _STATE.checks[name] = check
                    _STATE.replacements[name] = check.function
                else:
                    _STATE.replacements[name] = plain
        _patch_loaded_modules()


def _swap(name: str, old: Callable[..., Any], new: Callable[..., Any]) -> None:
    """Bind ``new`` instead of ``old`` under ``name`` in every loaded module that holds ``old``."""
    for module_name, module in list(sys.modules.items()):
        namespace = getattr(module, "__dict__", None) if module is not None else None
        if isinstance(namespace, dict) and not _own(module_name) and namespace.get(name) is old:
            namespace[name] = new


def _put_back(name: str, reason: str) -> None:
    """verl's own function under ``name`` again, everywhere and for every later import (a verification found a
    difference)."""
    with _LOCK:
        replacement, original = _STATE.replacements.pop(name, None), _STATE.originals.pop(name, None)
        if replacement is None or original is None:
            return
        _swap(name, replacement, original)
        _STATE.put_back[name] = reason
        check = _STATE.checks.get(name)
        if check is not None and check.put_back_reason is None:  # put back from outside the check (self_check)
            check.put_back_reason = reason
        for module_name, names in list(_STATE.covered.items()):
            if name in names:
                names.remove(name)
                if not names:
                    del _STATE.covered[module_name]


def _rebind(name: str, function: Callable[..., Any]) -> None:
    """``function`` (the plain drop-in) instead of the verifying wrapper, everywhere (the drop-in was verified)."""
    with _LOCK:
        replacement = _STATE.replacements.get(name)
        if replacement is None:
            return
        _swap(name, replacement, function)
        _STATE.replacements[name] = function


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
    megatron_bridge.install()  # the packing copies inside Megatron-Bridge's models, which verl's calls reach
    return True


def uninstall() -> None:
    """Put verl's original functions back and cancel the pending patch of util. Idempotent.

    Restored: every module where ``install`` replaced an original, and every ``verl.*`` / ``recipe.*``
    module that bound a drop-in from util after the install. Other modules that imported the drop-ins by
    their ``verl_cppack`` names keep them (that is what they asked for).
    """
    megatron_bridge.uninstall()
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
        _STATE.left_to_verl = {}
        _STATE.generation = None
        _STATE.release, _STATE.verifying, _STATE.checks, _STATE.put_back, _STATE.plain = None, False, {}, {}, {}
        dropins.clear_plan_caches()


def is_installed() -> bool:
    return _STATE.installed


def originals() -> dict[str, Callable[..., Any]]:
    """verl's own functions (by verl name) that ``install`` replaced; empty until util is loaded."""
    return dict(_STATE.originals)


def dropin_functions() -> dict[str, Callable[..., Any]]:
    """The drop-ins (by verl name, unwrapped) standing in for ``originals()``; empty until util is loaded."""
    with _LOCK:
        return {name: _STATE.plain[name] for name in _STATE.originals}


def put_back(name: str, reason: str) -> None:
    """Put verl's own ``name`` back for the rest of this process (everywhere, later imports too), recording
    ``reason`` in ``status()["put_back"]``. Nothing happens for a name that is not replaced."""
    _put_back(name, reason)


def status() -> dict[str, Any]:
    """What ``install`` did: installed, the verl API generation and release, the modules (and names) patched, the
    verl functions left to verl (name -> why the drop-in does not stand in), whether the drop-ins verify
    themselves, those put back after a difference (name -> the first difference) and each check's state."""
    with _LOCK:
        if _STATE.installed and _STATE.originals:
            _patch_loaded_modules()  # modules that imported the drop-ins from util after install
        return {
            "installed": _STATE.installed,
            "generation": _STATE.generation,
            "util_loaded": UTIL_MODULE in sys.modules,
            "covered": {name: list(names) for name, names in sorted(_STATE.covered.items())},
            "left_to_verl": dict(sorted(_STATE.left_to_verl.items())),
            "disabled_by_env": disabled_by_env(),
            "release": _STATE.release,
            "verifying": _STATE.verifying,
            "put_back": dict(sorted(_STATE.put_back.items())),
            "verification": {name: check.state() for name, check in sorted(_STATE.checks.items())},
        }
