"""unpack in real gloo processes: every rank gets the whole batch; gradient flows only into the local chunk."""

import pytest
import torch
import torch.distributed as dist

from tests import oracle
from tests.distributed import run_gloo
from verl_cppack import ParallelContext, plan_from_mask, plan_from_nested

# left-padded prompt + right-padded response, a middle gap, an empty row, a short row
MASK = [
    [0, 0, 1, 1, 1, 1, 1, 0, 0],
    [1, 1, 1, 1, 1, 1, 1, 1, 1],
    [0, 1, 1, 0, 0, 1, 1, 1, 0],
    [0, 0, 0, 0, 0, 0, 0, 0, 0],
    [1, 0, 0, 0, 0, 0, 0, 0, 0],
]
HIDDEN = 3


def _inputs():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(len(MASK), len(MASK[0]), HIDDEN, generator=generator, dtype=torch.float64)
    weights = torch.randn(x.shape, generator=generator, dtype=torch.float64)
    return x, weights


def _unpack_and_backward(rank, world_size, layout, gradient):
    ctx = ParallelContext(cp_size=world_size, cp_rank=rank, cp_group=dist.group.WORLD)
    plan = plan_from_mask(torch.tensor(MASK), ctx, layout=layout)
    x, weights = _inputs()
    y_local = plan.pack(x).clone().requires_grad_(True)  # [1, T_local, H] stands for a model output
    full = plan.unpack(y_local, gradient=gradient)  # [B, S, H]
    (full * weights).sum().backward()
    other_dtypes = {
        dtype: plan.unpack(plan.pack(x.to(dtype) if dtype != torch.bool else x > 0))
        for dtype in (torch.bfloat16, torch.bool, torch.int64)
    }
    return full.detach(), y_local.grad[0], plan.local_index, other_dtypes


def _expected_local_gradient(layout, world_size, rank, weights):
    lengths = [sum(row) for row in MASK]
    padded = oracle.padded_lengths(lengths, 2 * world_size, 2 * world_size)
    stream = oracle.stream_of_rows(MASK, padded)
    index = oracle.local_indices(layout, oracle.offsets(padded), world_size, rank)
    return torch.stack(
        [torch.zeros(HIDDEN, dtype=weights.dtype) if stream[p] is None else weights[stream[p]] for p in index]
    )


@pytest.mark.parametrize(
    "world_size", [2, pytest.param(4, marks=[pytest.mark.slow, pytest.mark.stacks])]
)  # 4 ranks: slow
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_unpack_gathers_the_batch_and_keeps_local_gradient(world_size, layout):
    x, weights = _inputs()
    mask = torch.tensor(MASK).bool()
    expected_full = torch.where(mask.unsqueeze(-1), x, 0.0)
    results = run_gloo(_unpack_and_backward, world_size, layout, "local")
    for rank, (full, local_grad, _local_index, other_dtypes) in enumerate(results):
        assert full.dtype == torch.float64
        assert torch.equal(full, expected_full)
        assert torch.equal(local_grad, _expected_local_gradient(layout, world_size, rank, weights))
        for dtype, restored in other_dtypes.items():
            source = x.to(dtype) if dtype != torch.bool else x > 0
            assert restored.dtype == dtype
            assert torch.equal(restored, torch.where(mask.unsqueeze(-1), source, torch.zeros((), dtype=dtype)))


def _unpack_rows_of_one_element(rank, world_size):
    """Log-probs ``[1, T_local]`` and a value head's ``[1, T_local, 1]``: rows of one element take the 1-D scatter."""
    ctx = ParallelContext(cp_size=world_size, cp_rank=rank, cp_group=dist.group.WORLD)
    plan = plan_from_mask(torch.tensor(MASK), ctx)
    x, weights = _inputs()
    results = {}
    for trailing in ((), (1,)):
        source, weight = x[..., 0].reshape(*x.shape[:2], *trailing), weights[..., 0].reshape(*x.shape[:2], *trailing)
        y_local = plan.pack(source).clone().requires_grad_(True)
        full = plan.unpack(y_local)
        (full * weight).sum().backward()
        results[trailing] = (full.detach(), y_local.grad[0])
    return results


def test_rows_of_one_element_unpack_with_the_same_values_and_gradient():
    x, weights = _inputs()
    mask = torch.tensor(MASK).bool()
    for rank, results in enumerate(run_gloo(_unpack_rows_of_one_element, 2)):
        expected_grad = _expected_local_gradient("zigzag", 2, rank, weights)[:, 0]
        for trailing, (full, local_grad) in results.items():
            assert torch.equal(full.reshape(mask.shape), torch.where(mask, x[..., 0], 0.0))
            assert full.shape == (*mask.shape, *trailing)
            assert torch.equal(local_grad.reshape(-1), expected_grad)


def test_padding_positions_get_zero_gradient():
    results = run_gloo(_unpack_and_backward, 2, "zigzag", "local")
    for rank, (_, local_grad, local_index, _) in enumerate(results):
        plan = plan_from_mask(torch.tensor(MASK), ParallelContext(cp_size=2, cp_rank=rank))
        assert torch.equal(local_index, plan.local_index)
        assert not plan.local_valid_mask.all()  # the test means something
        assert torch.count_nonzero(local_grad[~plan.local_valid_mask]) == 0


def test_sum_contract_is_cp_size_times_the_local_contract():
    _, weights = _inputs()
    results = run_gloo(_unpack_and_backward, 2, "zigzag", "sum")
    for rank, (_, local_grad, _, _) in enumerate(results):
        assert torch.allclose(local_grad, 2 * _expected_local_gradient("zigzag", 2, rank, weights))


def _nested_unpack(rank, world_size):
    ctx = ParallelContext(cp_size=world_size, cp_rank=rank, cp_group=dist.group.WORLD)
    rows = [torch.arange(n, dtype=torch.float32) + 10 * i for i, n in enumerate([5, 0, 3, 8])]
    nested = torch.nested.nested_tensor(rows, layout=torch.jagged)
    plan = plan_from_nested(nested, ctx)
    local = plan.pack(nested).clone().requires_grad_(True)
    gathered = plan.unpack(local)
    gathered.values().sum().backward()
    return [t.clone() for t in gathered.unbind()], local.grad[0], plan.local_valid_mask


def test_nested_unpack_returns_the_sequences_on_every_rank():
    results = run_gloo(_nested_unpack, 2)
    for sequences, local_grad, valid in results:
        assert [s.tolist() for s in sequences] == [
            [0, 1, 2, 3, 4],
            [],
            [20, 21, 22],
            [30, 31, 32, 33, 34, 35, 36, 37],
        ]
        assert torch.equal(local_grad, valid.float())


def _wrong_group(rank, world_size):
    from verl_cppack import pack_documents

    messages = []
    wrong = [
        ParallelContext(cp_size=world_size, cp_rank=1 - rank, cp_group=dist.group.WORLD),  # another rank
        ParallelContext(cp_size=4, cp_rank=rank, cp_group=dist.group.WORLD),  # the group has 2 ranks
        ParallelContext(cp_size=1, cp_rank=0, cp_group=dist.group.WORLD),
    ]
    builders = [
        lambda ctx: plan_from_mask(torch.ones(2, 4, dtype=torch.bool), ctx),
        lambda ctx: pack_documents(torch.ones(2, 8, dtype=torch.long), eod_id=2, pad_id=0, ctx=ctx),
    ]
    for ctx in wrong:
        for build in builders:
            try:
                build(ctx)  # caught when the plan is built, before any collective
                messages.append(None)
            except ValueError as error:
                messages.append(str(error))
    return messages


def test_mismatched_group_and_rank_is_a_clear_error_when_the_plan_is_built():
    for messages in run_gloo(_wrong_group, 2):
        assert len(messages) == 6
        for message in messages:
            assert message is not None and "ctx.cp_group has size 2" in message


def _gather_stream(rank, world_size, gradient):
    from verl_cppack.collectives.gather import gather_stream

    ctx = ParallelContext(cp_size=world_size, cp_rank=rank, cp_group=dist.group.WORLD)
    local = (torch.arange(4 * 2, dtype=torch.float64).view(4, 2) + 100 * rank).requires_grad_(True)
    gathered = gather_stream(local, ctx, gradient)  # [2 * 4, 2]
    weights = torch.arange(gathered.numel(), dtype=torch.float64).view(gathered.shape) + 1
    (gathered * weights).sum().backward()
    return gathered.detach(), local.grad, weights


@pytest.mark.parametrize("gradient", ["local", "sum"])
def test_the_gathered_stream_is_every_rank_in_order_with_its_gradient_contract(gradient):
    results = run_gloo(_gather_stream, 2, gradient)
    expected = torch.cat([torch.arange(8.0).view(4, 2) + 100 * rank for rank in range(2)])
    for rank, (gathered, grad, weights) in enumerate(results):
        assert torch.equal(gathered, expected.double())
        own = weights[4 * rank : 4 * rank + 4]
        assert torch.equal(grad, own if gradient == "local" else 2 * own)  # "sum": both ranks' equal gradients


def _gather_with_host_work(rank, world_size, fail_on_rank):
    from verl_cppack.collectives.gather import gather_stream

    ctx = ParallelContext(cp_size=world_size, cp_rank=rank, cp_group=dist.group.WORLD)
    local = torch.arange(3.0) + 10 * rank
    calls = []

    def host_work():
        calls.append(rank)
        if rank == fail_on_rank:
            raise ValueError("host work failed")

    try:
        gather_stream(local, ctx, "local", host_work)
        error = None
    except ValueError as raised:
        error = str(raised)
    after = gather_stream(local * 2, ctx, "local", host_work if rank != fail_on_rank else None)
    return calls, error, after


@pytest.mark.parametrize("fail_on_rank", [None, 0])
def test_host_work_runs_once_while_the_all_gather_is_in_flight_and_a_failure_keeps_the_ranks_in_step(fail_on_rank):
    """The copy back's index is built while the all-gather is in flight: the work runs once per gather on every
    rank; if it raises on one rank, that rank still completes the all-gather, so the next collective pairs up."""
    results = run_gloo(_gather_with_host_work, 2, fail_on_rank)
    expected_after = torch.cat([(torch.arange(3.0) + 10 * rank) * 2 for rank in range(2)])
    for rank, (calls, error, after) in enumerate(results):
        failed = rank == fail_on_rank
        assert calls == [rank] * (1 if failed else 2)
        assert error == ("host work failed" if failed else None)
        assert torch.equal(after, expected_after)


def test_at_cp_1_nothing_is_in_flight_and_the_host_work_is_left_to_the_caller():
    from verl_cppack.collectives.gather import gather_stream

    calls = []
    local = torch.arange(3.0)
    assert gather_stream(local, ParallelContext(), "local", lambda: calls.append(1)) is local
    assert calls == []
