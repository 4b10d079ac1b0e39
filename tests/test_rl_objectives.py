"""Specification of the GRPO pieces that run on the driver: task and reward, advantages, PPO loss, k3 KL.

Each is checked against a slow, obviously-correct per-row / per-token Python oracle.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verl_cppack.rl import CountingTask, clipped_policy_loss, group_normalized_advantages, low_variance_kl, masked_token_mean

SETTINGS = settings(max_examples=25, deadline=None)


# ---------------------------------------------------------------------------------------------- task
def test_prompts_are_left_padded_with_lengths_in_range():
    task = CountingTask(vocab_size=16, min_prompt_length=2, max_prompt_length=6, response_length=4)
    prompt_ids, prompt_mask = task.sample_prompts(200, torch.Generator().manual_seed(0))
    assert prompt_ids.shape == prompt_mask.shape == (200, 6)
    lengths = prompt_mask.sum(1)
    assert int(lengths.min()) == 2 and int(lengths.max()) == 6  # 200 draws cover both ends
    for row in range(200):
        length = int(lengths[row])
        assert prompt_mask[row].tolist() == [False] * (6 - length) + [True] * length
        assert prompt_ids[row, : 6 - length].eq(0).all()
    assert int(prompt_ids.max()) < 16 and int(prompt_ids.min()) >= 0


def test_reward_is_the_fraction_of_tokens_that_count_up_from_the_previous_one():
    task = CountingTask(vocab_size=10, max_prompt_length=3, response_length=4)
    prompts = torch.tensor([[0, 4, 7], [0, 0, 9], [1, 2, 3]])
    responses = torch.tensor(
        [
            [8, 9, 0, 1],  # all correct, wraps 9 -> 0
            [0, 1, 5, 6],  # 9->0 ok, 0->1 ok, 1->5 no, 5->6 ok
            [3, 3, 3, 3],  # never
        ]
    )
    assert task.reward(prompts, responses).tolist() == [1.0, 0.75, 0.0]


@SETTINGS
@given(st.integers(2, 12), st.integers(1, 5), st.integers(0, 2**31 - 1))
def test_reward_matches_a_per_token_oracle(vocab, response_length, seed):
    task = CountingTask(vocab_size=vocab, max_prompt_length=3, response_length=response_length)
    generator = torch.Generator().manual_seed(seed)
    prompts, _ = task.sample_prompts(7, generator)
    responses = torch.randint(0, vocab, (7, response_length), generator=generator)
    expected = []
    for prompt, response in zip(prompts.tolist(), responses.tolist()):
        previous, hits = prompt[-1], 0
        for token in response:
            hits += token == (previous + 1) % vocab
            previous = token
        expected.append(hits / response_length)
    assert task.reward(prompts, responses).tolist() == pytest.approx(expected)


def test_task_rejects_bad_settings_and_shapes():
    with pytest.raises(ValueError, match="min_prompt_length"):
        CountingTask(min_prompt_length=5, max_prompt_length=4)
    with pytest.raises(ValueError, match="response_length"):
        CountingTask(response_length=0)
    with pytest.raises(ValueError, match="share N"):
        CountingTask().reward(torch.zeros(2, 3, dtype=torch.long), torch.zeros(3, 2, dtype=torch.long))


# -------------------------------------------------------------------------------------- advantages
@SETTINGS
@given(st.integers(1, 5), st.integers(2, 6), st.integers(0, 2**31 - 1))
def test_group_advantages_match_a_per_group_oracle(num_prompts, group_size, seed):
    generator = torch.Generator().manual_seed(seed)
    scores = torch.randint(0, 4, (num_prompts * group_size,), generator=generator).float() / 3  # ties happen
    mask = torch.rand(num_prompts * group_size, 5, generator=generator) > 0.3
    advantages = group_normalized_advantages(scores, mask, group_size)
    values = scores.tolist()
    for row in range(num_prompts * group_size):
        group = values[(row // group_size) * group_size : (row // group_size + 1) * group_size]
        mean = sum(group) / group_size
        std = math.sqrt(sum((v - mean) ** 2 for v in group) / (group_size - 1))
        expected = (values[row] - mean) / (std + 1e-6)
        for column in range(5):
            want = expected if mask[row, column] else 0.0
            assert float(advantages[row, column]) == pytest.approx(want, rel=1e-5, abs=1e-5)


def test_a_group_of_equal_scores_has_zero_advantage():
    advantages = group_normalized_advantages(torch.tensor([0.5, 0.5, 0.5, 1.0, 0.0, 0.5]), torch.ones(6, 2), 3)
    assert advantages[:3].eq(0).all()
    assert advantages[3, 0] > 0 > advantages[4, 0]


def test_advantages_reject_ragged_groups_and_mismatched_masks():
    with pytest.raises(ValueError, match="multiple of group_size"):
        group_normalized_advantages(torch.zeros(5), torch.ones(5, 2), 2)
    with pytest.raises(ValueError, match="group_size must be >= 2"):
        group_normalized_advantages(torch.zeros(4), torch.ones(4, 2), 1)
    with pytest.raises(ValueError, match="response_mask"):
        group_normalized_advantages(torch.zeros(4), torch.ones(3, 2), 2)


# -------------------------------------------------------------------------------------------- losses
def test_k3_kl_is_zero_at_equality_and_matches_its_formula():
    log_probs = torch.tensor([-1.0, -2.0, -0.5])
    ref = torch.tensor([-1.0, -1.0, -3.0])
    kl = low_variance_kl(log_probs, ref)
    expected = [math.exp(r - p) - (r - p) - 1 for p, r in zip(log_probs.tolist(), ref.tolist())]
    assert kl.tolist() == pytest.approx(expected)
    assert kl[0] == 0 and (kl >= 0).all()


def test_k3_kl_is_an_unbiased_estimate_of_kl_under_the_policy():
    torch.manual_seed(0)
    policy = torch.log_softmax(torch.randn(6), 0)
    reference = torch.log_softmax(torch.randn(6), 0)
    samples = torch.multinomial(policy.exp(), 200_000, replacement=True)
    estimate = low_variance_kl(policy[samples], reference[samples]).mean()
    exact = (policy.exp() * (policy - reference)).sum()
    assert float(estimate) == pytest.approx(float(exact), rel=0.03)


@SETTINGS
@given(st.integers(0, 2**31 - 1), st.floats(0.05, 0.5), st.floats(0.0, 0.5))
def test_clipped_loss_matches_a_per_token_oracle(seed, clip_ratio, kl_coef):
    generator = torch.Generator().manual_seed(seed)
    shape = (4, 6)
    log_probs = -torch.rand(shape, generator=generator) * 3
    old = log_probs + (torch.rand(shape, generator=generator) - 0.5)
    ref = log_probs + (torch.rand(shape, generator=generator) - 0.5)
    advantages = torch.randn(shape, generator=generator)
    mask = torch.rand(shape, generator=generator) > 0.4
    mask[0, 0] = True
    out = clipped_policy_loss(log_probs, old, ref, advantages, mask, clip_ratio=clip_ratio, kl_coef=kl_coef)
    pg, kl, clipped_count, count = 0.0, 0.0, 0, 0
    for lp, o, r, a, m in zip(*(t.flatten().tolist() for t in (log_probs, old, ref, advantages, mask))):
        if not m:
            continue
        ratio = math.exp(lp - o)
        plain, clipped = -a * ratio, -a * min(max(ratio, 1 - clip_ratio), 1 + clip_ratio)
        pg += max(plain, clipped)
        clipped_count += clipped > plain
        kl += math.exp(r - lp) - (r - lp) - 1
        count += 1
    assert float(out.pg_loss) == pytest.approx(pg / count, rel=1e-5, abs=1e-6)
    assert float(out.kl) == pytest.approx(kl / count, rel=1e-5, abs=1e-6)
    assert float(out.clip_fraction) == pytest.approx(clipped_count / count)
    assert float(out.loss) == pytest.approx(pg / count + kl_coef * kl / count, rel=1e-5, abs=1e-6)


def test_loss_gradient_at_ratio_one_is_the_policy_gradient():
    log_probs = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    advantages = torch.tensor([[1.0, -2.0, 3.0]])
    mask = torch.tensor([[True, True, False]])
    out = clipped_policy_loss(log_probs, log_probs.detach(), log_probs.detach(), advantages, mask, kl_coef=0.3)
    out.loss.backward()
    # d/dlogp of -A*exp(logp-old) at logp=old is -A; the k3 term has zero gradient at policy == ref; mean over 2
    assert log_probs.grad[0].tolist() == pytest.approx([-0.5, 1.0, 0.0])


def test_zero_response_tokens_is_an_error_not_nan():
    zeros = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="zero tokens"):
        clipped_policy_loss(zeros, zeros, zeros, zeros, torch.zeros(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="same shape"):
        masked_token_mean(zeros, torch.ones(3, 2))
    with pytest.raises(ValueError, match="old_log_probs"):
        clipped_policy_loss(zeros, torch.zeros(2, 2), zeros, zeros, torch.ones(2, 3))
