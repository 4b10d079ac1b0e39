"""Jagged nested tensors read without their Python dispatch.

torch's jagged nested tensor is a Python tensor subclass: every tensor property or method on it (``is_nested``,
``layout``, ``device``, ``values()``) goes through its ``__torch_function__`` / ``__torch_dispatch__``, 6-19 us each
on this CPU (``values()`` 19 us, ``layout`` 10 us) — more than the copy a small micro-batch needs. Where the object
is exactly torch's ``NestedTensor`` class, its parts are read from the attributes that class keeps them in
(``_values``, ``_lengths``: 0.04 us each; ``offsets()`` is a plain method already); anything else (another class,
a torch without that class or those attributes) takes the public API. ``tests/test_core_jagged.py`` checks that both ways read the same
parts, so a torch that renames them fails there instead of reading wrong. ``jagged_to_padded`` likewise calls the
kernel behind ``to_padded_tensor`` directly, and ``jagged_from_values`` builds the class itself where
``nested_tensor_from_jagged`` would only add its dispatch.
"""

from __future__ import annotations

import inspect

import torch

try:  # torch's class of jagged nested tensors (private module, guarded: the public API is the fallback)
    from torch.nested._internal import nested_tensor as _nested_tensor_module
except ImportError:  # pragma: no cover - a torch without it
    _nested_tensor_module = None
_JAGGED_CLASS = getattr(_nested_tensor_module, "NestedTensor", None)

_PARTS = ("_values", "_lengths")


def _fast(x: object) -> bool:
    """Whether ``x`` is exactly torch's jagged class and keeps its parts where this module reads them."""
    return _JAGGED_CLASS is not None and type(x) is _JAGGED_CLASS and all(hasattr(x, part) for part in _PARTS)


def is_jagged(x: object) -> bool:
    """Whether ``x`` is a jagged nested tensor (``layout=torch.jagged``)."""
    if _fast(x):
        return True
    return isinstance(x, torch.Tensor) and x.is_nested and x.layout == torch.jagged


def jagged_values(x: torch.Tensor) -> torch.Tensor:
    """``x.values()``: the ``[N, *]`` tokens of a jagged tensor."""
    return x._values if _fast(x) else x.values()


def has_holes(x: torch.Tensor) -> bool:
    """Whether a jagged tensor is a view with holes (``torch.nested.narrow``: ``lengths()`` is set)."""
    return (x._lengths if _fast(x) else x.lengths()) is not None


_TO_PADDED = getattr(torch.ops.aten, "_jagged_to_padded_dense_forward", None)  # what to_padded_tensor runs inside


def jagged_to_padded(x: torch.Tensor, row_length: int, fill: int | float) -> torch.Tensor:
    """``x.to_padded_tensor(fill, output_size=(B, row_length, *))`` (every sequence must fit ``row_length``): the
    kernel itself where the tensor is read fast and carries no gradient (44 us -> 8 us at B=1 here), else torch's
    method."""
    if _TO_PADDED is None or not _fast(x) or x._values.requires_grad:
        values = jagged_values(x)
        return x.to_padded_tensor(fill, output_size=(x.size(0), row_length, *values.shape[1:]))
    return _TO_PADDED(x._values, [x.offsets()], [row_length], fill)


# built from (values, offsets), as nested_tensor_from_jagged's view op builds it, where the class takes them first
_CONSTRUCTOR = list(inspect.signature(_JAGGED_CLASS.__new__).parameters) if _JAGGED_CLASS is not None else []
_CONSTRUCTIBLE = _CONSTRUCTOR[1:3] == ["values", "offsets"]


def jagged_from_values(values: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``torch.nested.nested_tensor_from_jagged(values, offsets)`` (``values`` [N, *], ``offsets`` [B+1] int64): the
    class itself where autograd has no view to record (``values`` needs no gradient: 46 us -> 13 us here), else
    torch's function."""
    if not _CONSTRUCTIBLE or values.requires_grad:
        return torch.nested.nested_tensor_from_jagged(values, offsets=offsets)
    return _JAGGED_CLASS(values, offsets)
