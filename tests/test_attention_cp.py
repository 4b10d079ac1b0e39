"""CP attention in real gloo processes: ring = all-gather = CP=1 reference, forward and backward.

Every rank builds the same global q/k/v, keeps its layout rows, runs both implementations and a
backward with a fixed output weight; the parent compares each rank's rows with the per-document
reference on the global stream (and its gradients).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.distributed import run_gloo
from verl_cppack.attention import context_parallel_attention, reference_attention
from verl_cppack.context import ParallelContext
from verl_cppack.core.layouts import get_layout

HEAD_DIM = 8


def cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def cases(cp_size):
    """(name, cu_seqlens_padded, cu_seqlens or None, heads, groups): every slot a multiple of 2*CP."""
    unit = 2 * cp_size
    generator = torch.Generator().manual_seed(cp_size)
    random_real = torch.randint(0, 5 * unit, (7,), generator=generator).tolist()
    random_padded = [unit * -(-n // unit) for n in random_real]
    return [
        # documents shorter than 2*CP chunks (1 and 3 tokens), an empty slot, GQA
        ("short+gqa", cu([unit, unit, 0, 3 * unit]), cu([1, 3, 0, 3 * unit - 1]), 4, 2),
        # verl's convention: padding attends inside its own slot (cu_seqlens_q = padded)
        ("padded-attention", cu([unit, unit, 0, 3 * unit]), None, 4, 4),
        # a padding-only ghost slot at the tail and a slot that is mostly padding
        ("ghost-tail", cu([2 * unit, unit, 2 * unit]), cu([2 * unit - 1, 1, 0]), 2, 1),
        ("random", cu(random_padded), cu(random_real), 4, 2),
    ]


def global_inputs(cu_padded, heads, groups, seed):
    total = int(cu_padded[-1])
    generator = torch.Generator().manual_seed(seed)
    q, k, v, weight = (torch.randn(total, n, HEAD_DIM, generator=generator) for n in (heads, groups, groups, heads))
    return q, k, v, weight


def run_rank(rank, world_size, layouts):
    torch.set_num_threads(1)  # 2 cores shared by every rank
    ctx = ParallelContext(cp_size=world_size, cp_rank=rank, cp_group=dist.group.WORLD)
    results = []
    for seed, (name, cu_padded, cu_real, heads, groups) in enumerate(cases(world_size)):
        q, k, v, weight = global_inputs(cu_padded, heads, groups, seed)
        for layout, implementation in layouts:
            rows = get_layout(layout).partition(cu_padded, world_size)[rank]
            local = [x.index_select(0, rows).requires_grad_() for x in (q, k, v)]
            out = context_parallel_attention(
                *local, cu_padded, ctx, implementation=implementation, cu_seqlens=cu_real, layout=layout
            )
            (out * weight.index_select(0, rows)).sum().backward()
            results.append((name, layout, implementation, rows, out.detach(), *(x.grad for x in local)))
    return results


@pytest.mark.parametrize("cp_size", [2, pytest.param(4, marks=[pytest.mark.slow, pytest.mark.stacks])])  # 4 ranks: slow
def test_ring_and_allgather_equal_the_reference_forward_and_backward(cp_size):
    layouts = [("zigzag", "allgather"), ("zigzag", "ring"), ("contiguous", "allgather")]
    per_rank = run_gloo(run_rank, cp_size, layouts)
    expected = {}
    for seed, (name, cu_padded, cu_real, heads, groups) in enumerate(cases(cp_size)):
        q, k, v, weight = (x.requires_grad_() for x in global_inputs(cu_padded, heads, groups, seed))
        out = reference_attention(q, k, v, cu_padded, cu_real)
        (out * weight).sum().backward()
        expected[name] = (out.detach(), q.grad, k.grad, v.grad)

    checked = set()
    for results in per_rank:
        for name, layout, implementation, rows, *got in results:
            for what, value, full in zip(("out", "dq", "dk", "dv"), got, expected[name]):
                torch.testing.assert_close(
                    value,
                    full.index_select(0, rows),
                    atol=1e-5,
                    rtol=1e-5,
                    msg=lambda m: f"{name} {layout}/{implementation} {what}: {m}",
                )
            checked.add((name, layout, implementation))
    assert len(checked) == len(cases(cp_size)) * len(layouts)
