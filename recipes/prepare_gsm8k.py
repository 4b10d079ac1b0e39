"""Prepare GSM8K for verl's GRPO trainer: ``train.parquet`` / ``test.parquet`` in verl's RL dataset schema.

    python recipes/prepare_gsm8k.py --output-dir ~/data/gsm8k          # downloads openai/gsm8k (needs network)
    python recipes/prepare_gsm8k.py --local-dir /path/to/gsm8k ...     # a local copy (datasets.load_from_disk / hub dir)

Each row: ``data_source="openai/gsm8k"``, ``prompt`` as chat messages (question + an instruction to end with
"#### <answer>"), ``ability="math"``, ``reward_model={"style": "rule", "ground_truth": <final number>}``,
``extra_info`` (split, index, answer, question). verl's ``gsm8k`` rule reward scores 1.0 when the last
``#### number`` of a response equals the ground truth.
"""

from __future__ import annotations

import argparse
import os
import re
from typing import Any

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
_FINAL_ANSWER = re.compile(r"#### (\-?[0-9\.\,]+)")


def extract_final_answer(solution: str) -> str:
    """The number after ``####`` in a GSM8K reference solution, with thousands separators removed."""
    match = _FINAL_ANSWER.search(solution)
    if match is None:
        raise ValueError(f"GSM8K solution has no '#### <number>' line: {solution[-80:]!r}")
    return match.group(1).replace(",", "")


def to_verl_row(example: dict[str, Any], index: int, split: str) -> dict[str, Any]:
    question = example["question"]
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": extract_final_answer(example["answer"])},
        "extra_info": {"split": split, "index": index, "answer": example["answer"], "question": question},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", default=os.path.expanduser("~/data/gsm8k"))
    parser.add_argument("--local-dir", default=None, help="load GSM8K from this local dataset directory instead")
    args = parser.parse_args(argv)

    import datasets  # installed with verl

    if args.local_dir and not os.path.isdir(args.local_dir):
        parser.error(f"--local-dir {args.local_dir} is not a directory")
    dataset = datasets.load_dataset(args.local_dir or DATA_SOURCE, "main")
    os.makedirs(args.output_dir, exist_ok=True)
    for split in ("train", "test"):
        rows = dataset[split].map(
            lambda example, index: to_verl_row(example, index, split),
            with_indices=True,
            remove_columns=dataset[split].column_names,
        )
        path = os.path.join(args.output_dir, f"{split}.parquet")
        rows.to_parquet(path)
        print(f"{split}: {len(rows)} rows -> {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
