"""The tiny Megatron GPT on CPU and the log-prob path: CP=2/4 give the CP=1 log-probs, entropy and gradients.

Each gloo world first runs CP=1 (megatron state with DP = world), then rebuilds the state at CP = world
and runs the same weights on the same batch, so every rank compares against its own CP=1 result.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

from tests.distributed import run_gloo
from verl_cppack.context import ParallelContext
from verl_cppack.logprobs import compute_logprobs

VOCAB = 61


def batch(seed=0):
    """[4, 20] rollout-like: left-padded row, right-padded row, a 1-token row, a row of 2 tokens mid-row."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, VOCAB, (4, 20), generator=generator)
    mask = torch.zeros(4, 20, dtype=torch.int64)  # integer masks are accepted as 0/1
    mask[0, 5:] = 1
    mask[1, :13] = 1
    mask[2, 0] = 1
    mask[3, 9:11] = 1
    return input_ids, mask


# ------------------------------------------------------------------------ position-wise model (no attention)
class PositionWiseModel(torch.nn.Module):
    """Logits depend only on (token, position inside the sequence): CP must not change a single bit."""

    def __init__(self):
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.token = torch.nn.Parameter(torch.randn(VOCAB, VOCAB, generator=generator))
        self.position = torch.nn.Parameter(torch.randn(32, VOCAB, generator=generator))

    def forward(self, input_ids, position_ids, attention_mask, packed_seq_params):
        return self.token[input_ids] * self.position[position_ids]  # [1, T_local, V]


def position_wise_rank(rank, world_size):
    ctx = ParallelContext(cp_size=world_size, cp_rank=rank, cp_group=dist.group.WORLD)
    model = PositionWiseModel()
    input_ids, mask = batch()
    log_probs, entropy = compute_logprobs(model, input_ids, mask, ctx, with_entropy=True, temperature=0.7)
    (log_probs.sum() + entropy.sum()).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    for grad in grads:
        dist.all_reduce(grad)
    return log_probs.detach(), entropy.detach(), grads


def cp_world_rank(rank, world_size):
    """Everything this module checks in one gloo world per CP size (megatron is imported once per process)."""
    torch.set_num_threads(1)
    return {"position_wise": position_wise_rank(rank, world_size), "tiny_gpt": tiny_gpt_rank(rank, world_size)}


@pytest.fixture(
    scope="module", params=[2, pytest.param(4, marks=[pytest.mark.slow, pytest.mark.stacks])], ids=lambda cp: f"cp{cp}"
)
def cp_world(request):
    return request.param, run_gloo(cp_world_rank, request.param)


@pytest.mark.slow  # gloo worlds with Megatron imported in every rank
@pytest.mark.stacks
def test_position_wise_model_is_bit_exact_under_cp(cp_world):
    _, per_rank = cp_world
    model = PositionWiseModel()
    input_ids, mask = batch()
    log_probs, entropy = compute_logprobs(model, input_ids, mask, ParallelContext(), with_entropy=True, temperature=0.7)
    (log_probs.sum() + entropy.sum()).backward()
    for cp_log_probs, cp_entropy, cp_grads in (result["position_wise"] for result in per_rank):
        assert torch.equal(cp_log_probs, log_probs.detach())
        assert torch.equal(cp_entropy, entropy.detach())
        for cp_grad, param in zip(cp_grads, model.parameters()):
            torch.testing.assert_close(cp_grad, param.grad, atol=1e-6, rtol=1e-6)


def test_log_probs_follow_the_next_token_inside_each_row():
    model = PositionWiseModel()
    input_ids, mask = batch()
    log_probs, entropy = compute_logprobs(model, input_ids, mask, ParallelContext(), with_entropy=True)
    # oracle: row by row, the valid tokens alone, position = index among them
    for row in range(4):
        tokens = input_ids[row][mask[row].bool()]
        logits = model.token[tokens] * model.position[torch.arange(len(tokens))]
        expected = torch.log_softmax(logits, -1)[torch.arange(len(tokens) - 1), tokens[1:]]
        valid_log_probs = log_probs[row][mask[row].bool()]
        torch.testing.assert_close(valid_log_probs[:-1], expected.detach())
        assert valid_log_probs[-1] == 0  # the last token has no next token
        distribution = torch.softmax(logits, -1)
        torch.testing.assert_close(
            entropy[row][mask[row].bool()], -(distribution * distribution.log()).sum(-1).detach()
        )
    assert (log_probs[~mask.bool()] == 0).all() and (entropy[~mask.bool()] == 0).all()


def test_compute_logprobs_rejects_bad_arguments():
    model = PositionWiseModel()
    input_ids, mask = batch()
    with pytest.raises(ValueError, match="same shape"):
        compute_logprobs(model, input_ids[:, :5], mask, ParallelContext())
    with pytest.raises(TypeError, match="input_ids"):
        compute_logprobs(model, input_ids.float(), mask, ParallelContext())
    with pytest.raises(ValueError, match="temperature"):
        compute_logprobs(model, input_ids, mask, ParallelContext(), temperature=0.0)
    with pytest.raises(ValueError, match="zero valid tokens"):
        compute_logprobs(model, input_ids, torch.zeros_like(mask), ParallelContext())


# --------------------------------------------------------------------------------------- tiny Megatron GPT
def tiny_gpt_pass(cp_size, attention, query_groups):
    from verl_cppack.runtime.tiny_gpt import build_tiny_gpt, init_megatron_parallel

    ctx = init_megatron_parallel(cp_size=cp_size)
    model = build_tiny_gpt(vocab_size=VOCAB, num_query_groups=query_groups, attention=attention, seed=3)
    input_ids, mask = batch(seed=1)
    log_probs, entropy = compute_logprobs(model, input_ids, mask, ctx, with_entropy=True)
    weights = torch.randn(2, 4, 20, generator=torch.Generator().manual_seed(5))
    ((log_probs * weights[0]).sum() + (entropy * weights[1]).sum()).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    if cp_size > 1:
        for grad in grads.values():
            dist.all_reduce(grad, group=ctx.cp_group)  # Megatron's DP x CP gradient reduction, as a sum
    return model, log_probs.detach(), entropy.detach(), grads


def tiny_gpt_rank(rank, world_size):
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    report = {}
    for attention, query_groups in (("allgather", 2), ("ring", 2)):  # GQA: 4 query heads, 2 groups
        _, ref_log_probs, ref_entropy, ref_grads = tiny_gpt_pass(1, attention, query_groups)
        _, log_probs, entropy, grads = tiny_gpt_pass(world_size, attention, query_groups)
        report[(attention, query_groups)] = (
            (log_probs - ref_log_probs).abs().max().item(),
            (entropy - ref_entropy).abs().max().item(),
            max(((grads[n] - g).abs().max() / g.abs().max()).item() for n, g in ref_grads.items()),
            all(g.abs().max() > 0 for g in ref_grads.values()),
        )
    return report


@pytest.mark.slow  # gloo worlds with Megatron imported in every rank
@pytest.mark.stacks
def test_tiny_gpt_log_probs_entropy_and_gradients_do_not_depend_on_cp(cp_world):
    cp_size, per_rank = cp_world
    for report in (result["tiny_gpt"] for result in per_rank):
        for (attention, groups), (log_prob_diff, entropy_diff, grad_rel_diff, all_params_learn) in report.items():
            where = f"cp={cp_size} attention={attention} query_groups={groups}"
            assert log_prob_diff <= 1e-5, where
            assert entropy_diff <= 1e-5, where
            assert grad_rel_diff <= 1e-4, where
            assert all_params_learn, where


def packed_equals_padded_rank(rank, world_size):
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    from verl_cppack.integrations.megatron import packed_seq_params
    from verl_cppack.packing.builders import plan_from_mask
    from verl_cppack.runtime.tiny_gpt import build_tiny_gpt, init_megatron_parallel

    ctx = init_megatron_parallel()
    model = build_tiny_gpt(vocab_size=VOCAB, num_query_groups=2)
    input_ids, mask = batch(seed=2)
    plan = plan_from_mask(mask, ctx)
    packed = plan.unpack(
        model(
            input_ids=plan.pack(input_ids),
            position_ids=None,
            attention_mask=None,
            packed_seq_params=packed_seq_params(plan),
        )
    )  # [B, S, V]
    # BSHD oracle: each row alone, its valid tokens moved to the front
    rows = []
    for row in range(4):
        tokens = input_ids[row][mask[row].bool()].unsqueeze(0)
        positions = torch.arange(tokens.shape[1]).unsqueeze(0)
        rows.append(model(input_ids=tokens, position_ids=positions, attention_mask=None)[0])
    return packed.detach(), [r.detach() for r in rows]


@pytest.mark.slow  # a gloo world with Megatron imported
@pytest.mark.stacks
def test_packed_thd_forward_equals_each_row_run_alone():
    packed, rows = run_gloo(packed_equals_padded_rank, 1)[0]
    _, mask = batch(seed=2)
    for row, alone in enumerate(rows):
        torch.testing.assert_close(packed[row][mask[row].bool()], alone, atol=1e-5, rtol=1e-5)


def test_cpu_rng_tracker_forks_its_own_stream_and_restores_the_caller_state():
    from verl_cppack.runtime.tiny_gpt import CpuRNGStatesTracker

    tracker = CpuRNGStatesTracker()
    tracker.add("model-parallel-rng", 1234)
    torch.manual_seed(0)
    outside_before = torch.get_rng_state()
    with tracker.fork():
        first = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), outside_before)
    with tracker.fork():
        second = torch.rand(3)
    assert torch.equal(first, torch.rand(3, generator=torch.Generator().manual_seed(1234)))
    assert not torch.equal(first, second)  # the tracked stream advanced
    with pytest.raises(ValueError, match="already added"):
        tracker.add("model-parallel-rng", 1234)


def test_init_megatron_parallel_needs_torch_distributed():
    from verl_cppack.runtime.tiny_gpt import init_megatron_parallel

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    with pytest.raises(ValueError, match="init_process_group"):
        init_megatron_parallel(cp_size=2)


def test_core_attention_module_thd_and_bshd_calls_match_the_reference():
    from types import SimpleNamespace

    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    from verl_cppack.attention import reference_attention
    from verl_cppack.attention.core_attention import ContextParallelCoreAttention

    config = TransformerConfig(
        num_layers=1, hidden_size=16, num_attention_heads=4, num_query_groups=2, attention_dropout=0.0
    )
    module = ContextParallelCoreAttention(
        config, 1, AttnMaskType.causal, "self", pg_collection=SimpleNamespace(cp=None), use_te=False
    )
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(6, 2, n, 4, generator=generator) for n in (4, 2, 2))  # [s, b, heads|groups, d]

    # THD: the two rows packed one after the other as slots of 6
    thd = [x.transpose(0, 1).reshape(12, -1, 4) for x in (q, k, v)]
    cu_padded = torch.tensor([0, 6, 12], dtype=torch.int32)
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu_padded,
        cu_seqlens_kv=cu_padded,
        cu_seqlens_q_padded=cu_padded,
        cu_seqlens_kv_padded=cu_padded,
        max_seqlen_q=6,
        max_seqlen_kv=6,
    )
    expected = reference_attention(*thd, cu_padded)  # [12, 4, 4]
    torch.testing.assert_close(module(*thd, None, packed_seq_params=params), expected.reshape(12, 16))

    # BSHD, row 1 left-padded by 2: its first two keys are masked for every query
    padding = torch.zeros(2, 1, 6, 6, dtype=torch.bool)
    padding[1, :, :, :2] = True
    out = module(q, k, v, padding).view(6, 2, 4, 4)
    torch.testing.assert_close(out[:, 0], expected[:6])
    row1 = reference_attention(*(x[2:, 1] for x in (q, k, v)), torch.tensor([0, 4], dtype=torch.int32))
    torch.testing.assert_close(out[2:, 1], row1)
    assert torch.equal(out[:2, 1], torch.zeros_like(out[:2, 1]))  # queries that see no key give 0, not NaN
