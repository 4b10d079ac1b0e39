"""``install()`` / ``uninstall()``: bind the drop-ins into verl, in every module that bound verl's util functions.

verl's callers bind util's functions at import time, so ``install`` patches util and every loaded module holding an
original (by identity), now or via ``import_hooks.after_import`` once util has run; verl is never imported here (safe
while ``verl/__init__`` runs). A function is replaced only if its drop-in takes every call it takes
(``incompatibility``), else ``status()["left_to_verl"]`` says why; ``DROPINS`` holds one variant per behaviour where
releases changed a name's results. On an untested release (or ``VERL_CPPACK_VERIFY=1``) each drop-in is bound inside
a ``runtime_check.VerifiedDropIn``."""

from __future__ import annotations

import ast
import contextlib
import importlib.metadata
import inspect
import os
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from inspect import Parameter
from pathlib import Path
from types import ModuleType
from typing import Any

from verl_cppack.integrations import megatron_bridge
from verl_cppack.integrations.import_hooks import after_import, cancel
from verl_cppack.integrations.verl import dropins, runtime_check, vlm_masks

UTIL_MODULE = "verl.models.mcore.util"
DISABLE_ENV = "VERL_CPPACK_DISABLE"
_POSITIONAL = (Parameter.POSITIONAL_ONLY, Parameter.POSITIONAL_OR_KEYWORD)
_BY_KEYWORD = (Parameter.POSITIONAL_OR_KEYWORD, Parameter.KEYWORD_ONLY)
_VARIADIC = (Parameter.VAR_POSITIONAL, Parameter.VAR_KEYWORD)
_UNKNOWN_DEFAULT = object()  # a default ``signature_from_source`` could not evaluate


def _same_default(verl_default: object, dropin_default: object) -> bool:
    if verl_default is _UNKNOWN_DEFAULT or type(verl_default) is not type(dropin_default):
        return False
    try:
        return bool(verl_default == dropin_default)
    except Exception:  # noqa: BLE001 - a default that cannot be compared is not known to be the same
        return False


def incompatibility(verl_signature: inspect.Signature, dropin_signature: inspect.Signature) -> str | None:
    """Why the drop-in cannot take every call verl's function takes, or ``None`` when it can."""
    verl_parameters = list(verl_signature.parameters.values())
    ours = dropin_signature.parameters
    variadic = [p.name for p in verl_parameters if p.kind in _VARIADIC]
    if variadic:
        return f"verl's function takes *args/**kwargs ({', '.join(variadic)}) the drop-in cannot know"
    unknown = [p.name for p in verl_parameters if p.name not in ours]
    if unknown:
        return f"parameters the drop-in does not know: {', '.join(unknown)}"
    verl_positional = [p.name for p in verl_parameters if p.kind in _POSITIONAL]
    our_positional = [p.name for p in ours.values() if p.kind in _POSITIONAL]
    if our_positional[: len(verl_positional)] != verl_positional:
        return (
            f"positional parameters differ: verl ({', '.join(verl_positional)}), drop-in ({', '.join(our_positional)})"
        )
    for parameter in verl_parameters:
        mine = ours[parameter.name]
        if parameter.kind in _BY_KEYWORD and mine.kind not in _BY_KEYWORD:
            return f"{parameter.name} is taken by keyword by verl, not by the drop-in"
        if parameter.default is not Parameter.empty and not _same_default(parameter.default, mine.default):
            return f"{parameter.name} defaults to {parameter.default!r} in verl, {mine.default!r} in the drop-in"
    required = [
        name
        for name, p in ours.items()
        if name not in verl_signature.parameters and p.kind not in _VARIADIC and p.default is Parameter.empty
    ]
    if required:
        return f"the drop-in requires parameters verl's function does not have: {', '.join(required)}"
    return None


def signature_from_source(node: ast.FunctionDef) -> inspect.Signature:
    """A function's signature from its ``ast``: names, kinds, literal defaults (others unknown: never equal to ours)."""
    arguments = node.args
    only, either = arguments.posonlyargs, arguments.args
    positional = [*only, *either]
    defaults = [None] * (len(positional) - len(arguments.defaults)) + arguments.defaults
    kinds = [Parameter.POSITIONAL_ONLY] * len(only) + [Parameter.POSITIONAL_OR_KEYWORD] * len(either)
    read = list(zip(positional, kinds, defaults))
    read += [(arguments.vararg, Parameter.VAR_POSITIONAL, None)] if arguments.vararg else []
    read += [(argument, Parameter.KEYWORD_ONLY, d) for argument, d in zip(arguments.kwonlyargs, arguments.kw_defaults)]
    read += [(arguments.kwarg, Parameter.VAR_KEYWORD, None)] if arguments.kwarg else []
    return inspect.Signature([Parameter(argument.arg, kind, default=_literal(d)) for argument, kind, d in read])


def _literal(expression: ast.expr | None) -> object:
    if expression is None:
        return Parameter.empty
    try:
        return ast.literal_eval(expression)
    except ValueError:
        return _UNKNOWN_DEFAULT


@dataclass(frozen=True)
class VerlFunction:
    """One of verl's functions: its signature (``None``: unreadable) and the global/attribute names its body uses."""

    signature: inspect.Signature | None
    names: frozenset[str]

    @classmethod
    def of(cls, function: Callable) -> VerlFunction:
        function = inspect.unwrap(function)
        try:
            signature = inspect.signature(function)
        except (TypeError, ValueError):
            signature = None
        return cls(signature, frozenset(_code_names(getattr(function, "__code__", None))))

    @classmethod
    def from_source(cls, node: ast.FunctionDef) -> VerlFunction:
        names = {getattr(child, "id", None) or getattr(child, "attr", None) for child in ast.walk(node)}
        return cls(signature_from_source(node), frozenset(name for name in names if isinstance(name, str)))


def _code_names(code) -> set[str]:
    """The global and attribute names a code object (or None) and the code nested in it use."""
    names = set(getattr(code, "co_names", ()))
    for constant in getattr(code, "co_consts", ()):
        if hasattr(constant, "co_names"):
            names |= _code_names(constant)
    return names


@dataclass(frozen=True)
class DropIn:
    """One drop-in for a verl name; ``fits`` tells verl's function apart where variants share a signature."""

    function: Callable[..., Any]
    fits: Callable[[VerlFunction], bool] | None = None
    misfit: str = ""


def _reads_parallel_sizes(verl: VerlFunction) -> bool:
    """verl 0.9.1's ``build_vlm_attn_mask_thd`` rounds its rows up to TP/CP sizes it reads; 0.8.0/0.9.0's does not."""
    return "get_context_parallel_world_size" in verl.names


# verl name -> its drop-ins, preferred first; every name a verl release from 0.6.1 to 0.9.1 defines for packing.
DROPINS: dict[str, tuple[DropIn, ...]] = {
    name: (DropIn(getattr(dropins, name)),)
    for names in (
        ("preprocess_packed_seqs", "postprocess_packed_seqs", "postprocess_packed_seqs_for_dict_output"),  # all
        ("preprocess_bshd", "postprocess_bshd", "remove_left_padding", "recover_left_padding"),  # 0.7+, 0.6
        ("preprocess_thd_engine", "postprocess_thd_engine", "preprocess_bshd_engine", "postprocess_bshd_engine"),
        ("postprocess_thd_no_padding", "preprocess_bshd_no_padding", "postprocess_bshd_no_padding"),  # 0.7
        ("preprocess_packed_seqs_no_padding", "postprocess_packed_seqs_no_padding"),  # 0.6
    )
    for name in names
}
DROPINS["preprocess_thd_no_padding"] = (  # verl 0.7.0: the pair; 0.7.1: the triple
    DropIn(dropins.preprocess_thd_no_padding_pair),
    DropIn(dropins.preprocess_thd_no_padding),
)
DROPINS["build_vlm_attn_mask_thd"] = (
    DropIn(vlm_masks.build_vlm_attn_mask_thd, _reads_parallel_sizes, "verl's does not round rows to TP/CP"),
    DropIn(vlm_masks.build_vlm_attn_mask_thd_unaligned, lambda v: not _reads_parallel_sizes(v), "verl's rounds rows"),
)
DROPINS["build_vlm_attn_mask_bshd"] = (DropIn(vlm_masks.build_vlm_attn_mask_bshd),)


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
    checks: dict[str, runtime_check.VerifiedDropIn] = field(default_factory=dict)  # verl name -> its check
    put_back: dict[str, str] = field(default_factory=dict)  # verl name -> the difference that put verl's back
    plain: dict[str, Callable[..., Any]] = field(default_factory=dict)  # verl name -> the drop-in, unwrapped


_STATE = PatchState()
_LOCK = threading.RLock()
_WRAPPERS: list[Callable[[str, Callable[..., Any]], Callable[..., Any]]] = []


def detect_generation(functions: Mapping[str, VerlFunction]) -> str:
    """verl util's API generation: 'engine' (>=0.8), 'no_padding' (0.7.1), 'no_padding_pair' (0.7.0),
    'packed_no_padding' (0.6) or 'legacy' (padded names only)."""
    if "preprocess_thd_engine" in functions:
        return "engine"
    if "preprocess_thd_no_padding" in functions:
        signature = functions["preprocess_thd_no_padding"].signature
        return "no_padding" if signature and "use_fp8_padding" in signature.parameters else "no_padding_pair"
    return "packed_no_padding" if "preprocess_packed_seqs_no_padding" in functions else "legacy"


def choose(name: str, verl: VerlFunction) -> tuple[DropIn | None, str | None]:
    """The first drop-in for ``name`` that stands in for verl's function, or ``(None, why none does)``."""
    if verl.signature is None:
        return None, "verl's function has no readable signature"
    reasons = {}  # (a dict: each reason once, in order)
    for candidate in DROPINS[name]:
        reason = incompatibility(verl.signature, inspect.signature(candidate.function))
        if reason is None and candidate.fits is not None and not candidate.fits(verl):
            reason = candidate.misfit
        if reason is None:
            return candidate, None
        reasons[reason] = None
    return None, "; ".join(reasons)


def plan_replacements(functions: Mapping[str, VerlFunction]) -> tuple[dict[str, DropIn], dict[str, str]]:
    """For verl's packing functions (by name): the drop-in each gets, and why the others stay verl's."""
    choices = {name: choose(name, verl) for name, verl in functions.items() if name in DROPINS}
    chosen = {name: dropin for name, (dropin, _) in choices.items() if dropin is not None}
    return chosen, {name: reason for name, (dropin, reason) in choices.items() if dropin is None}


def release_of(util: ModuleType) -> str | None:
    """verl's ``verl/version/version`` beside util's file (not importing ``verl``: its ``__init__`` may be running),
    else the distribution's version, else None."""
    with contextlib.suppress(AttributeError, TypeError, OSError, IndexError):  # no file (or None), no version file
        if text := (Path(util.__file__).resolve().parents[2] / "version" / "version").read_text().strip():
            return text
    try:
        return importlib.metadata.version("verl")
    except importlib.metadata.PackageNotFoundError:
        return None


def util_functions(util: ModuleType) -> dict[str, VerlFunction]:
    """The functions util defines under a ``DROPINS`` name (a name imported into util from elsewhere counts too)."""
    return {name: VerlFunction.of(value) for name, value in vars(util).items() if name in DROPINS and callable(value)}


def _patch_util(util: ModuleType) -> None:
    with _LOCK:
        if not _STATE.installed:
            return
        if _STATE.generation is None:  # not planned yet
            namespace, functions = vars(util), util_functions(util)
            _STATE.generation = detect_generation(functions)
            chosen, _STATE.left_to_verl = plan_replacements(functions)
            _STATE.release = release_of(util)
            _STATE.verifying = runtime_check.wanted(_STATE.release)
            _STATE.originals = {name: namespace[name] for name in chosen}
            for name, dropin in chosen.items():
                _bind(name, dropin.function)
        _patch_loaded_modules()


def _bind(name: str, plain: Callable[..., Any]) -> None:
    """Plan ``plain`` (the drop-in, wrapped by each of ``_WRAPPERS``) as the replacement of verl's ``name``."""
    for wrapper in _WRAPPERS:
        plain = wrapper(name, plain)
    _STATE.plain[name] = _STATE.replacements[name] = plain
    if _STATE.verifying:
        check = _STATE.checks[name] = runtime_check.VerifiedDropIn(
            name, _STATE.originals[name], plain, _STATE.release, on_put_back=put_back, on_step_aside=_rebind
        )
        _STATE.replacements[name] = check.function


def _foreign_namespaces() -> list[tuple[str, dict[str, Any]]]:
    """``(name, namespace)`` of every loaded module but verl_cppack's own."""
    return [
        (name, vars(module))
        for name, module in list(sys.modules.items())
        if isinstance(getattr(module, "__dict__", None), dict) and name.partition(".")[0] != "verl_cppack"
    ]


def _swap(name: str, old: Callable[..., Any], new: Callable[..., Any]) -> None:
    """Bind ``new`` instead of ``old`` under ``name`` in every loaded module that holds ``old``."""
    for _, namespace in _foreign_namespaces():
        if namespace.get(name) is old:
            namespace[name] = new


def put_back(name: str, reason: str) -> None:
    """verl's own ``name`` again for the rest of this process (everywhere, later imports too), ``reason`` recorded
    in ``status()["put_back"]``; nothing for a name that is not replaced."""
    with _LOCK:
        replacement, original = _STATE.replacements.pop(name, None), _STATE.originals.pop(name, None)
        if replacement is None or original is None:
            return
        _swap(name, replacement, original)
        _STATE.put_back[name] = reason
        check = _STATE.checks.get(name)
        if check is not None and check.put_back_reason is None:  # put back from outside the check
            check.put_back_reason = reason
        covered = {module: [n for n in names if n != name] for module, names in _STATE.covered.items()}
        _STATE.covered = {module: names for module, names in covered.items() if names}


def _rebind(name: str, function: Callable[..., Any]) -> None:
    """``function`` (the plain drop-in) instead of the checking wrapper, everywhere (the drop-in was verified)."""
    with _LOCK:
        if name in _STATE.replacements:
            _swap(name, _STATE.replacements[name], function)
            _STATE.replacements[name] = function


def _patch_loaded_modules() -> None:
    for module_name, namespace in _foreign_namespaces():
        replaced = []
        for name, original in _STATE.originals.items():
            if namespace.get(name) is original:
                namespace[name] = _STATE.replacements[name]
                _STATE.patched.add(module_name)
            if namespace.get(name) is _STATE.replacements[name]:
                replaced.append(name)
        if replaced:
            _STATE.covered[module_name] = sorted(replaced)


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
    """verl's functions back in every module ``install`` patched and every ``verl.*`` / ``recipe.*`` module holding
    a drop-in bound from util (not one imported by its own name). Idempotent."""
    megatron_bridge.uninstall()
    with _LOCK:
        cancel(UTIL_MODULE, _patch_util)
        for module_name, namespace in _foreign_namespaces():
            if module_name in _STATE.patched or module_name.startswith(("verl.", "recipe.")):
                for name, replacement in _STATE.replacements.items():
                    if namespace.get(name) is replacement:
                        namespace[name] = _STATE.originals[name]
        vars(_STATE).update(vars(PatchState()))
        dropins.clear_plan_caches()


def is_installed() -> bool:
    return _STATE.installed


def originals() -> dict[str, Callable[..., Any]]:
    """verl's own functions (by verl name) that ``install`` replaced; empty until util is loaded."""
    return dict(_STATE.originals)


def dropin_functions() -> dict[str, Callable[..., Any]]:
    """The drop-ins (by verl name, without the runtime check) standing in for ``originals()``."""
    with _LOCK:
        return {name: _STATE.plain[name] for name in _STATE.originals}


def wrap_dropins(wrapper: Callable[[str, Callable[..., Any]], Callable[..., Any]]) -> None:
    """Have ``wrapper(name, dropin)`` stand for every drop-in, bound now or later (a job's telemetry). Idempotent."""
    with _LOCK:
        if wrapper in _WRAPPERS:
            return
        _WRAPPERS.append(wrapper)
        for name, bound in list(_STATE.replacements.items()):
            plain = _STATE.plain[name] = wrapper(name, _STATE.plain[name])
            check = _STATE.checks.get(name)
            if check is not None:
                check.dropin = plain
            if check is None or bound is not check.function:
                _swap(name, bound, plain)
                _STATE.replacements[name] = plain


def status() -> dict[str, Any]:
    """What ``install`` did: the verl generation and release, modules patched (``covered``), functions left to
    verl and put back (name -> why), whether the drop-ins check themselves and each check's state."""
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
