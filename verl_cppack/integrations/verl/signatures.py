"""Whether a drop-in can stand in for one of verl's functions, judged from the two signatures alone.

A drop-in stands in for verl's function when every call verl's function accepts binds the same way to the drop-in:

- verl's positional parameters are the drop-in's first positional parameters, same names, same order;
- every parameter verl's function takes by keyword, the drop-in takes by keyword;
- every default verl's function has, the drop-in has too, equal and of the same type;
- the drop-in's other parameters all have defaults;
- verl's function takes no ``*args`` / ``**kwargs`` (what it would do with them is not known).

``incompatibility(verl_signature, dropin_signature)`` returns why not (``None`` when it stands in). A newer verl
that adds a parameter the drop-in does not know keeps its own function: slower, never crashing.
``signature_from_source`` reads a signature from a function's source, so ``verl-cppack doctor`` can tell without
importing verl.
"""

from __future__ import annotations

import ast
import inspect
from collections.abc import Callable

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
_BY_KEYWORD = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
_VARIADIC = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
_UNKNOWN_DEFAULT = object()  # a default ``signature_from_source`` could not evaluate


def _same_default(verl_default: object, dropin_default: object) -> bool:
    if verl_default is _UNKNOWN_DEFAULT:
        return False
    if type(verl_default) is not type(dropin_default):
        return False
    try:
        return bool(verl_default == dropin_default)
    except Exception:  # noqa: BLE001 - a default that cannot be compared is not known to be the same
        return False


def describe(signature: inspect.Signature) -> str:
    """``(name, name=default, ...)`` without annotations."""
    parts = []
    for parameter in signature.parameters.values():
        text = (
            parameter.name
            if parameter.kind not in _VARIADIC
            else str(parameter.replace(annotation=inspect.Parameter.empty))
        )
        if parameter.default is _UNKNOWN_DEFAULT:
            text += "=?"
        elif parameter.default is not inspect.Parameter.empty:
            text += f"={parameter.default!r}"
        parts.append(text)
    return f"({', '.join(parts)})"


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


class VerlFunction:
    """What the plugin knows of one of verl's functions before replacing it: its signature (``None`` when it has
    none to read) and the names its body uses (globals and attributes: ``mpu.get_context_parallel_world_size``
    counts as both), read from the function (``of``) or from its source (``from_source``)."""

    __slots__ = ("signature", "names")

    def __init__(self, signature: inspect.Signature | None, names: frozenset[str]) -> None:
        self.signature = signature
        self.names = names

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
        names = set()
        for child in ast.walk(node):
            if isinstance(child, ast.Name):
                names.add(child.id)
            elif isinstance(child, ast.Attribute):
                names.add(child.attr)
        return cls(signature_from_source(node), frozenset(names))


def _code_names(code) -> set[str]:
    """The global and attribute names a code object and the code nested in it use."""
    names = set(code.co_names)
    for constant in code.co_consts:
        if hasattr(constant, "co_names"):
            names |= _code_names(constant)
    return names
