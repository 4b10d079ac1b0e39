"""The counting task's reward model: the checkpoint ``verl-cppack ppo`` initialises verl's critic from.

The task's tiny Llama trained to predict ``score_response`` at the last token, saved as a ``LlamaForCausalLM``."""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

from verl_cppack.jobs.counting_reward import RESPONSE_LENGTH, SYMBOLS, score_response, successor
from verl_cppack.jobs.counting_task import EOS, CountingPaths, build_tokenizer, dataclass_key, made_once, sample_prompt


@dataclass(frozen=True)
class RewardModelTraining:
    """How the reward model is trained; every field is part of its directory name."""

    updates: int = 600
    batch_size: int = 64
    learning_rate: float = 3e-3
    seed: int = 0
    version: int = 1  # bump when what is made changes


def sample_scored_response(rng: random.Random) -> tuple[str, str, float]:
    """A prompt, a made-up response and its score, scores spread over [0, 1]; one response in ten stops early."""
    prompt = sample_prompt(rng)
    counting = rng.random()
    length = rng.randint(0, RESPONSE_LENGTH - 1) if rng.random() < 0.1 else RESPONSE_LENGTH
    previous, response = prompt[-1], []
    for _ in range(length):
        previous = successor(previous) if rng.random() < counting else rng.choice(SYMBOLS)
        response.append(previous)
    text = "".join(response)
    return prompt, text, score_response(prompt[-1], text)


def encode_batch(tokenizer, samples):
    """``(prompt, response, score)`` rows as ``input_ids``/``attention_mask`` ``[batch, max_length]``, right-padded,
    and each row's last position ``[batch]``; a response shorter than ``RESPONSE_LENGTH`` ends with ``EOS``."""
    import torch

    rows = [
        tokenizer(prompt + response + (EOS if len(response) < RESPONSE_LENGTH else ""))["input_ids"]
        for prompt, response, _ in samples
    ]
    max_length = max(map(len, rows))
    input_ids = torch.zeros(len(rows), max_length, dtype=torch.long)  # [batch, max_length]
    attention_mask = torch.zeros_like(input_ids)
    for index, row in enumerate(rows):
        input_ids[index, : len(row)] = torch.tensor(row)
        attention_mask[index, : len(row)] = 1
    last_position = attention_mask.sum(dim=1) - 1  # [batch]
    return input_ids, attention_mask, last_position


def predicted_scores(trunk, score_head, batch):
    """The reward model's score of each row, read at its last token: ``[batch]``."""
    import torch

    input_ids, attention_mask, last_position = batch
    hidden = trunk(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state  # [batch, length, hidden]
    return score_head(hidden[torch.arange(len(input_ids)), last_position]).squeeze(-1)


def train_reward_model(policy_model: Path, directory: Path, training: RewardModelTraining) -> dict[str, float]:
    """Train the policy checkpoint's trunk to score responses and save it (and the tokenizer) under ``directory``;
    returns the held-out mean squared error and explained variance (also in ``training.json``)."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(training.seed)
    model = LlamaForCausalLM.from_pretrained(policy_model, torch_dtype=torch.float32)
    score_head = torch.nn.Linear(model.config.hidden_size, 1)
    parameters = [*model.model.parameters(), *score_head.parameters()]
    optimizer = torch.optim.AdamW(parameters, lr=training.learning_rate)
    tokenizer = build_tokenizer()
    rng = random.Random(training.seed)
    for _ in range(training.updates):
        samples = [sample_scored_response(rng) for _ in range(training.batch_size)]
        scores = torch.tensor([score for _, _, score in samples])
        predicted = predicted_scores(model.model, score_head, encode_batch(tokenizer, samples))
        loss = torch.nn.functional.mse_loss(predicted, scores)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    held_out_rng = random.Random(training.seed + 1)
    held_out = [sample_scored_response(held_out_rng) for _ in range(512)]
    scores = torch.tensor([score for _, _, score in held_out])
    with torch.no_grad():
        predicted = predicted_scores(model.model, score_head, encode_batch(tokenizer, held_out))
    quality = {
        "held_out_mse": float(torch.mean((predicted - scores) ** 2)),
        "held_out_explained_variance": float(1 - torch.var(scores - predicted) / torch.var(scores)),
    }
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    (directory / "training.json").write_text(json.dumps({**asdict(training), **quality}, indent=2, sort_keys=True))
    return quality


def reward_model_dir(paths: CountingPaths, training: RewardModelTraining = RewardModelTraining()) -> Path:
    """Where the reward model for ``paths``' policy checkpoint and ``training`` lives (made or not)."""
    return paths.root / f"reward_model-{dataclass_key(training)}"


def ensure_counting_reward_model(paths: CountingPaths, training: RewardModelTraining = RewardModelTraining()) -> Path:
    """``reward_model_dir``, trained first (about half a minute on 2 cores) unless a complete copy is there."""
    return made_once(
        reward_model_dir(paths, training),
        "training.json",
        lambda staging: train_reward_model(paths.model, staging, training),
    )
