"""The PPO driver step without Ray: outcome rewards on the last response token, GAE returns to the critic,
whitened advantages to the actor, metrics; plus the configuration's checks and the CLI's refusal of bad input."""

from __future__ import annotations

import pytest
import torch

from verl_cppack.rl.ppo import PPOConfig, make_ppo_step, outcome_token_rewards
from verl_cppack.rl.ppo_worker import PPOWorkerSettings
from verl_cppack.rl.task import CountingTask


def test_outcome_reward_sits_on_each_rows_last_response_position():
    mask = torch.tensor([[0, 1, 1, 1, 0], [0, 0, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    token_rewards = outcome_token_rewards(torch.tensor([0.5, 1.0, 0.25]), mask)
    expected = torch.tensor([[0, 0, 0, 0.5, 0], [0, 0, 1.0, 0, 0], [0, 0, 0, 0, 0.25]])
    assert torch.equal(token_rewards, expected)


def test_outcome_reward_refuses_a_row_without_response_and_mismatched_shapes():
    with pytest.raises(ValueError, match="at least one response position"):
        outcome_token_rewards(torch.tensor([1.0, 1.0]), torch.tensor([[True, False], [False, False]]))
    with pytest.raises(ValueError, match="same B"):
        outcome_token_rewards(torch.tensor([1.0]), torch.ones(2, 3, dtype=torch.bool))


class RecordingWorkers:
    """Stands in for the Ray WorkerGroup: rank-ordered answers of two CP ranks, the batches it was sent kept."""

    def __init__(self, values_seed: int = 0) -> None:
        self.sent: dict[str, tuple] = {}
        self.generator = torch.Generator().manual_seed(values_seed)

    def call(self, method: str, *args):
        self.sent[method] = args
        if method == "generate":
            prompt_ids, _, response_length, _, _ = args
            responses = torch.randint(0, 16, (prompt_ids.shape[0], response_length), generator=self.generator)
            counting = (prompt_ids[:, -1:] + 1 + torch.arange(response_length)) % 16  # reward 1
            responses[::2] = counting[::2]
            return [responses, None]
        if method == "log_probs":
            ids = args[0]
            return [(torch.zeros(ids.shape), torch.ones(ids.shape)), None]
        if method == "values":
            ids, mask = args
            return [torch.randn(ids.shape, generator=self.generator) * mask, None]
        if method == "update_critic":
            return [dict(value_loss=0.1, value_clip_fraction=0.0, value_mean=0.0, critic_grad_norm=1.0), None]
        if method == "update":
            return [dict(pg_loss=0.0, kl=0.01, clip_fraction=0.0, grad_norm=1.0), None]
        raise AssertionError(method)


def test_ppo_step_sends_gae_returns_to_the_critic_and_whitened_advantages_to_the_actor():
    config = PPOConfig(prompts_per_step=4, group_size=2, gamma=1.0, lam=1.0, steps=2)
    workers = RecordingWorkers()
    record = make_ppo_step(workers, config)(0)

    critic_batch, _ = workers.sent["update_critic"]
    actor_batch, _ = workers.sent["update"]
    prompt_ids, _, _, _, _ = workers.sent["generate"]
    responses = critic_batch["input_ids"][:, prompt_ids.shape[1] :]
    rewards = CountingTask().reward(prompt_ids, responses)  # [8]
    response = critic_batch["loss_mask"].bool()
    values = critic_batch["old_values"]
    # gamma = lam = 1 and a reward only at the end: every response position's return is the sequence reward
    # and its advantage is that reward minus the position's value
    for row in range(8):
        row_returns = critic_batch["returns"][row][response[row]]
        torch.testing.assert_close(row_returns, rewards[row].expand(6), atol=1e-6, rtol=0)
    assert (rewards[::2] == 1).all()
    assert (critic_batch["returns"][~response] == 0).all()
    advantages = (rewards.unsqueeze(1) - values)[response]
    whitened = (advantages - advantages.mean()) / advantages.std()
    torch.testing.assert_close(actor_batch["advantages"][response], whitened, atol=1e-5, rtol=1e-5)
    assert (actor_batch["advantages"][~response] == 0).all()
    assert torch.equal(actor_batch["old_log_probs"], torch.zeros(response.shape))

    returns = critic_batch["returns"][response]
    explained = 1 - (returns - values[response]).var() / (returns.var() + 1e-5)
    assert record["explained_variance"] == pytest.approx(float(explained), rel=1e-5)
    assert record["reward_mean"] == pytest.approx(float(rewards.mean()))
    assert record["value_loss"] == 0.1 and record["kl"] == 0.01 and record["cp"] == 2


def test_critic_warmup_steps_leave_the_actor_alone():
    config = PPOConfig(prompts_per_step=2, group_size=2, steps=3, critic_warmup=1)
    workers = RecordingWorkers()
    step = make_ppo_step(workers, config)
    assert step(0)["actor_updated"] is False and "update" not in workers.sent
    assert step(1)["actor_updated"] is True and "update" in workers.sent


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(gamma=1.5), "gamma must lie in"),
        (dict(lam=-0.1), "lam must lie in"),
        (dict(group_size=0), "group_size must be >= 1"),
        (dict(critic_warmup=30), "critic_warmup"),
        (dict(prompts_per_step=3, group_size=1), "divisible by num_mini_batches"),
    ],
)
def test_ppo_config_refuses_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PPOConfig(**kwargs)


def test_ppo_allows_one_response_per_prompt_and_needs_ppo_worker_settings():
    assert PPOConfig(group_size=1).group_size == 1  # the critic is the baseline, not the group
    from verl_cppack.rl.worker import WorkerSettings

    with pytest.raises(TypeError, match="PPOWorkerSettings"):
        PPOConfig(worker=WorkerSettings())
    with pytest.raises(ValueError, match="value_clip"):
        PPOWorkerSettings(value_clip=0.0)


def test_cli_ppo_refuses_bad_arguments_before_starting_ray(capsys):
    from verl_cppack.cli import main

    assert main(["ppo", "--lam", "2"]) == 2
    assert "lam must lie in [0, 1]" in capsys.readouterr().err
