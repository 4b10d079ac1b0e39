"""Cost contract: the ATen op count of plan + pack + unpack is the same for every B and every batch (a copy zeroes
its padding whenever the plan's policy can pad, whether or not this batch has any); one host sync per plan."""

import torch
import torch.distributed as dist

from tests.distributed import run_gloo
from verl_cppack import ParallelContext, plan_from_mask, plan_from_nested
from verl_cppack.bench.batches import rollout_batch
from verl_cppack.bench.counters import HostReadCounter, OpCounter
from verl_cppack.packing.mask_rows import MaskRows

COPIES = 5  # three packs, two unpacks


def _micro_batch(batch_size, ctx):
    input_ids, mask = rollout_batch(batch_size, 32)
    if batch_size == 1:  # 4 tokens: no padding at CP=2 (slots of 4), nothing for the unshifted copies to zero
        mask = torch.zeros_like(mask)
        mask[0, 14:18] = True
    with OpCounter() as counter, HostReadCounter() as tolist:
        plan = plan_from_mask(mask, ctx)
        packed = [plan.pack(input_ids), plan.pack(input_ids, shift=1), plan.pack(mask)]
        log_probs = packed[0].float()  # stands for the model output
        plan.unpack(log_probs)
        plan.unpack(log_probs * 2)
    return dict(counter.ops), counter.syncs() + tolist.calls


def _counts_on_two_ranks(rank, world_size):
    ctx = ParallelContext(cp_size=world_size, cp_rank=rank, cp_group=dist.group.WORLD)
    return {batch_size: _micro_batch(batch_size, ctx) for batch_size in (1, 4, 64, 256)}


def test_op_count_is_flat_in_batch_size_and_one_sync_with_cp2():
    for per_batch_size in run_gloo(_counts_on_two_ranks, 2):
        (ops_unpadded, syncs_unpadded), (ops_small, _), (ops_mid, _), (ops_large, syncs_large) = per_batch_size.values()
        assert ops_unpadded == ops_small == ops_mid == ops_large
        assert ops_large["aten.index_fill_"] == 3  # the unshifted packs zero (nothing, at B=1), the shifted one too
        assert syncs_unpadded == syncs_large == 1


def test_op_count_is_flat_in_batch_size_with_cp1():
    (ops_single, syncs_single), (ops_small, _) = _micro_batch(1, ParallelContext()), _micro_batch(8, ParallelContext())
    ops_large, syncs_large = _micro_batch(512, ParallelContext())
    assert ops_single == ops_small == ops_large
    assert ops_large["aten.index_fill_"] == 1  # CP=1 pads nothing: only the shifted pack has positions to zero
    assert syncs_single == syncs_large == 1


def test_nested_plan_is_flat_and_syncs_once():
    def run(batch_size):
        generator = torch.Generator().manual_seed(1)
        lengths = torch.randint(1, 30, (batch_size,), generator=generator).tolist()
        nested = torch.nested.nested_tensor([torch.ones(n) for n in lengths], layout=torch.jagged)
        with OpCounter() as counter, HostReadCounter() as tolist:
            plan = plan_from_nested(nested, ParallelContext())
            plan.unpack(plan.pack(nested))
        return counter.ops, counter.syncs() + tolist.calls

    (ops_small, syncs_small), (ops_large, syncs_large) = run(4), run(300)
    assert ops_small == ops_large
    assert syncs_small == syncs_large == 1


def test_the_device_scan_reads_its_statistics_as_one_tensor():
    """Where an accelerator holds the mask, each row's count, first and last token are three tensor ops, stacked and
    read in one copy: no concatenation, no conversion, nothing per row (run here on CPU tensors)."""
    _, mask = rollout_batch(16, 64)
    with OpCounter() as counter, HostReadCounter() as reads:
        counts, first, last = MaskRows(mask).scan()
    assert counts.tolist() == mask.sum(1).tolist() and reads.calls == 1
    assert counter.ops["aten.stack"] == 1 and "aten.cat" not in counter.ops and "aten._to_copy" not in counter.ops
    assert counter.total_ops <= 9, dict(counter.ops)


def test_the_counter_detects_a_sync():
    """The instrument itself: a data-dependent op is seen."""
    with OpCounter() as counter, HostReadCounter() as tolist:
        torch.arange(3).nonzero()
        int(torch.arange(3).sum())
        torch.arange(3).tolist()
        torch.repeat_interleave(torch.tensor([1, 2]))
        torch.repeat_interleave(torch.tensor([1, 2]), output_size=3)  # no sync: the size is given
        torch.arange(3)[torch.tensor([True, False, True])]
    assert counter.syncs() + tolist.calls == 5
