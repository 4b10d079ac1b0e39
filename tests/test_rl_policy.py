"""The worker's two log-prob paths agree under CP=2 in real gloo processes, values and gradients.

``forward="verl"`` runs verl's own ``gptmodel_forward_model_engine`` (patched by verl_cppack) on a jagged
batch; ``forward="cppack"`` runs ``verl_cppack.logprobs.compute_logprobs``. Both see the same tiny Megatron
GPT on a rollout-shaped batch (left-padded prompts, right-padded responses).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")
pytest.importorskip("verl")

from tests.distributed import run_gloo  # noqa: E402


def rollout_batch() -> tuple[torch.Tensor, torch.Tensor]:
    from verl_cppack.rl.task import CountingTask

    task = CountingTask()
    generator = torch.Generator().manual_seed(0)
    prompt_ids, prompt_mask = task.sample_prompts(6, generator)
    responses = torch.randint(0, task.vocab_size, (6, task.response_length), generator=generator)
    input_ids = torch.cat([prompt_ids, responses], dim=1)
    attention_mask = torch.cat([prompt_mask, torch.ones_like(responses, dtype=torch.bool)], dim=1)
    attention_mask[0, -2:] = False  # a right-padded (shorter) response
    attention_mask[3, -5:] = False
    return input_ids.masked_fill(~attention_mask, 0), attention_mask


def both_paths(rank: int, world_size: int):
    from verl_cppack.integrations.megatron_model import build_tiny_gpt, init_megatron_parallel
    from verl_cppack.rl.policy import prepare_forward_path, sequence_log_probs

    ctx = init_megatron_parallel(cp_size=world_size)
    prepare_forward_path("verl")
    model = build_tiny_gpt(vocab_size=16, max_sequence_length=64)
    input_ids, attention_mask = rollout_batch()
    results = {}
    for path in ("verl", "cppack"):
        model.zero_grad(set_to_none=True)
        log_probs, entropy = sequence_log_probs(model, input_ids, attention_mask, ctx, with_entropy=True, forward=path)
        (log_probs * torch.linspace(0.5, 1.5, log_probs.shape[1])).sum().backward()
        grads = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
        torch.distributed.all_reduce(grads, group=ctx.cp_group)  # full gradient = sum of the ranks' local parts
        results[path] = (log_probs.detach(), entropy, grads)
    return results


def test_verl_forward_path_equals_compute_logprobs_at_cp2_values_and_gradients():
    for per_rank in run_gloo(both_paths, 2):
        verl_lp, verl_entropy, verl_grads = per_rank["verl"]
        ours_lp, ours_entropy, ours_grads = per_rank["cppack"]
        torch.testing.assert_close(verl_lp, ours_lp, atol=1e-6, rtol=0)
        torch.testing.assert_close(verl_entropy, ours_entropy, atol=1e-6, rtol=0)
        torch.testing.assert_close(verl_grads, ours_grads, atol=1e-6, rtol=1e-5)
    _, attention_mask = rollout_batch()
    log_probs = per_rank["verl"][0]
    # verl alignment: position t scores token t+1; padding and each row's last real token hold 0
    has_next = torch.zeros_like(attention_mask)
    has_next[:, :-1] = attention_mask[:, :-1] & attention_mask[:, 1:]
    assert (log_probs[has_next] < 0).all() and (log_probs[~has_next] == 0).all()
