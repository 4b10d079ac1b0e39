"""``verl-cppack ref-logprobs``: reference log-probs through verl's Megatron engine at CP=N, from a file of pairs.

Specified:
- end to end on a tiny Llama checkpoint: the log-probs at CP=2 equal ``log_softmax`` of the Hugging Face model's
  logits at every response token (<= 1e-5) and equal a CP=1 run with another micro-batch size; one output line
  per input row, in input order; ``summary.json`` counts rows and tokens; a non-empty --output gets a fresh
  subdirectory;
- bad input is one ``error: ...`` line on stderr and exit 2 before any process starts (nothing is created);
- a worker failure is one error line and exit 3, with no worker left; Ctrl-C is exit 130 with no process left;
- the loader reads .jsonl and .parquet alike; the rollout batch left-pads prompts and right-pads responses;
  synthetic pairs are ragged and reproducible.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.verl_engine_cases import TINY
from verl_cppack.cli import main
from verl_cppack.jobs import ref_logprobs
from verl_cppack.jobs.counting_task import ensure_counting_assets
from verl_cppack.jobs.ref_logprobs_input import BadInput, load_pairs, synthetic_pairs
from verl_cppack.runtime.megatron_engine import rollout_tensors

REPO = Path(__file__).resolve().parents[1]
TOLERANCE = 1e-5
VOCAB_SIZE = 18  # the counting tokenizer: <pad>, </s>, 16 symbols
# One-token prompt and response, a full-length pair, a two-token sequence, repeated ids; 5 rows so a micro-batch
# of 2 leaves a short last one.
PAIRS = [
    ([5, 6, 7], [8, 9, 10, 11]),
    ([2], [3, 4]),
    ([12, 13, 14, 15, 16, 17], [1]),
    ([4, 4, 9, 2], [7, 7, 7, 7, 7, 7]),
    ([9], [10]),
]


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return path


def pair_rows(pairs) -> list[dict]:
    return [{"prompt_ids": prompt, "response_ids": response} for prompt, response in pairs]


def read_rows(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "ref_logprobs.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return ensure_counting_assets(TINY, root=tmp_path_factory.mktemp("counting")).model


@pytest.fixture(scope="module")
def runs(model_dir, tmp_path_factory) -> dict[int, Path]:
    """The command at CP=2 (micro-batches of 2) and CP=1 (one micro-batch of 5) on ``PAIRS``: output dirs."""
    folder = tmp_path_factory.mktemp("ref")
    pairs_file = write_jsonl(folder / "pairs.jsonl", pair_rows(PAIRS))
    outputs = {}
    for cp, micro_batch_size in ((2, 2), (1, 5)):
        output = folder / f"cp{cp}"
        output.mkdir()
        (output / "earlier.txt").write_text("kept")  # a non-empty --output gets a fresh subdirectory
        argv = [
            "ref-logprobs",
            "--model",
            str(model_dir),
            "--input",
            str(pairs_file),
            "--cp",
            str(cp),
            "--micro-batch-size",
            str(micro_batch_size),
            "--output",
            str(output),
        ]
        assert main(argv) == 0
        (fresh,) = [path for path in output.iterdir() if path.is_dir()]
        assert fresh.name.startswith("run-") and (output / "earlier.txt").read_text() == "kept"
        outputs[cp] = fresh
    return outputs


def hf_response_log_probs(model_dir: Path, pairs) -> list[list[float]]:
    """``log_softmax`` of ``LlamaForCausalLM`` logits at each response token, one unpadded forward per pair."""
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    expected = []
    with torch.no_grad():
        for prompt, response in pairs:
            logits = model(input_ids=torch.tensor([prompt + response])).logits[0]  # [P+R, V]
            log_probs = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)  # [R, V]: row j predicts token j
            expected.append(log_probs.gather(1, torch.tensor(response)[:, None])[:, 0].tolist())
    return expected


# ------------------------------------------------------------------------------------------ end to end
@pytest.mark.slow  # verl's engine in gloo processes
def test_cp2_log_probs_equal_the_hugging_face_model_and_cp1(runs, model_dir):
    expected = hf_response_log_probs(model_dir, PAIRS)
    cp2, cp1 = read_rows(runs[2]), read_rows(runs[1])
    assert [(row["prompt_ids"], row["response_ids"]) for row in cp2] == PAIRS  # input order, ids unchanged
    assert [(row["prompt_ids"], row["response_ids"]) for row in cp1] == PAIRS
    for row_cp2, row_cp1, reference in zip(cp2, cp1, expected, strict=True):
        assert len(row_cp2["ref_log_probs"]) == len(row_cp1["ref_log_probs"]) == len(reference)
        assert all(value < 0 for value in row_cp2["ref_log_probs"])  # real log-probs, not padding zeros
        torch.testing.assert_close(
            torch.tensor(row_cp2["ref_log_probs"]), torch.tensor(reference), rtol=0, atol=TOLERANCE
        )
        torch.testing.assert_close(
            torch.tensor(row_cp2["ref_log_probs"]), torch.tensor(row_cp1["ref_log_probs"]), rtol=0, atol=TOLERANCE
        )


@pytest.mark.slow  # verl's engine in gloo processes
def test_summary_counts_rows_and_response_tokens(runs, model_dir):
    for cp, output_dir in runs.items():
        summary = json.loads((output_dir / "summary.json").read_text())
        assert summary["rows"] == len(PAIRS)
        assert summary["tokens"] == sum(len(response) for _, response in PAIRS)
        assert summary["cp"] == cp
        assert Path(summary["model"]) == model_dir.resolve()
        assert math.isfinite(summary["wall_s"]) and summary["wall_s"] > 0


# ------------------------------------------------------------------------------------------ bad input
@pytest.fixture
def never_start(monkeypatch):
    """Fails the test if the command gets as far as starting worker processes."""

    def started(*args, **kwargs):
        raise AssertionError("workers were started for bad input")

    monkeypatch.setattr(ref_logprobs, "run", started)


def assert_refused(capsys, argv: list[str], *fragments: str) -> None:
    """Exit 2 and exactly one stderr line, ``error: ...`` naming each of ``fragments``; no worker process."""
    assert main(["ref-logprobs", *argv]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    assert multiprocessing.active_children() == []


BAD_FILES = {  # name: (file content or None for missing, fragments of the error)
    "missing.jsonl": (None, ["does not exist"]),
    "malformed.jsonl": ('{"prompt_ids": [1], "response_ids": [2]}\n{"prompt_ids": [1', ["line 2 is not JSON"]),
    "not-an-object.jsonl": ("[1, 2]", ["line 1 must be a JSON object"]),
    "empty.jsonl": ("", ["has no rows"]),
    "pairs.txt": ('{"prompt_ids": [1], "response_ids": [2]}', [".jsonl or .parquet"]),
    "no-response.jsonl": ('{"prompt_ids": [1, 2]}', ["row 0", "response_ids"]),
    "float-ids.jsonl": ('{"prompt_ids": [1, 2.5], "response_ids": [2]}', ["row 0 prompt_ids", "2.5", "integers"]),
    "string-ids.jsonl": ('{"prompt_ids": [1], "response_ids": ["3"]}', ["row 0 response_ids", "'3'"]),
    "bool-ids.jsonl": ('{"prompt_ids": [true], "response_ids": [3]}', ["row 0 prompt_ids", "True"]),
    "not-a-list.jsonl": ('{"prompt_ids": 5, "response_ids": [3]}', ["row 0 prompt_ids", "list"]),
    "id-at-vocab-size.jsonl": (
        '{"prompt_ids": [1], "response_ids": [2, 18]}',
        ["response_ids", "token id 18", "[0, 18)"],
    ),
    "negative-id.jsonl": ('{"prompt_ids": [-1], "response_ids": [2]}', ["prompt_ids", "token id -1"]),
    "empty-prompt.jsonl": ('{"prompt_ids": [], "response_ids": [2]}', ["empty prompt_ids"]),
    "empty-response.jsonl": ('{"prompt_ids": [3], "response_ids": []}', ["empty response_ids"]),
}


@pytest.mark.parametrize("name", sorted(BAD_FILES))
def test_a_bad_input_file_is_refused_before_any_process_starts(name, model_dir, tmp_path, capsys, never_start):
    content, fragments = BAD_FILES[name]
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    assert_refused(
        capsys, ["--model", str(model_dir), "--input", str(path), "--output", str(tmp_path / "out")], *fragments
    )
    assert not (tmp_path / "out").exists()  # nothing created


def test_a_malformed_parquet_file_is_refused(model_dir, tmp_path, capsys, never_start):
    pytest.importorskip("pandas")
    path = tmp_path / "pairs.parquet"
    path.write_text("not parquet")
    assert_refused(capsys, ["--model", str(model_dir), "--input", str(path)], "cannot read", "as parquet")


def test_parquet_without_pandas_is_refused(model_dir, tmp_path, capsys, never_start, monkeypatch):
    monkeypatch.setitem(sys.modules, "pandas", None)  # `import pandas` raises ImportError
    path = tmp_path / "pairs.parquet"
    path.write_bytes(b"PAR1")
    assert_refused(capsys, ["--model", str(model_dir), "--input", str(path)], "needs pandas", ".jsonl")


@pytest.mark.parametrize(
    ("flags", "fragment"),
    [
        (["--synthetic", "0"], "--synthetic must be >= 1"),
        (["--cp", "0"], "--cp must be >= 1"),
        (["--micro-batch-size", "0"], "--micro-batch-size must be >= 1"),
        (["--cp", "-2"], "--cp must be >= 1"),
    ],
)
def test_a_bad_count_is_refused(flags, fragment, model_dir, tmp_path, capsys, never_start):
    assert_refused(capsys, ["--model", str(model_dir), "--output", str(tmp_path / "out"), *flags], fragment)
    assert not (tmp_path / "out").exists()


def test_a_model_directory_without_config_json_is_refused(model_dir, tmp_path, capsys, never_start):
    weights_only = tmp_path / "model"
    weights_only.mkdir()
    assert_refused(capsys, ["--model", str(weights_only), "--synthetic", "2"], "has no config.json")
    assert_refused(capsys, ["--model", str(tmp_path / "nowhere"), "--synthetic", "2"], "is not a directory")


def test_an_output_that_is_a_file_is_refused(model_dir, tmp_path, capsys, never_start):
    (tmp_path / "out").write_text("a file")
    assert_refused(
        capsys, ["--model", str(model_dir), "--synthetic", "2", "--output", str(tmp_path / "out")], "is not a directory"
    )
    assert (tmp_path / "out").read_text() == "a file"


# ------------------------------------------------------------------------------------------ failures
@pytest.mark.slow  # gloo processes importing verl
def test_a_worker_failure_is_one_error_line_and_exit_3(model_dir, tmp_path, capsys):
    """A checkpoint with config.json but no weights passes the checks; the worker fails building the engine."""
    no_weights = tmp_path / "model"
    no_weights.mkdir()
    shutil.copy(model_dir / "config.json", no_weights / "config.json")
    pairs_file = write_jsonl(tmp_path / "pairs.jsonl", pair_rows(PAIRS[:2]))
    argv = [
        "ref-logprobs",
        "--model",
        str(no_weights),
        "--input",
        str(pairs_file),
        "--cp",
        "1",
        "--output",
        str(tmp_path / "out"),
    ]
    assert main(argv) == 3
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: rank 0 failed: "), lines
    assert multiprocessing.active_children() == []
    assert not (tmp_path / "out" / "ref_logprobs.jsonl").exists()
    assert "Traceback" in (tmp_path / "out" / "worker-0.log").read_text()  # the full report is kept


def session_processes(session_id: int) -> list[int]:
    """Pids of the live (not zombie) processes in session ``session_id``."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[3]) == session_id:  # state, ppid, pgrp, session
            pids.append(int(entry.name))
    return pids


@pytest.mark.slow  # gloo processes importing verl
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads sessions from /proc")
def test_ctrl_c_exits_130_and_leaves_no_process(model_dir, tmp_path):
    from tests.interrupts import default_sigint

    output = tmp_path / "out"
    command = [
        sys.executable,
        "-m",
        "verl_cppack.cli",
        "ref-logprobs",
        "--model",
        str(model_dir),
        "--synthetic",
        "4",
        "--cp",
        "2",
        "--output",
        str(output),
    ]
    process = subprocess.Popen(
        command,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=default_sigint,
    )
    try:
        deadline = time.monotonic() + 60
        while not all((output / f"worker-{rank}.log").exists() for rank in range(2)):  # both workers are running
            assert process.poll() is None and time.monotonic() < deadline, process.communicate()
            time.sleep(0.1)
        assert len(session_processes(process.pid)) >= 3  # the command and its two workers
        os.kill(process.pid, signal.SIGINT)
        _, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert process.returncode == 130, stderr
    assert "interrupted" in stderr
    deadline = time.monotonic() + 10  # multiprocessing's resource tracker leaves when the command's pipe closes
    while session_processes(process.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert session_processes(process.pid) == []


# ------------------------------------------------------------------------------------------ inputs
def test_jsonl_and_parquet_inputs_give_the_same_pairs(tmp_path):
    rows = [{**row, "extra": "ignored"} for row in pair_rows(PAIRS)]
    assert load_pairs(write_jsonl(tmp_path / "pairs.jsonl", rows)) == PAIRS
    pandas = pytest.importorskip("pandas")
    pytest.importorskip("pyarrow")
    pandas.DataFrame(rows).to_parquet(tmp_path / "pairs.parquet")
    pairs = load_pairs(tmp_path / "pairs.parquet")
    assert pairs == PAIRS
    assert all(type(token) is int for prompt, response in pairs for token in prompt + response)


def test_the_loader_raises_value_errors_naming_the_problem(tmp_path):
    with pytest.raises(ValueError, match=r"\.jsonl or \.parquet"):
        load_pairs(tmp_path / "pairs.csv")
    with pytest.raises(BadInput, match="row 1 needs 'prompt_ids' and 'response_ids'"):
        load_pairs(write_jsonl(tmp_path / "pairs.jsonl", [*pair_rows(PAIRS[:1]), {"prompt_ids": [1]}]))


def test_rollout_tensors_left_pad_prompts_and_right_pad_responses():
    tensors = rollout_tensors([([5, 6, 7], [8, 9]), ([1], [2, 3, 4])])
    assert tensors["prompts"].tolist() == [[5, 6, 7], [0, 0, 1]]
    assert tensors["responses"].tolist() == [[8, 9, 0], [2, 3, 4]]
    assert tensors["input_ids"].tolist() == [[5, 6, 7, 8, 9, 0], [0, 0, 1, 2, 3, 4]]
    assert tensors["attention_mask"].tolist() == [[1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1]]
    assert tensors["response_mask"].tolist() == [[1, 1, 0], [1, 1, 1]]
    assert tensors["position_ids"].tolist() == [[0, 1, 2, 3, 4, 4], [0, 0, 0, 1, 2, 3]]
    with pytest.raises(ValueError, match="empty response_ids"):
        rollout_tensors([([1, 2], [])])
    with pytest.raises(ValueError, match="no prompt/response pairs"):
        rollout_tensors([])


def test_synthetic_pairs_are_ragged_reproducible_and_inside_the_vocabulary():
    pairs = synthetic_pairs(200, VOCAB_SIZE, seed=1)
    assert pairs == synthetic_pairs(200, VOCAB_SIZE, seed=1)
    assert pairs != synthetic_pairs(200, VOCAB_SIZE, seed=2)
    assert {len(prompt) for prompt, _ in pairs} == set(range(1, 7))
    assert {len(response) for _, response in pairs} == set(range(1, 7))
    tokens = {token for prompt, response in pairs for token in prompt + response}
    assert tokens == set(range(VOCAB_SIZE))
