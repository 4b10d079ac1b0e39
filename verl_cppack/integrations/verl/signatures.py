"""Whether a drop-in can stand in for one of verl's functions, judged from the two signatures alone: every call
verl's function accepts must bind the same way to the drop-in (verl's positional parameters first, same names and
order; keywords taken by keyword; verl's defaults equal and of the same type; the drop-in's other parameters
defaulted; no ``*args`` / ``**kwargs`` on verl's side). A newer verl with a parameter the drop-in does not know keeps
its own function. ``VerlFunction.from_source`` reads a function from its source (``verl-cppack doctor``).
"""

from __future__ import annotations

import ast
import inspect
from collections.abc import Callable
from dataclasses import dataclass

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
_BY_KEYWORD = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
_VARIADIC = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
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
        if parameter.default is not inspect.Parameter.empty and not _same_default(parameter.default, mine.default):
            return f"{parameter.name} defaults to {parameter.default!r} in verl, {mine.default!r} in the drop-in"
    required = [
        name
        for name, p in ours.items()
        if name not in verl_signature.parameters and p.kind not in _VARIADIC and p.default is inspect.Parameter.empty
    ]
    if required:
        return f"the drop-in requires parameters verl's function does not have: {', '.join(required)}"
    return None


def signature_from_source(node: ast.FunctionDef) -> inspect.Signature:
    """A function's signature read from its source (``ast``): names, kinds and the defaults that are literals (any
    other default is unknown, so it never counts as equal to a drop-in's)."""
    arguments = node.args

    def default(expression: ast.expr | None) -> object:
        if expression is None:
            return inspect.Parameter.empty
        try:
            return ast.literal_eval(expression)
        except ValueError:
            return _UNKNOWN_DEFAULT

    positional = [*arguments.posonlyargs, *arguments.args]
    positional_defaults = [None] * (len(positional) - len(arguments.defaults)) + list(arguments.defaults)
    parameters = [
        inspect.Parameter(
            argument.arg,
            inspect.Parameter.POSITIONAL_ONLY
            if index < len(arguments.posonlyargs)
            else inspect.Parameter.POSITIONAL_OR_KEYWORD,
            default=default(expression),
        )
        for index, (argument, expression) in enumerate(zip(positional, positional_defaults))
    ]
    if arguments.vararg is not None:
        parameters.append(inspect.Parameter(arguments.vararg.arg, inspect.Parameter.VAR_POSITIONAL))
    parameters += [
        inspect.Parameter(argument.arg, inspect.Parameter.KEYWORD_ONLY, default=default(expression))
        for argument, expression in zip(arguments.kwonlyargs, arguments.kw_defaults)
    ]
    if arguments.kwarg is not None:
        parameters.append(inspect.Parameter(arguments.kwarg.arg, inspect.Parameter.VAR_KEYWORD))
    return inspect.Signature(parameters)


@dataclass(frozen=True)
class VerlFunction:
    """What the plugin knows of one of verl's functions before replacing it: its signature (``None`` when it has
    none to read) and the names its body uses (globals and attributes), from the function or from its source."""

    signature: inspect.Signature | None
    names: frozenset[str]

    @classmethod
    def of(cls, function: Callable) -> VerlFunction:
        function = inspect.unwrap(function)
        try:
            signature = inspect.signature(function)
        except (TypeError, ValueError):
            signature = None
        code = getattr(function, "__code__", None)
        return cls(signature, frozenset(_code_names(code)) if code is not None else frozenset())

    @classmethod
    def from_source(cls, node: ast.FunctionDef) -> VerlFunction:
        names = {getattr(child, "id", None) or getattr(child, "attr", None) for child in ast.walk(node)}
        return cls(signature_from_source(node), frozenset(name for name in names if isinstance(name, str)))


def _code_names(code) -> set[str]:
    """The global and attribute names a code object and the code nested in it use."""
    names = set(code.co_names)
    for constant in code.co_consts:
        if hasattr(constant, "co_names"):
            names |= _code_names(constant)
    return names
