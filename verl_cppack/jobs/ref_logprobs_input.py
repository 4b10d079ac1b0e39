"""What ``verl-cppack ref-logprobs`` scores, read and checked before any worker starts (else :class:`BadInput`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from verl_cppack.core.checks import require_int
from verl_cppack.jobs.output import fresh_output_dir
from verl_cppack.runtime.megatron_engine import Pair, check_pairs

SYNTHETIC_MAX_PROMPT, SYNTHETIC_MAX_RESPONSE = 6, 6  # the counting task's prompt and response lengths


class BadInput(ValueError):
    """The request cannot run (input, model, flags); raised before any worker starts."""


@dataclass(frozen=True)
class RefLogprobsRequest:
    """A checked request: the pairs, the model and how to run it."""

    pairs: tuple[Pair, ...]
    model: Path
    vocab_size: int
    cp: int
    micro_batch_size: int
    output_dir: Path
    seed: int = 0


def _positive(name: str, value: int) -> int:
    try:
        return require_int(name, value, minimum=1)
    except (TypeError, ValueError) as error:
        raise BadInput(str(error)) from None


def load_pairs(path: str | Path) -> list[Pair]:
    """Rows of ``{"prompt_ids": [...], "response_ids": [...]}`` from ``.jsonl`` or ``.parquet`` (other columns
    are ignored). Raises :class:`BadInput` naming the file, row and column of the first problem."""
    path = Path(path)
    if path.suffix not in (".jsonl", ".parquet"):
        raise BadInput(f"input {path} must end in .jsonl or .parquet")
    if not path.is_file():
        raise BadInput(f"input {path} does not exist or is not a file")
    rows = _read_parquet(path) if path.suffix == ".parquet" else _read_jsonl(path)
    if not rows:
        raise BadInput(f"input {path} has no rows")
    pairs = []
    for index, row in enumerate(rows):
        missing = [column for column in ("prompt_ids", "response_ids") if column not in row]
        if missing:
            raise BadInput(
                f"{path} row {index} needs 'prompt_ids' and 'response_ids', lacks {missing} (has {sorted(row)})"
            )
        # a parquet cell is a numpy array: its tolist() gives Python ints
        pairs.append(
            tuple(ids.tolist() if hasattr(ids, "tolist") else ids for ids in (row["prompt_ids"], row["response_ids"]))
        )
    try:
        check_pairs(pairs)
    except (TypeError, ValueError) as error:
        raise BadInput(f"{path}: {error}") from error
    return pairs


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    rows = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise BadInput(f"cannot read {path}: {error}") from error
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise BadInput(f"{path} line {number} is not JSON: {error}") from error
        if not isinstance(row, dict):
            raise BadInput(f"{path} line {number} must be a JSON object, got {type(row).__name__}")
        rows.append(row)
    return rows


def _read_parquet(path: Path) -> list[dict[str, Any]]:
    try:
        import pandas
    except ImportError as error:
        raise BadInput(
            f"reading {path} needs pandas and pyarrow (pip install pandas pyarrow), or pass a .jsonl"
        ) from error
    try:
        return pandas.read_parquet(path).to_dict("records")
    except Exception as error:  # pyarrow raises its own error types for a file that is not parquet
        raise BadInput(f"cannot read {path} as parquet: {type(error).__name__}: {error}") from error


def synthetic_pairs(count: int, vocab_size: int, seed: int) -> list[Pair]:
    """``count`` pairs of random ids in ``[0, vocab_size)``, prompts and responses of 1..6 tokens, from ``seed``."""
    _positive("--synthetic", count)
    _positive("vocab_size", vocab_size)
    generator = torch.Generator().manual_seed(seed)
    prompt_lengths = torch.randint(1, SYNTHETIC_MAX_PROMPT + 1, (count,), generator=generator).tolist()
    response_lengths = torch.randint(1, SYNTHETIC_MAX_RESPONSE + 1, (count,), generator=generator).tolist()
    ids = torch.randint(0, vocab_size, (count, SYNTHETIC_MAX_PROMPT + SYNTHETIC_MAX_RESPONSE), generator=generator)
    return [
        (ids[row, :prompt].tolist(), ids[row, SYNTHETIC_MAX_PROMPT : SYNTHETIC_MAX_PROMPT + response].tolist())
        for row, (prompt, response) in enumerate(zip(prompt_lengths, response_lengths, strict=True))
    ]


def model_vocab_size(model: str | Path) -> int:
    """``vocab_size`` from ``model/config.json`` (a Hugging Face checkpoint directory)."""
    config_path = Path(model) / "config.json"
    if not Path(model).is_dir():
        raise BadInput(f"--model {model} is not a directory (a Hugging Face checkpoint with config.json)")
    if not config_path.is_file():
        raise BadInput(f"--model {model} has no config.json; pass a Hugging Face checkpoint directory")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise BadInput(f"cannot read {config_path}: {error}") from error
    vocab_size = config.get("vocab_size") if isinstance(config, dict) else None
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
        raise BadInput(f"{config_path} has no positive integer vocab_size (got {vocab_size!r})")
    return vocab_size


def prepare(
    model: str | Path | None = None,
    input_path: str | Path | None = None,
    synthetic: int | None = None,
    cp: int = 2,
    micro_batch_size: int = 8,
    output: str | Path = "runs/ref-logprobs",
    seed: int = 0,
) -> RefLogprobsRequest:
    """Check everything that can be checked without a worker and make the output directory (:class:`BadInput`);
    ``model`` None: the tiny counting model; ``input_path`` wins over ``synthetic``."""
    _positive("--cp", cp)
    _positive("--micro-batch-size", micro_batch_size)
    if input_path is None:
        _positive("--synthetic", synthetic)
    if model is None:
        from verl_cppack.jobs.counting_task import ensure_counting_assets

        try:
            model = ensure_counting_assets().model
        except OSError as error:
            raise BadInput(f"cannot make the tiny counting model in the cache: {error}; pass --model DIR") from error
    vocab_size = model_vocab_size(model)
    pairs = load_pairs(input_path) if input_path is not None else synthetic_pairs(synthetic, vocab_size, seed)
    where = f"{input_path}: " if input_path is not None else ""
    try:
        check_pairs(pairs, vocab_size)
    except ValueError as error:  # a token id >= vocab_size
        raise BadInput(f"{where}{error} of --model {model} (config.json vocab_size)") from error
    try:
        output_dir = fresh_output_dir(output)
    except ValueError as error:
        raise BadInput(str(error)) from error
    return RefLogprobsRequest(tuple(pairs), Path(model).resolve(), vocab_size, cp, micro_batch_size, output_dir, seed)
