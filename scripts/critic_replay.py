"""Replay a PPO run's rollouts through a critic trained as verl's is; print its explained variance per step.

A diagnostic for the counting task (the evidence behind the PPO job's critic settings, README Results): run
``verl-cppack ppo ... trainer.rollout_data_dir=DUMP`` once, then try critic settings here in seconds instead of a
five-minute run each. The critic is the task's Llama with a fresh bias-free value head (what verl's Megatron
critic builds), trained with verl's clipped value loss (``cliprange_value`` 0.5, token mean), AdamW with weight
decay 0.01 and gradient clipping at 1.0, ``--epochs`` passes of ``--mini-batches`` updates per step; returns are
the score at every response position (verl's GAE with gamma = lambda = 1). The explained variance of a step is
computed, as verl's ``critic/vf_explained_var`` is, from the values before that step's update. The actor is not
replayed: the rollouts are the dumped run's. ``--lookup`` also prints what a lookup table reaches that knows how
many earlier tokens were right and whether the last one was, fitted on the previous step's rollouts;
``--per-position`` where along the response the critic and the lookup err (README, Results: "What is left").

usage: python scripts/critic_replay.py DUMP [--init policy|reward-model|DIR] [--lr LR] [--epochs N]
       [--mini-batches N] [--seed 0] [--lookup] [--per-position]      (defaults: the PPO job's critic settings)
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import torch

from verl_cppack.jobs.counting_reward import RESPONSE_LENGTH, correct_positions
from verl_cppack.jobs.counting_reward_model import encode_batch
from verl_cppack.jobs.counting_task import build_tokenizer, ensure_counting_assets
from verl_cppack.jobs.output import fifth_means
from verl_cppack.jobs.ppo import CRITIC_EPOCHS, CRITIC_LEARNING_RATE
from verl_cppack.jobs.trainer_config import CpuRun

CRITIC_MINI_BATCHES = CpuRun.mini_batches  # the PPO job's critic.ppo_mini_batch_size is the batch over this


def load_steps(dump: Path) -> list[list[dict]]:
    """The dumped rollouts, one list of rows per step (``ValueError`` for anything that is not such a dump)."""
    files = sorted((path for path in dump.glob("*.jsonl") if path.stem.isdigit()), key=lambda path: int(path.stem))
    if not dump.is_dir() or not files:
        raise ValueError(f"no <step>.jsonl in {dump}: pass the directory a run's trainer.rollout_data_dir named")
    steps = []
    for path in files:
        try:
            rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            if not rows or not all(
                isinstance(row["input"], str)
                and row["input"]
                and isinstance(row["output"], str)
                and isinstance(row["score"], (int, float))
                for row in rows
            ):
                raise ValueError("a row without a non-empty input, an output and a score")
        except (ValueError, KeyError, TypeError) as error:
            raise ValueError(f"{path} is not a verl rollout dump ({error})") from error
        steps.append(rows)
    return steps


def response_positions(rows: list[dict], last_position: torch.Tensor):
    """Where each response token's value is read (the position before it) ``[batch, R]``, its mask, its return."""
    lengths = torch.tensor([min(len(row["output"]) + 1, RESPONSE_LENGTH) for row in rows])  # EOS counts as a token
    offsets = torch.arange(RESPONSE_LENGTH)
    mask = offsets[None, :] < lengths[:, None]  # [batch, R]
    positions = (last_position - lengths)[:, None] + offsets[None, :]  # [batch, R]
    returns = torch.tensor([row["score"] for row in rows])[:, None].expand(-1, RESPONSE_LENGTH)
    return positions.clamp(min=0, max=int(last_position.max())), mask, returns  # masked-out ones: any real position


def explained_variance(values, returns, mask) -> float:
    """verl's ``critic/vf_explained_var`` (``metric_utils.compute_data_metrics``): 1 - var(returns - values) /
    (var(returns) + 1e-5) over the tokens in ``mask``."""
    valid_returns, valid_values = returns[mask], values[mask]
    return float(1 - torch.var(valid_returns - valid_values) / (torch.var(valid_returns) + 1e-5))


def replay(steps, trunk, head, lr: float, epochs: int, mini_batches: int, seed: int, seen: list | None = None):
    """The critic's explained variance per step; ``seen`` (if given) receives each step's ``(values, returns, mask)``,
    the values being those before the step's update, ``[batch, R]`` each."""
    parameters = [*trunk.parameters(), *head.parameters()]
    optimizer = torch.optim.AdamW(parameters, lr=lr, weight_decay=0.01)
    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    history = []
    for rows in steps:
        samples = [(row["input"], row["output"], row["score"]) for row in rows]
        input_ids, attention_mask, last_position = encode_batch(tokenizer, samples)
        positions, mask, returns = response_positions(rows, last_position)

        def values(index):
            hidden = trunk(input_ids=input_ids[index], attention_mask=attention_mask[index]).last_hidden_state
            return torch.gather(head(hidden).squeeze(-1), 1, positions[index])  # [rows, R]

        everything = torch.arange(len(rows))
        with torch.no_grad():
            old = values(everything)
        history.append(explained_variance(old, returns, mask))
        if seen is not None:
            seen.append((old, returns, mask))
        for _ in range(epochs):
            for index in everything.chunk(mini_batches):
                new = values(index)
                clipped = torch.maximum(torch.minimum(new, old[index] + 0.5), old[index] - 0.5)
                losses = torch.maximum((new - returns[index]) ** 2, (clipped - returns[index]) ** 2)
                loss = 0.5 * losses[mask[index]].mean()
                optimizer.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(parameters, 1.0)
                optimizer.step()
    return history


def lookup_key(flags: list[bool], t: int):
    """What the lookup knows before response token ``t``: t, how many earlier tokens were right, was the last one."""
    return t, sum(flags[:t]), flags[t - 1] if t else None


def lookup_predictions(steps) -> list[torch.Tensor | None]:
    """Per step, a lookup's values ``[batch, R]`` (zero where no token is): the mean return of the previous step's
    tokens with the same ``lookup_key``, or of all of them for a key it never saw; ``None`` for the first step."""

    def cells(rows):
        for index, row in enumerate(rows):
            flags = correct_positions(row["input"][-1], row["output"])
            for t in range(min(len(row["output"]) + 1, RESPONSE_LENGTH)):
                yield index, t, lookup_key(flags, t), row["score"]

    predictions = [None]
    for previous, rows in zip(steps, steps[1:]):
        table = defaultdict(list)
        for _, _, key, score in cells(previous):
            table[key].append(score)
        fallback = sum(map(sum, table.values())) / sum(map(len, table.values()))
        predicted = torch.zeros(len(rows), RESPONSE_LENGTH)
        for index, t, key, _ in cells(rows):
            predicted[index, t] = sum(table[key]) / len(table[key]) if key in table else fallback
        predictions.append(predicted)
    return predictions


def per_position_table(seen, lookups) -> str:
    """Over the last fifth of steps, per response position: the returns' variance, the critic's mean error and mean
    squared error, and the lookup's mean squared error (a critic that explains nothing at a position has a mean
    squared error of about the variance there)."""
    width = max(1, len(seen) // 5)
    lines = ["position  return variance  critic mean error  critic squared error  lookup squared error"]
    for t in range(RESPONSE_LENGTH):
        figures = []
        for (values, returns, mask), lookup in zip(seen[-width:], lookups[-width:]):
            at = mask[:, t]
            if at.sum() < 2:  # no variance to speak of
                continue
            error = values[at, t] - returns[at, t]
            no_lookup = torch.full_like(error, float("nan"))  # the first step has none
            lookup_error = no_lookup if lookup is None else lookup[at, t] - returns[at, t]
            figures.append([returns[at, t].var(), error.mean(), (error**2).mean(), (lookup_error**2).mean()])
        if not figures:
            lines.append(f"{t:8d}  fewer than two tokens at this position in every step")
            continue
        mean = torch.tensor(figures).mean(dim=0).tolist()
        lines.append(f"{t:8d}  {mean[0]:15.4f}  {mean[1]:+17.3f}  {mean[2]:20.4f}  {mean[3]:20.4f}")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dump", type=Path, help="the run's trainer.rollout_data_dir")
    parser.add_argument("--init", default="reward-model", help="policy, reward-model or a checkpoint directory")
    parser.add_argument("--lr", type=float, default=CRITIC_LEARNING_RATE)
    parser.add_argument("--epochs", type=int, default=CRITIC_EPOCHS)
    parser.add_argument("--mini-batches", type=int, default=CRITIC_MINI_BATCHES)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lookup", action="store_true", help="also the lookup reference")
    parser.add_argument(
        "--per-position",
        action="store_true",
        help="also the critic's and the lookup's errors per response position, last fifth of steps",
    )
    args = parser.parse_args(argv)
    if not 0 < args.lr < 1 or args.epochs < 1 or args.mini_batches < 1 or args.seed < 0:
        parser.error("--lr must be in (0, 1), --epochs and --mini-batches >= 1, --seed >= 0")
    if args.init not in ("policy", "reward-model") and not (Path(args.init) / "config.json").is_file():
        parser.error(f"--init {args.init}: not policy, reward-model or a Hugging Face checkpoint directory")
    try:
        steps = load_steps(args.dump)
    except ValueError as error:
        parser.error(str(error))

    from transformers import LlamaForCausalLM

    from verl_cppack.jobs.counting_reward_model import ensure_counting_reward_model

    paths = ensure_counting_assets()
    init = {"policy": paths.model, "reward-model": None}.get(args.init, Path(args.init))
    init = init or ensure_counting_reward_model(paths)
    torch.manual_seed(args.seed)
    trunk = LlamaForCausalLM.from_pretrained(init, torch_dtype=torch.float32).model
    head = torch.nn.Linear(trunk.config.hidden_size, 1, bias=False)
    seen = []
    history = replay(steps, trunk, head, args.lr, args.epochs, args.mini_batches, args.seed, seen)
    print(
        f"critic from {args.init}, lr {args.lr}, {args.epochs} epoch(s) x {args.mini_batches} mini-batches: "
        f"explained variance last fifth {fifth_means(history)[1]:.3f}; per step {[round(x, 2) for x in history]}"
    )
    lookups = lookup_predictions(steps) if args.lookup or args.per_position else []
    if args.lookup and len(steps) < 2:
        print("lookup reference: none (it is fitted on the step before; the dump has one step)")
    elif args.lookup:
        history = [float("nan")] + [
            explained_variance(lookup, returns, mask) for lookup, (_, returns, mask) in zip(lookups[1:], seen[1:])
        ]
        print(
            f"lookup reference: last fifth {fifth_means(history[1:])[1]:.3f}; per step {[round(x, 2) for x in history]}"
        )
    if args.per_position:
        print(per_position_table(seen, lookups))


if __name__ == "__main__":
    main()
