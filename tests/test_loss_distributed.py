"""Token-mean and document-mean losses are the same for CP=1/2/4 (real gloo processes), values and gradients,
and the Megatron-core 0.16.1 schedule contract turns our outputs into the CP=1 gradient."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from tests.distributed import run_gloo
from verl_cppack import ParallelContext
from verl_cppack.loss import EmptyBatchError, document_mean_loss, token_mean_loss
from verl_cppack.packing.documents import pack_documents

PAD, EOD = 0, 1


def random_batch(seed: int) -> torch.Tensor:
    """[4, 24] rows with EODs, middle padding, an all-pad row and single-token documents."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(2, 50, (4, 24), generator=generator)
    tokens[torch.rand(4, 24, generator=generator) < 0.15] = EOD
    tokens[torch.rand(4, 24, generator=generator) < 0.1] = PAD
    tokens[2] = PAD
    tokens[3, -5:] = PAD
    tokens[1, 3:5] = EOD  # a single-token document
    return tokens


def base_losses(tokens: torch.Tensor) -> torch.Tensor:
    """[B, S] float64 per-token loss depending only on the token and its cell (deterministic)."""
    cells = torch.arange(tokens.numel(), dtype=torch.float64).view(tokens.shape)
    return torch.sin(tokens.double()) + 0.01 * cells + 2.0


def losses_on_rank(tokens: torch.Tensor, ctx: ParallelContext, layout: str):
    docs = pack_documents(tokens, eod_id=EOD, pad_id=PAD, ctx=ctx, layout=layout)
    return docs, docs.pack(base_losses(tokens)).requires_grad_()


def reduce_on_rank(rank: int, world_size: int, tokens: torch.Tensor, layout: str) -> dict:
    ctx = ParallelContext(cp_size=world_size, cp_rank=rank, cp_group=dist.group.WORLD)
    results = {}
    for name, reduce in (("token", token_mean_loss), ("document", document_mean_loss)):
        docs, losses = losses_on_rank(tokens, ctx, layout)
        extra = (docs.document_ids, docs.num_documents) if name == "document" else ()
        reduced = reduce(losses, docs.loss_mask, *extra, ctx)
        reduced.loss.backward()
        results[name] = (reduced.value, reduced.num_tokens, losses.grad)
    # zero loss tokens on every rank: the documented policies
    nothing = torch.zeros_like(docs.loss_mask)
    try:
        token_mean_loss(losses.detach(), nothing, ctx)
        results["raised"] = False
    except EmptyBatchError:
        results["raised"] = True
    skipped = token_mean_loss(losses.detach(), nothing, ctx, on_empty="skip")
    results["skipped"] = (bool(skipped.empty), skipped.value.item())
    # only one rank has loss tokens: the others must still divide by the global count
    only_rank0 = docs.loss_mask & (rank == 0)
    results["only_rank0"] = token_mean_loss(losses.detach(), only_rank0, ctx).num_tokens
    return results


def restore(tokens, layout, cp_size, local_grads) -> torch.Tensor:
    docs = pack_documents(tokens, eod_id=EOD, pad_id=PAD, ctx=ParallelContext(cp_size=cp_size), layout=layout)
    return docs.plan.restore(local_grads)  # [B, S]


def all_checks_on_rank(
    rank: int, world_size: int, tokens: torch.Tensor, layouts: tuple[str, ...], megatron: bool
) -> dict:
    """Everything one gloo run checks (process start-up is the expensive part on CPU)."""
    results = {layout: reduce_on_rank(rank, world_size, tokens, layout) for layout in layouts}
    if megatron:
        results["megatron"] = {
            mode: megatron_contract_on_rank(rank, world_size, tokens, mode) for mode in (True, False)
        }
    if world_size == 4:
        results["dp"] = reduce_over_cp_and_dp(rank)
    return results


def reduce_over_cp_and_dp(rank: int) -> tuple[float, int, float, int]:
    """World of 4 as DP=2 x CP=2: replica r = rank // 2 packs its own batch; losses reduce over CP then DP."""
    cp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    replica, cp_rank = divmod(rank, 2)
    ctx = ParallelContext(cp_size=2, cp_rank=cp_rank, cp_group=cp_groups[replica])
    docs, losses = losses_on_rank(random_batch(seed=10 + replica), ctx, "zigzag")
    token = token_mean_loss(losses, docs.loss_mask, ctx, dp_group=dp_groups[cp_rank])
    document = document_mean_loss(
        losses, docs.loss_mask, docs.document_ids, docs.num_documents, ctx, dp_group=dp_groups[cp_rank]
    )
    return token.value.item(), int(token.num_tokens), document.value.item(), int(document.num_tokens)


@pytest.fixture(scope="module")
def gloo_runs() -> dict[int, tuple[torch.Tensor, list[dict]]]:
    """CP=2 (both layouts, Megatron contract) and CP=4 (zigzag), one gloo run each."""
    runs = {}
    for cp_size, layouts, megatron in ((2, ("zigzag", "contiguous"), True), (4, ("zigzag",), False)):
        tokens = random_batch(seed=cp_size)
        runs[cp_size] = tokens, run_gloo(all_checks_on_rank, cp_size, tokens, layouts, megatron)
    return runs


@pytest.mark.parametrize("cp_size, layout", [(2, "zigzag"), (4, "zigzag"), (2, "contiguous")])
@pytest.mark.slow  # gloo worlds of 2 and 4 ranks (the module fixture)
@pytest.mark.stacks
def test_token_and_document_mean_match_cp1_in_gloo(gloo_runs, cp_size, layout):
    tokens, runs = gloo_runs[cp_size]
    per_rank = [run[layout] for run in runs]
    reference = reduce_on_rank(0, 1, tokens, layout)
    for name in ("token", "document"):
        value1, count1, grad1 = reference[name]
        for value, count, _ in (r[name] for r in per_rank):
            assert int(count) == int(count1) > 0
            assert value.item() == pytest.approx(value1.item(), rel=1e-12)
        grads = restore(tokens, layout, cp_size, [r[name][2] for r in per_rank])
        assert torch.allclose(grads, restore(tokens, layout, 1, [grad1]), rtol=1e-12, atol=0)
        assert grads.abs().sum() > 0
    assert reference["raised"] and all(r["raised"] for r in per_rank)
    assert all(r["skipped"] == (True, 0.0) for r in per_rank)
    # only rank 0 has loss tokens: every rank still divides by the same global count
    assert len({int(r["only_rank0"]) for r in per_rank}) == 1


@pytest.mark.slow  # gloo worlds of 2 and 4 ranks (the module fixture)
@pytest.mark.stacks
def test_token_and_document_mean_over_cp_and_dp(gloo_runs):
    _, runs = gloo_runs[4]
    replicas = [reduce_on_rank(0, 1, random_batch(seed=10 + replica), "zigzag") for replica in range(2)]
    tokens = sum(int(r["token"][1]) for r in replicas)
    token_sum = sum(r["token"][0].item() * int(r["token"][1]) for r in replicas)
    documents = sum(int(r["document"][1]) for r in replicas)
    document_sum = sum(r["document"][0].item() * int(r["document"][1]) for r in replicas)
    for token_value, token_count, document_value, document_count in (run["dp"] for run in runs):
        assert token_count == tokens and token_value == pytest.approx(token_sum / tokens, rel=1e-12)
        assert document_count == documents and document_value == pytest.approx(document_sum / documents, rel=1e-12)


# ----------------------------------------------------------------------------- Megatron-core's schedule contract
def megatron_contract_on_rank(rank: int, world_size: int, tokens: torch.Tensor, per_token: bool) -> dict:
    from megatron.core.pipeline_parallel.schedules import forward_step_calc_loss

    from verl_cppack.loss import megatron_mean_loss_outputs, megatron_per_token_loss_outputs

    ctx = ParallelContext(cp_size=world_size, cp_rank=rank, cp_group=dist.group.WORLD)
    docs, losses = losses_on_rank(tokens, ctx, "zigzag")
    if per_token:
        loss_func = lambda output: megatron_per_token_loss_outputs(output, docs.loss_mask)  # noqa: E731
    else:
        loss_func = lambda output: megatron_mean_loss_outputs(output, docs.loss_mask, ctx)  # noqa: E731
    config = SimpleNamespace(calculate_per_token_loss=per_token, timers=None)
    output, num_tokens = forward_step_calc_loss(
        SimpleNamespace(), losses, loss_func, config, None, False, 1, [], cp_group_size=world_size, is_last_stage=True
    )
    output.backward()
    grad = losses.grad.clone()
    if per_token:  # finalize_model_grads: all-reduce num_tokens over DP x CP, DDP sums, then scale by 1/num_tokens
        total = num_tokens.clone()
        if world_size > 1:
            dist.all_reduce(total)
        grad = grad / total
    else:  # DDP averages gradients over DP x CP
        grad = grad / world_size
    return grad


@pytest.mark.parametrize("per_token", [True, False])
@pytest.mark.slow  # gloo worlds of 2 and 4 ranks (the module fixture)
@pytest.mark.stacks
def test_megatron_schedule_contract_gives_the_cp1_gradient(gloo_runs, per_token):
    tokens, runs = gloo_runs[2]
    reference = megatron_contract_on_rank(0, 1, tokens, per_token)
    grads = [run["megatron"][per_token] for run in runs]
    # each rank's gradient lives on its own chunk; DDP's reduction adds the chunks
    assert torch.allclose(
        restore(tokens, "zigzag", 2, grads), restore(tokens, "zigzag", 1, [reference]), rtol=1e-12, atol=0
    )
