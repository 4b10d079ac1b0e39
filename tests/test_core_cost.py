"""Cost contract: the ATen op count of plan + pack + unpack does not grow with B; one host sync per plan."""

from collections import Counter

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from tests.distributed import run_gloo
from verl_cppack import ParallelContext, plan_from_mask, plan_from_nested

# ops that force a device->host copy (or whose output size depends on data)
SYNCING_OPS = {"aten._local_scalar_dense", "aten.nonzero", "aten.masked_select", "aten.unique", "aten._unique", "aten._unique2"}


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func.overloadpacket)
        self.ops[name] += 1
        if name == "aten.repeat_interleave" and kwargs.get("output_size") is None:
            self.ops["sync:repeat_interleave_without_output_size"] += 1
        return func(*args, **kwargs)

    def syncs(self) -> int:
        return sum(n for op, n in self.ops.items() if op in SYNCING_OPS or op.startswith("sync:"))


class TolistCounter:
    """``Tensor.tolist`` copies to the host without dispatching an op: count it by wrapping the method."""

    def __enter__(self):
        self.calls, self._original = 0, torch.Tensor.tolist

        def counting_tolist(tensor):
            self.calls += 1
            return self._original(tensor)

        torch.Tensor.tolist = counting_tolist
        return self

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._original


def rollout_batch(batch_size, prompt_len=12, response_len=20, seed=0):
    generator = torch.Generator().manual_seed(seed)
    prompt = torch.randint(1, prompt_len + 1, (batch_size, 1), generator=generator)
    response = torch.randint(0, response_len + 1, (batch_size, 1), generator=generator)
    columns = torch.arange(prompt_len + response_len)
    mask = ((columns >= prompt_len - prompt) & (columns < prompt_len)) | (
        (columns >= prompt_len) & (columns < prompt_len + response)
    )
    input_ids = torch.randint(0, 1000, mask.shape, generator=generator)
    return input_ids, mask


def _micro_batch(batch_size, ctx):
    input_ids, mask = rollout_batch(batch_size)
    with OpCounter() as counter, TolistCounter() as tolist:
        plan = plan_from_mask(mask, ctx)
        packed = [plan.pack(input_ids), plan.pack(input_ids, shift=1), plan.pack(mask)]
        log_probs = packed[0].float()  # stands for the model output
        plan.unpack(log_probs)
        plan.unpack(log_probs * 2)
    return counter.ops, counter.syncs() + tolist.calls


def _counts_on_two_ranks(rank, world_size):
    ctx = ParallelContext(cp_size=world_size, cp_rank=rank, cp_group=dist.group.WORLD)
    return {batch_size: _micro_batch(batch_size, ctx) for batch_size in (4, 64, 256)}


def test_op_count_is_flat_in_batch_size_and_one_sync_with_cp2():
    for per_batch_size in run_gloo(_counts_on_two_ranks, 2):
        (ops_small, syncs_small), (ops_mid, _), (ops_large, syncs_large) = per_batch_size.values()
        assert ops_small == ops_mid == ops_large
        assert syncs_small == syncs_large == 1


def test_op_count_is_flat_in_batch_size_with_cp1():
    ops_small, syncs_small = _micro_batch(8, ParallelContext())
    ops_large, syncs_large = _micro_batch(512, ParallelContext())
    assert ops_small == ops_large
    assert syncs_small == syncs_large == 1


def test_nested_plan_is_flat_and_syncs_once():
    def run(batch_size):
        generator = torch.Generator().manual_seed(1)
        lengths = torch.randint(1, 30, (batch_size,), generator=generator).tolist()
        nested = torch.nested.nested_tensor([torch.ones(n) for n in lengths], layout=torch.jagged)
        with OpCounter() as counter, TolistCounter() as tolist:
            plan = plan_from_nested(nested, ParallelContext())
            plan.unpack(plan.pack(nested))
        return counter.ops, counter.syncs() + tolist.calls

    (ops_small, syncs_small), (ops_large, syncs_large) = run(4), run(300)
    assert ops_small == ops_large
    assert syncs_small == syncs_large == 1


def test_the_counter_detects_a_sync():
    """The instrument itself: a data-dependent op is seen."""
    with OpCounter() as counter, TolistCounter() as tolist:
        torch.arange(3).nonzero()
        int(torch.arange(3).sum())
        torch.arange(3).tolist()
    assert counter.syncs() + tolist.calls == 3
