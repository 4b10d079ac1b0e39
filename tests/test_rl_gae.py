"""GAE against a straightforward per-sequence reference on random rollouts (left-padded prompts, right-padded responses)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verl_cppack.rl.gae import gae_advantages, whiten


def reference_gae(rewards, values, mask, gamma, lam):
    """Per sequence: keep the masked positions, run textbook GAE on that list (V after the end = 0)."""
    advantages = [[0.0] * len(row) for row in rewards]
    for b in range(len(rewards)):
        positions = [t for t, m in enumerate(mask[b]) if m]
        running, next_value = 0.0, 0.0
        for t in reversed(positions):
            delta = rewards[b][t] + gamma * next_value - values[b][t]
            running = delta + gamma * lam * running
            advantages[b][t] = running
            next_value = values[b][t]
    return advantages


@st.composite
def rollouts(draw):
    batch = draw(st.integers(1, 5))
    prompt_width, response_width = draw(st.integers(1, 4)), draw(st.integers(1, 6))
    mask = []
    for _ in range(batch):
        prompt = draw(st.integers(0, prompt_width))
        response = draw(st.integers(0, response_width))
        gap = draw(st.booleans()) and response > 2  # an observation token inside the response
        row = [0] * prompt_width + [1] * response + [0] * (response_width - response)
        if gap:
            row[prompt_width + 1] = 0
        mask.append(row)
    width = prompt_width + response_width
    floats = st.floats(-2, 2, allow_nan=False, width=32)
    rewards = [[draw(floats) for _ in range(width)] for _ in range(batch)]
    values = [[draw(floats) for _ in range(width)] for _ in range(batch)]
    return rewards, values, mask


@settings(max_examples=80, deadline=None)
@given(rollouts(), st.sampled_from([1.0, 0.99, 0.5]), st.sampled_from([1.0, 0.95, 0.0]))
def test_gae_matches_per_sequence_reference(rollout, gamma, lam):
    rewards, values, mask = rollout
    advantages, returns = gae_advantages(
        torch.tensor(rewards, dtype=torch.float64), torch.tensor(values, dtype=torch.float64),
        torch.tensor(mask, dtype=torch.bool), gamma=gamma, lam=lam,
    )
    expected = torch.tensor(reference_gae(rewards, values, mask, gamma, lam), dtype=torch.float64)
    assert torch.allclose(advantages, expected, atol=1e-9)
    mask_tensor = torch.tensor(mask, dtype=torch.bool)
    assert torch.allclose(returns, torch.where(mask_tensor, expected + torch.tensor(values, dtype=torch.float64), 0.0))


def test_single_terminal_reward_by_hand():
    # one response of 3 tokens, reward 1 on the last, values 0.5: gamma=1, lam=1 -> A_t = 1 - 0.5
    rewards = torch.tensor([[0.0, 0.0, 0.0, 1.0]])
    values = torch.tensor([[9.0, 0.5, 0.5, 0.5]])
    mask = torch.tensor([[0, 1, 1, 1]])
    advantages, returns = gae_advantages(rewards, values, mask, gamma=1.0, lam=1.0)
    assert advantages.tolist() == [[0.0, 0.5, 0.5, 0.5]]
    assert returns.tolist() == [[0.0, 1.0, 1.0, 1.0]]


def test_whiten_is_zero_mean_unit_variance_on_the_mask():
    values = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    mask = torch.tensor([[True, True, True, False]])
    out = whiten(values, mask)
    assert out[0, 3] == 0
    assert torch.allclose(out[mask].mean(), torch.tensor(0.0), atol=1e-6)
    assert torch.allclose(out[mask].var(unbiased=True), torch.tensor(1.0), atol=1e-5)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(rewards=torch.zeros(2, 3), values=torch.zeros(2, 4), mask=torch.ones(2, 3, dtype=torch.bool)), ValueError, "share one"),
        (dict(rewards=torch.zeros(3), values=torch.zeros(3), mask=torch.ones(3, dtype=torch.bool)), ValueError, r"\[B, S\]"),
        (dict(rewards=torch.zeros(1, 2), values=torch.zeros(1, 2), mask=torch.tensor([[2, 1]])), ValueError, "0/1"),
        (dict(rewards=torch.zeros(1, 2, dtype=torch.long), values=torch.zeros(1, 2), mask=torch.ones(1, 2, dtype=torch.bool)), TypeError, "floating"),
    ],
)
def test_bad_input(kwargs, error, match):
    with pytest.raises(error, match=match):
        gae_advantages(**kwargs, gamma=1.0, lam=1.0)
    with pytest.raises(ValueError, match="gamma"):
        gae_advantages(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool), gamma=1.5, lam=1.0)
    with pytest.raises(ValueError, match="at least 2"):
        whiten(torch.zeros(1, 2), torch.tensor([[True, False]]))
