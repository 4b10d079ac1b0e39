"""Jagged tensors are read through ``core.jagged``: its fast reads (the attributes torch's ``NestedTensor`` keeps its
parts in) must give exactly what the public API gives, and anything else must take the public API."""

from __future__ import annotations

import pytest
import torch

from verl_cppack.core import jagged


def _jagged(lengths: list[int], trailing: tuple[int, ...] = ()) -> torch.Tensor:
    values = torch.randn(sum(lengths), *trailing)
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    return torch.nested.nested_tensor_from_jagged(values, offsets=offsets)


@pytest.mark.parametrize("trailing", [(), (3,)])
def test_the_fast_reads_are_the_public_api_of_this_torch(trailing):
    nested = _jagged([3, 0, 5], trailing)
    assert jagged._fast(nested), "torch's jagged class changed: core.jagged now takes the slow public API everywhere"
    fast, public = jagged.jagged_values(nested), nested.values()
    assert fast.data_ptr() == public.data_ptr() and fast.shape == public.shape and torch.equal(fast, public)
    assert jagged.is_jagged(nested) and not jagged.has_holes(nested)
    narrowed = torch.nested.narrow(
        torch.arange(12.0).view(3, 4), 1, torch.tensor([0, 1, 0]), torch.tensor([2, 3, 1]), layout=torch.jagged
    )
    assert jagged.has_holes(narrowed) == (narrowed.lengths() is not None) is True


def test_other_tensors_take_the_public_api():
    assert not jagged.is_jagged(torch.zeros(2, 3))
    assert not jagged.is_jagged("not a tensor")
    strided = torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)])  # the strided layout
    assert not jagged.is_jagged(strided)


@pytest.mark.parametrize("trailing", [(), (2,)])
@pytest.mark.parametrize("requires_grad", [False, True])
def test_to_padded_rows_equal_torchs_method(trailing, requires_grad):
    nested = _jagged([3, 0, 5], trailing)
    if requires_grad:
        nested = torch.nested.nested_tensor_from_jagged(
            nested.values().clone().requires_grad_(True), offsets=nested.offsets()
        )
    rows = jagged.jagged_to_padded(nested, 7, -1.5)
    expected = nested.to_padded_tensor(-1.5, output_size=(3, 7, *trailing))
    assert rows.shape == expected.shape and torch.equal(rows, expected)
    assert rows.requires_grad == requires_grad


@pytest.mark.parametrize("trailing", [(), (2,)])
@pytest.mark.parametrize("requires_grad", [False, True])
def test_jagged_from_values_builds_what_torchs_function_builds(trailing, requires_grad):
    assert jagged._CONSTRUCTIBLE, "torch's jagged class changed: jagged_from_values now takes the slower public API"
    values = torch.randn(8, *trailing).requires_grad_(requires_grad)
    offsets = torch.tensor([0, 3, 3, 8])
    built = jagged.jagged_from_values(values, offsets)
    public = torch.nested.nested_tensor_from_jagged(values, offsets=offsets)
    assert type(built) is type(public) and built.layout == torch.jagged and built.shape == public.shape
    assert built.offsets() is offsets and built.values().data_ptr() == values.data_ptr()
    assert built._ragged_idx == public._ragged_idx and built.requires_grad == requires_grad
    assert [torch.equal(a, b) for a, b in zip(built.unbind(), public.unbind())] == [True] * 3
    assert torch.equal(built.to_padded_tensor(0.0), public.to_padded_tensor(0.0))
    if requires_grad:  # the gradient reaches the values (torch's own view op records it)
        (built.values() * 2).sum().backward()
        assert torch.equal(values.grad, torch.full_like(values, 2.0))
