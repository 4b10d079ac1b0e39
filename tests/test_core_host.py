"""The host boundary: what a plan reads back, and the tables it sends to the device."""

import numpy as np
import pytest
import torch

from verl_cppack.core import host


def test_one_buffer_read_returns_each_tensor_flattened_as_int64():
    """The accelerator path (one concatenated copy, split on the host), exercised on CPU tensors."""
    tensors = (torch.tensor([3, -1]), torch.tensor([[1, 2], [3, 4]], dtype=torch.int32), torch.tensor(7))
    arrays = host.read_as_one_buffer(*tensors)
    assert [a.tolist() for a in arrays] == [[3, -1], [1, 2, 3, 4], [7]]
    assert all(a.dtype == np.int64 for a in arrays)
    assert [a.tolist() for a in host.read_to_host(*tensors)] == [a.tolist() for a in arrays]


def test_tables_reach_the_device_with_the_requested_dtype():
    table = np.array([[0, 5], [2, -3]])
    tensor = host.to_device(table, torch.device("cpu"), torch.int32)
    assert tensor.dtype == torch.int32 and tensor.tolist() == [[0, 5], [2, -3]]


@pytest.mark.parametrize("dtype", [torch.long, torch.int32, None])
def test_a_strided_table_reaches_the_device_contiguous(dtype):
    table = np.arange(10, 70, 3)[::2]
    tensor = host.to_device(table, torch.device("cpu"), dtype)
    assert tensor.dtype == (dtype or torch.long) and tensor.tolist() == table.tolist() and tensor.is_contiguous()


@pytest.mark.parametrize("pinned_memory", [True, False])
def test_tables_go_pinned_and_non_blocking_off_the_cpu(monkeypatch, pinned_memory):
    """Off the CPU a table is pinned and copied without waiting; without pinned memory it is a plain copy."""
    calls = []

    def pin_memory(self, *args, **kwargs):
        calls.append("pin")
        if not pinned_memory:
            raise RuntimeError("no pinned memory here")
        return self

    def record_copy(self, *args, **kwargs):
        if args and isinstance(args[0], torch.device):
            calls.append(("copy", kwargs.get("non_blocking", False)))
        return self

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    monkeypatch.setattr(torch.Tensor, "to", record_copy)
    host.to_device(np.array([1, 2]), torch.device("meta"), torch.int64)
    assert calls == ["pin", ("copy", pinned_memory)]
