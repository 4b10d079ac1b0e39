"""Reference log-probs of prompt/response pairs on Ray CP workers (``verl-cppack ref-logprobs``).

Input rows hold ``prompt_ids`` and ``response_ids`` (lists of token ids) in a ``.jsonl`` or ``.parquet`` file,
or come from the synthetic task. Rows are laid out as verl's rollout batches (prompts left-padded, responses
right-padded) and scored by the frozen reference model through the packed CP path; the result for each row
is one log-prob per response token.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from verl_cppack.rl.cluster import WorkerGroup, ray_session
from verl_cppack.jobs.output import fresh_output_dir
from verl_cppack.rl.task import CountingTask
from verl_cppack.rl.worker import WorkerSettings

Pair = tuple[list[int], list[int]]


@dataclass(frozen=True)
class RefLogprobsConfig:
    cp: int = 2
    micro_batch_size: int = 64
    address: str | None = None
    call_timeout_s: float = 120.0
    worker: WorkerSettings = field(default_factory=WorkerSettings)


def load_pairs(path: str | Path) -> list[Pair]:
    """Rows of ``{"prompt_ids": [...], "response_ids": [...]}`` from ``.jsonl`` or ``.parquet``."""
    path = Path(path)
    if path.suffix == ".jsonl":
        rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    elif path.suffix == ".parquet":
        try:
            import pandas
        except ImportError as error:
            raise ImportError("reading parquet needs pandas + pyarrow (pip install pandas pyarrow)") from error
        rows = pandas.read_parquet(path).to_dict("records")
    else:
        raise ValueError(f"input {path} must end in .jsonl or .parquet")
    pairs = []
    for index, row in enumerate(rows):
        if "prompt_ids" not in row or "response_ids" not in row:
            raise ValueError(f"{path} row {index} needs 'prompt_ids' and 'response_ids', has {sorted(row)}")
        pairs.append(([int(t) for t in row["prompt_ids"]], [int(t) for t in row["response_ids"]]))
    return pairs


def synthetic_pairs(task: CountingTask, count: int, seed: int) -> list[Pair]:
    """``count`` counting-task prompts with random responses (ragged lengths on both sides)."""
    generator = torch.Generator().manual_seed(seed)
    prompt_ids, prompt_mask = task.sample_prompts(count, generator)
    response_lengths = torch.randint(1, task.response_length + 1, (count,), generator=generator).tolist()
    responses = torch.randint(0, task.vocab_size, (count, task.response_length), generator=generator)
    return [
        (prompt_ids[row][prompt_mask[row]].tolist(), responses[row, :length].tolist())
        for row, length in enumerate(response_lengths)
    ]


def rollout_layout(pairs: Sequence[Pair]) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(input_ids [B, P+R], attention_mask [B, P+R] bool, P)``: prompts left-padded, responses right-padded."""
    if not pairs:
        raise ValueError("no prompt/response pairs to score")
    for index, (prompt, response) in enumerate(pairs):
        if not prompt or not response:
            raise ValueError(f"pair {index} has an empty prompt or response; both need at least one token")
    prompt_width = max(len(prompt) for prompt, _ in pairs)
    response_width = max(len(response) for _, response in pairs)
    input_ids = torch.zeros(len(pairs), prompt_width + response_width, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids, dtype=torch.bool)
    for row, (prompt, response) in enumerate(pairs):  # input assembly, not a hot path
        start = prompt_width - len(prompt)
        input_ids[row, start:prompt_width] = torch.tensor(prompt)
        input_ids[row, prompt_width : prompt_width + len(response)] = torch.tensor(response)
        attention_mask[row, start : prompt_width + len(response)] = True
    return input_ids, attention_mask, prompt_width


def response_log_probs_of(log_probs: torch.Tensor, prompt_width: int, pairs: Sequence[Pair]) -> list[list[float]]:
    """Cut ``log_probs [B, S]`` (next-token aligned) to each row's response tokens."""
    response = log_probs[:, prompt_width - 1 : -1]  # [B, R]: column j scores response token j
    return [response[row, : len(pairs[row][1])].tolist() for row in range(len(pairs))]


def compute_reference_log_probs(pairs: Sequence[Pair], config: RefLogprobsConfig) -> list[list[float]]:
    """One list of response-token log-probs per pair, computed by ``config.cp`` Ray CP workers."""
    vocab = config.worker.vocab_size
    bad = [i for i, (p, r) in enumerate(pairs) if any(not 0 <= t < vocab for t in p + r)]
    if bad:
        raise ValueError(f"pairs {bad[:5]} hold token ids outside [0, {vocab}); pass a matching vocab size")
    results: list[list[float]] = []
    with ray_session(config.address, num_cpus=max(2, config.cp)):
        workers = WorkerGroup(config.cp, config.worker, call_timeout_s=config.call_timeout_s)
        try:
            workers.start(with_policy=False)
            for start in range(0, len(pairs), config.micro_batch_size):
                chunk = pairs[start : start + config.micro_batch_size]
                input_ids, attention_mask, prompt_width = rollout_layout(chunk)
                log_probs, _ = workers.call("log_probs", input_ids, attention_mask, "reference", False)[0]
                results.extend(response_log_probs_of(log_probs, prompt_width, chunk))
        finally:
            workers.shutdown()
    return results


def write_reference_log_probs(output: str | Path, pairs: Sequence[Pair], log_probs: list[list[float]], config: RefLogprobsConfig) -> Path:
    """``DIR/ref_logprobs.jsonl`` (one row per pair) and ``DIR/config.json`` in a fresh output directory."""
    output_dir = fresh_output_dir(output)
    with (output_dir / "ref_logprobs.jsonl").open("w", encoding="utf-8") as file:
        for index, ((prompt, response), values) in enumerate(zip(pairs, log_probs)):
            row = dict(index=index, prompt_ids=prompt, response_ids=response, ref_log_probs=values)
            file.write(json.dumps(row) + "\n")
    (output_dir / "config.json").write_text(json.dumps(asdict(config), indent=2, default=str) + "\n")
    return output_dir
