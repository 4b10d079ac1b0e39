"""``scripts/critic_replay.py``, the offline critic replay behind the PPO job's critic settings.

Its one piece of index math, where each response token's value is read, must be verl's (``no_padding_2_padding``:
the position before the token, the ``EOS`` of a response that stopped early included); checked against a slow
per-row oracle. The replay itself runs end to end on a made-up dump.
"""

from __future__ import annotations

import importlib.util
import json
import random
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.verl_engine_cases import TINY  # noqa: E402
from verl_cppack.jobs.counting_reward import RESPONSE_LENGTH, SYMBOLS, score_response  # noqa: E402
from verl_cppack.jobs.counting_reward_model import encode_batch  # noqa: E402
from verl_cppack.jobs.counting_task import build_tokenizer, ensure_counting_assets  # noqa: E402

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "critic_replay.py"
spec = importlib.util.spec_from_file_location("critic_replay", SCRIPT)
critic_replay = importlib.util.module_from_spec(spec)
spec.loader.exec_module(critic_replay)

rows_strategy = st.lists(
    st.tuples(st.text(SYMBOLS, min_size=2, max_size=6), st.text(SYMBOLS, min_size=0, max_size=RESPONSE_LENGTH)),
    min_size=1,
    max_size=6,
)


@given(pairs=rows_strategy)
@settings(max_examples=60, deadline=None)
def test_values_are_read_at_the_position_before_each_response_token_as_verl_does(pairs):
    rows = [
        {"input": prompt, "output": output, "score": score_response(prompt[-1], output)} for prompt, output in pairs
    ]
    tokenizer = build_tokenizer()
    input_ids, _, last_position = encode_batch(tokenizer, [(r["input"], r["output"], r["score"]) for r in rows])
    positions, mask, returns = critic_replay.response_positions(rows, last_position)
    assert int(positions.min()) >= 0 and int(positions.max()) < input_ids.shape[1]  # gather-safe, masked ones too
    for index, row in enumerate(rows):
        response_tokens = len(row["output"]) + (len(row["output"]) < RESPONSE_LENGTH)  # a stopped response has EOS
        expected = [len(row["input"]) - 1 + t for t in range(response_tokens)]
        assert positions[index][mask[index]].tolist() == expected
        assert returns[index][mask[index]].tolist() == pytest.approx([row["score"]] * response_tokens)
        response = input_ids[index, len(row["input"]) : len(row["input"]) + response_tokens].tolist()
        eos = "</s>" if response_tokens > len(row["output"]) else ""
        assert response == tokenizer(row["output"] + eos)["input_ids"]


def test_explained_variance_is_verls_over_the_masked_tokens():
    """1 for values equal to the returns, ~0 for their mean, whatever sits outside the mask; verl's 1e-5 guard makes
    values that vary around constant returns a large negative number rather than a division by zero."""
    returns = torch.tensor([[0.5, 0.5, 9.0], [1.0, 1.0, 1.0], [0.0, 0.0, -9.0]])
    mask = torch.tensor([[True, True, False], [True, True, True], [True, False, False]])
    assert critic_replay.explained_variance(returns.clone(), returns, mask) == pytest.approx(1.0)
    mean = returns[mask].mean()
    assert critic_replay.explained_variance(torch.full_like(returns, mean), returns, mask) == pytest.approx(0, abs=1e-3)
    constant, varying = torch.ones(2, 3), torch.tensor([[0.9, 1.0, 1.1], [1.1, 1.0, 0.9]])
    assert critic_replay.explained_variance(varying, constant, torch.ones(2, 3, dtype=torch.bool)) < -100


def test_a_replay_runs_over_a_made_up_dump(tmp_path):
    rng = random.Random(0)
    for step in (1, 2, 3):
        rows = []
        for _ in range(16):
            prompt = "".join(rng.choice(SYMBOLS) for _ in range(rng.randint(2, 6)))
            output = "".join(rng.choice(SYMBOLS) for _ in range(rng.randint(0, RESPONSE_LENGTH)))
            rows.append({"input": prompt, "output": output, "score": score_response(prompt[-1], output), "step": step})
        (tmp_path / f"{step}.jsonl").write_text("\n".join(json.dumps(row) for row in rows))
    steps = critic_replay.load_steps(tmp_path)
    assert [len(rows) for rows in steps] == [16, 16, 16]

    from transformers import LlamaForCausalLM

    tiny = replace(TINY, train_prompts=8, test_prompts=8)
    trunk = LlamaForCausalLM.from_pretrained(ensure_counting_assets(tiny, root=tmp_path / "assets").model).model
    head = torch.nn.Linear(32, 1, bias=False)
    seen = []
    history = critic_replay.replay(steps, trunk, head, lr=1e-3, epochs=1, mini_batches=2, seed=0, seen=seen)
    assert len(history) == 3 and all(x == x for x in history) and len(seen) == 3
    lookups = critic_replay.lookup_predictions(steps)
    assert lookups[0] is None and [lookup.shape for lookup in lookups[1:]] == [seen[1][0].shape] * 2
    table = critic_replay.per_position_table(seen, lookups).splitlines()
    assert len(table) == 1 + RESPONSE_LENGTH


def test_the_lookup_predicts_the_previous_steps_mean_return_of_each_key():
    """Keys (t, earlier tokens right, last one right), worked by hand: the three rows of step 1 share the keys of
    t=0 and t=1 (the third row's "4" is right after "3"); from t=2 on only the two fully right rows share them."""
    first = [
        {"input": "3", "output": "456789", "score": 1.0},
        {"input": "7", "output": "89abcd", "score": 1.0},
        {"input": "3", "output": "4f", "score": 1 / 6},
    ]
    second = [{"input": "0", "output": "123456", "score": 1.0}, {"input": "0", "output": "1", "score": 1 / 6}]
    _, predicted = critic_replay.lookup_predictions([first, second])
    all_three = (1 + 1 + 1 / 6) / 3
    assert predicted[0].tolist() == pytest.approx([all_three, all_three, 1.0, 1.0, 1.0, 1.0])
    assert predicted[1].tolist() == pytest.approx([all_three, all_three, 0, 0, 0, 0])  # "1", then EOS; no more tokens


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["{dump}/missing"], "rollout_data_dir"),
        (["{empty}"], "rollout_data_dir"),
        (["{bad}"], "not a verl rollout dump"),
        (["{dump}", "--epochs", "0"], "--epochs"),
        (["{dump}", "--mini-batches", "-1"], "--mini-batches"),
        (["{dump}", "--lr", "0"], "--lr"),
        (["{dump}", "--init", "{empty}"], "Hugging Face checkpoint"),
        (["{dump}", "--epochs", "two"], "invalid int"),
    ],
)
@pytest.mark.slow  # each case runs the script in a subprocess
def test_bad_input_is_one_error_line_and_exit_2(arguments, message, tmp_path):
    import subprocess
    import sys

    dump, empty, bad = tmp_path / "dump", tmp_path / "empty", tmp_path / "bad"
    for directory in (dump, empty, bad):
        directory.mkdir()
    (dump / "1.jsonl").write_text(json.dumps({"input": "3", "output": "45", "score": 2 / 6}))
    (bad / "1.jsonl").write_text('{"input": "3", "output": "45"}\nnot json')
    arguments = [argument.format(dump=dump, empty=empty, bad=bad) for argument in arguments]
    result = subprocess.run([sys.executable, str(SCRIPT), *arguments], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert message in result.stderr.strip().splitlines()[-1]
