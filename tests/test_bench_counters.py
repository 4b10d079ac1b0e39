"""The bench's instruments measure what they say: ATen ops, and the bytes of tensors made inside the block and alive
at once — including the host tables a plan sends to the device, which on the CPU dispatch no op."""

import numpy as np
import torch

from verl_cppack import plan_from_mask
from verl_cppack.bench.batches import rollout_batch
from verl_cppack.bench.counters import OpCounter


def test_peak_bytes_is_the_most_alive_at_once_of_what_the_block_allocates():
    kept = torch.zeros(1000)  # made before the block: not counted
    with OpCounter() as counter:
        first = torch.zeros(250)  # 1000 bytes
        second = torch.ones(500, dtype=torch.float64)  # 4000 bytes
        del first
        third = torch.zeros(100, dtype=torch.int8)  # 100 bytes: 4100 alive, below the 5000 of the peak
        kept.add_(1)  # in place: nothing new
        kept.view(10, 100)  # a view: nothing new
    assert counter.peak_bytes == 5000
    assert counter.live_bytes == 4100
    assert counter.ops["aten.zeros"] + counter.ops["aten.ones"] >= 2
    del second, third


def test_tensors_made_from_numpy_inside_the_block_are_counted_and_from_numpy_is_put_back():
    original = torch.from_numpy
    table = np.arange(1000, dtype=np.int32)  # 4000 bytes
    with OpCounter() as counter:
        shared = torch.from_numpy(table)
    assert torch.from_numpy is original
    assert counter.peak_bytes == 4000  # no op allocates (lift_fresh returns the array's memory), counted all the same
    assert dict(counter.ops) == {"aten.lift_fresh": 1}
    del shared


def test_a_plans_host_tables_count_towards_its_peak():
    input_ids, mask = rollout_batch(8, 64)
    with OpCounter() as counter:
        plan = plan_from_mask(mask)
        packed = plan.pack(input_ids)
    index_bytes = plan._pack_copy(0, False).index.untyped_storage().nbytes()
    offsets_bytes = plan.cu_seqlens_padded.untyped_storage().nbytes()  # both offset tables share one buffer
    assert counter.peak_bytes >= packed.untyped_storage().nbytes() + index_bytes + offsets_bytes
