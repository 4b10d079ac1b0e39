"""The counting task's reward model, the checkpoint ``verl-cppack ppo`` starts verl's critic from.

What the critic inherits is the trunk (verl puts a fresh value head on it), so the specification is about the
trunk: a least-squares linear readout of its last hidden state scores held-out responses almost exactly, where
the same readout of the policy's random trunk cannot. The labels come from the task's own reward function.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.verl_engine_cases import TINY as ENGINE_TINY  # noqa: E402
from verl_cppack.jobs import counting_reward_model as reward_model  # noqa: E402
from verl_cppack.jobs.counting_reward import RESPONSE_LENGTH, SYMBOLS, score_response  # noqa: E402
from verl_cppack.jobs.counting_task import build_tokenizer, ensure_counting_assets  # noqa: E402

TINY = replace(ENGINE_TINY, train_prompts=8, test_prompts=8)  # the engine tests' tiny Llama, more data
QUICK = reward_model.RewardModelTraining()  # the default training, on a smaller model


@given(seed=st.integers(0, 2**32 - 1))
@settings(max_examples=50, deadline=None)
def test_made_up_responses_are_scored_by_the_tasks_reward_function(seed):
    prompt, response, score = reward_model.sample_scored_response(random.Random(seed))
    assert len(prompt) >= 2 and set(prompt + response) <= set(SYMBOLS) and len(response) <= RESPONSE_LENGTH
    assert score == score_response(prompt[-1], response)


def test_made_up_responses_cover_bad_and_good_scores():
    rng = random.Random(0)
    scores = [reward_model.sample_scored_response(rng)[2] for _ in range(2000)]
    assert sum(score <= 1 / 6 for score in scores) > 200 and sum(score >= 5 / 6 for score in scores) > 200
    assert len(set(scores)) == RESPONSE_LENGTH + 1


def readout_explained_variance(directory, rng_seed: int) -> float:
    """Fit a linear readout of the trunk's last-token state by least squares; explained variance on other responses."""
    from transformers import LlamaForCausalLM

    trunk = LlamaForCausalLM.from_pretrained(directory).model
    tokenizer = build_tokenizer()
    rng = random.Random(rng_seed)

    def features_and_scores(count):
        samples = [reward_model.sample_scored_response(rng) for _ in range(count)]
        input_ids, attention_mask, last_position = reward_model.encode_batch(tokenizer, samples)
        with torch.no_grad():
            hidden = trunk(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        features = hidden[torch.arange(count), last_position].double()  # [count, hidden]
        features = torch.cat([features, torch.ones(count, 1, dtype=torch.float64)], dim=1)
        return features, torch.tensor([score for _, _, score in samples], dtype=torch.float64)

    train_features, train_scores = features_and_scores(1024)
    weights = torch.linalg.lstsq(train_features, train_scores[:, None]).solution
    test_features, test_scores = features_and_scores(512)
    predicted = (test_features @ weights).squeeze(1)
    return float(1 - torch.var(test_scores - predicted) / torch.var(test_scores))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    paths = ensure_counting_assets(TINY, root=tmp_path_factory.mktemp("counting"))
    return paths, reward_model.ensure_counting_reward_model(paths, QUICK)


@pytest.mark.slow  # trains the reward model (minutes)
def test_the_reward_models_trunk_scores_responses_the_policys_random_trunk_cannot(trained):
    paths, directory = trained
    assert readout_explained_variance(directory, rng_seed=7) > 0.9
    assert readout_explained_variance(paths.model, rng_seed=7) < 0.5


@pytest.mark.slow  # trains the reward model (minutes)
def test_the_reward_model_is_a_checkpoint_verl_can_start_a_critic_from(trained):
    import json

    from transformers import AutoConfig, AutoTokenizer

    paths, directory = trained
    assert directory == reward_model.reward_model_dir(paths, QUICK)
    assert AutoConfig.from_pretrained(directory).to_dict()["hidden_size"] == TINY.hidden_size
    assert AutoTokenizer.from_pretrained(directory).get_vocab() == build_tokenizer().get_vocab()
    quality = json.loads((directory / "training.json").read_text())
    assert quality["held_out_explained_variance"] > 0.9


@pytest.mark.slow  # trains the reward model (minutes)
def test_a_made_reward_model_is_reused_not_retrained(trained, monkeypatch):
    paths, directory = trained
    monkeypatch.setattr(reward_model, "train_reward_model", lambda *args: pytest.fail("retrained"))
    assert reward_model.ensure_counting_reward_model(paths, QUICK) == directory


@pytest.mark.slow  # trains the reward model (minutes)
def test_a_failed_training_leaves_nothing_a_later_run_would_trust(trained, monkeypatch):
    paths, _ = trained
    other = reward_model.RewardModelTraining(updates=1, seed=1)

    def crash(policy_model, directory, training):
        (directory / "model.safetensors").write_text("half written")
        raise RuntimeError("killed mid-training")

    monkeypatch.setattr(reward_model, "train_reward_model", crash)
    with pytest.raises(RuntimeError, match="killed"):
        reward_model.ensure_counting_reward_model(paths, other)
    name = reward_model.reward_model_dir(paths, other).name
    assert not any(path.name.startswith(name) for path in paths.root.iterdir())


def test_the_ppo_job_starts_its_critic_from_the_reward_model_and_trains_it_only_when_used(tmp_path, monkeypatch):
    """The reward model is made after verl's config is composed (a misspelt key costs no training) and only when
    the critic still points at it; the actor keeps the policy's checkpoint; `verl-cppack ppo`'s defaults (the actor's
    learning rate and bonus, the batch) reach verl's config."""
    pytest.importorskip("verl")
    import shutil

    from verl_cppack.cli import build_parser
    from verl_cppack.cli.trainer_job import settings_from_args
    from verl_cppack.jobs import ppo
    from verl_cppack.jobs.counting_task import CACHE_ENV
    from verl_cppack.jobs.verl_job import JobSettings, prepare_job

    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    assets = ensure_counting_assets()
    made = []

    def stand_in(paths):  # the policy's checkpoint where the reward model goes: no half minute of training here
        made.append(paths)
        shutil.copytree(paths.model, reward_model.reward_model_dir(paths))
        (reward_model.reward_model_dir(paths) / "training.json").write_text("{}")

    monkeypatch.setattr(ppo, "ensure_counting_reward_model", stand_in)
    with pytest.raises(ValueError, match="rejects the overrides"):
        prepare_job(ppo.PPO, JobSettings(overrides=("critic.no_such_key=1",)), output_dir=tmp_path / "a")
    settings = JobSettings(overrides=(f"critic.model.path={assets.model}",))
    config = prepare_job(ppo.PPO, settings, output_dir=tmp_path / "b").config
    assert made == [] and config.critic.model.path == str(assets.model)
    defaults = settings_from_args(build_parser().parse_args(["ppo", "--output", str(tmp_path / "c")]))
    config = prepare_job(ppo.PPO, defaults).config  # what `verl-cppack ppo` composes
    # named relative to the task directory, every worker's working directory
    assert made == [assets] and config.critic.model.path == reward_model.reward_model_dir(assets).name
    assert config.actor_rollout_ref.model.path == "model"
    assert config.actor_rollout_ref.actor.entropy_coeff == 0.01  # PPO's entropy bonus (the PPO paper's c2)
    assert config.actor_rollout_ref.actor.optim.lr == 1e-3  # a third of grpo's: at 3e-3 the actor collapsed
    assert config.data.train_batch_size == 32 and config.actor_rollout_ref.rollout.n == 4
    prepare_job(ppo.PPO, JobSettings(), output_dir=tmp_path / "d")
    assert made == [assets]  # made once
