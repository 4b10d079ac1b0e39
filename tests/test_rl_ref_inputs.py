"""Inputs of ``verl-cppack ref-logprobs``: files of prompt/response ids, verl's rollout layout, response cut."""

from __future__ import annotations

import json

import pytest
import torch

from verl_cppack.rl.ref_logprobs import load_pairs, response_log_probs_of, rollout_layout, synthetic_pairs
from verl_cppack.rl.task import CountingTask

PAIRS = [([5, 6, 7], [8, 9]), ([1], [2, 3, 4])]


def test_jsonl_and_parquet_inputs_give_the_same_pairs(tmp_path):
    rows = [{"prompt_ids": p, "response_ids": r, "extra": "kept out"} for p, r in PAIRS]
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert load_pairs(tmp_path / "pairs.jsonl") == PAIRS
    pandas = pytest.importorskip("pandas")
    pytest.importorskip("pyarrow")
    pandas.DataFrame(rows).to_parquet(tmp_path / "pairs.parquet")
    assert load_pairs(tmp_path / "pairs.parquet") == PAIRS


def test_bad_inputs_are_refused_with_the_reason(tmp_path):
    (tmp_path / "pairs.csv").write_text("x")
    with pytest.raises(ValueError, match=r"\.jsonl or \.parquet"):
        load_pairs(tmp_path / "pairs.csv")
    (tmp_path / "missing.jsonl").write_text(json.dumps({"prompt_ids": [1]}) + "\n")
    with pytest.raises(ValueError, match="row 0 needs 'prompt_ids' and 'response_ids'"):
        load_pairs(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="empty prompt or response"):
        rollout_layout([([1, 2], [])])
    with pytest.raises(ValueError, match="no prompt/response pairs"):
        rollout_layout([])


def test_rollout_layout_left_pads_prompts_and_right_pads_responses():
    input_ids, attention_mask, prompt_width = rollout_layout(PAIRS)
    assert prompt_width == 3
    assert input_ids.tolist() == [[5, 6, 7, 8, 9, 0], [0, 0, 1, 2, 3, 4]]
    assert attention_mask.int().tolist() == [[1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1]]


def test_response_log_probs_are_read_one_position_before_each_response_token():
    # next-token alignment: column t scores token t+1, so response token j sits at column prompt_width - 1 + j
    log_probs = torch.arange(12, dtype=torch.float32).view(2, 6)
    assert response_log_probs_of(log_probs, 3, PAIRS) == [[2.0, 3.0], [8.0, 9.0, 10.0]]


def test_synthetic_pairs_are_ragged_and_reproducible():
    task = CountingTask()
    pairs = synthetic_pairs(task, 50, seed=1)
    assert pairs == synthetic_pairs(task, 50, seed=1)
    assert {len(p) for p, _ in pairs} == set(range(task.min_prompt_length, task.max_prompt_length + 1))
    assert {len(r) for _, r in pairs} == set(range(1, task.response_length + 1))
