"""The host boundary: what a plan reads back, and the tables it sends to the device."""

import numpy as np
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
