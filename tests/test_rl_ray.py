"""GRPO on a real local Ray cluster with CP=2 gloo worker actors running the tiny Megatron GPT.

One Ray cluster serves the module (2 CPUs); subprocess CLI runs join it with ``--address``.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ray = pytest.importorskip("ray")
pytest.importorskip("megatron.core")

from verl_cppack.rl.cluster import WorkerError, WorkerGroup  # noqa: E402
from verl_cppack.rl.grpo import GRPOConfig, make_grpo_step, run_training  # noqa: E402
from verl_cppack.jobs.output import read_metrics  # noqa: E402
from verl_cppack.rl.ref_logprobs import RefLogprobsConfig, compute_reference_log_probs, synthetic_pairs  # noqa: E402
from verl_cppack.rl.task import CountingTask  # noqa: E402
from verl_cppack.rl.worker import WorkerSettings  # noqa: E402

SMALL = dict(prompts_per_step=4, group_size=4, num_mini_batches=2)
REQUIRED_METRICS = {"step", "reward_mean", "kl", "entropy", "tokens", "cp", "time_step_s", "time_rollout_s",
                    "time_ref_s", "time_old_s", "time_update_s"}


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


def test_cli_own_loop_short_run_at_cp2_writes_finite_metrics_and_a_summary(ray_cluster, tmp_path, capsys):
    from verl_cppack.cli import main

    assert main(["ppo", "--steps", "3", "--prompts-per-step", "4", "--group-size", "4", "--output", str(tmp_path)]) == 0
    assert "3 steps at CP=2" in capsys.readouterr().out
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [record["step"] for record in records] == [0, 1, 2]
    for record in records:
        assert REQUIRED_METRICS <= set(record)
        assert record["cp"] == 2
        assert all(math.isfinite(value) for value in record.values() if isinstance(value, float))
        assert 0.0 <= record["reward_mean"] <= 1.0 and record["kl"] >= 0.0 and record["entropy"] > 0.0
        # 16 sequences: left-padded prompts of 2..6 tokens + 6 response tokens
        assert record["response_tokens"] == 16 * 6 and 16 * 8 <= record["tokens"] <= 16 * 12
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["cp"] == 2


def test_reference_log_probs_are_equal_at_cp1_and_cp2(ray_cluster, tmp_path, capsys):
    from verl_cppack.cli import main

    pairs = synthetic_pairs(CountingTask(), 24, seed=3)  # ragged prompts (2..6) and responses (1..6)
    cp1 = compute_reference_log_probs(pairs, RefLogprobsConfig(cp=1, micro_batch_size=16))
    assert main(["ref-logprobs", "--synthetic", "24", "--data-seed", "3", "--cp", "2", "--micro-batch-size", "16",
                 "--output", str(tmp_path)]) == 0
    assert "24 rows" in capsys.readouterr().out
    rows = [json.loads(line) for line in (tmp_path / "ref_logprobs.jsonl").read_text().splitlines()]
    assert [(row["prompt_ids"], row["response_ids"]) for row in rows] == pairs
    cp2 = [row["ref_log_probs"] for row in rows]
    assert [len(values) for values in cp1] == [len(values) for values in cp2] == [len(r) for _, r in pairs]
    flat1 = torch.tensor([v for values in cp1 for v in values])
    flat2 = torch.tensor([v for values in cp2 for v in values])
    assert (flat1 < 0).all()  # real log-probs of a 16-token vocabulary, none of them padding zeros
    torch.testing.assert_close(flat2, flat1, atol=1e-5, rtol=0)


KILLED_AT: list[float] = []


def kill_rank1_at_step1(workers, config):
    step = make_grpo_step(workers, config)

    def run(index):
        if index == 1:
            os.kill(workers.pids[1], signal.SIGKILL)
            KILLED_AT.append(time.monotonic())
        return step(index)

    return run


def test_a_killed_worker_ends_the_run_with_a_clear_error_in_bounded_time_and_earlier_runs_survive(ray_cluster, tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "earlier": true}\n')
    config = GRPOConfig(cp=2, steps=5, output=str(tmp_path), call_timeout_s=30.0, **SMALL)
    with pytest.raises(WorkerError, match=r"(rank 1 died|did not finish)"):
        run_training(config, kill_rank1_at_step1)
    assert time.monotonic() - KILLED_AT[-1] < 90  # bounded by call_timeout_s (30 s), not a hang
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 0, "earlier": true}\n'  # never overwritten
    (run_dir,) = tmp_path.glob("run-*")
    assert [record["step"] for record in read_metrics(run_dir / "metrics.jsonl")] == [0]  # finished steps kept


def test_a_collective_that_never_completes_is_reported_within_the_call_timeout(ray_cluster):
    workers = WorkerGroup(2, WorkerSettings(collective_timeout_s=600.0), call_timeout_s=60.0)
    try:
        workers.start(with_policy=False)
        started = time.monotonic()
        with pytest.raises(WorkerError, match=r"\[0\] did not finish collective_without_peers\(\) within 3s"):
            workers.call("collective_without_peers", ranks=[0], timeout_s=3.0)
        assert time.monotonic() - started < 30
    finally:
        workers.shutdown()


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "verl_cppack.cli", *args]


def test_cli_own_loop_joins_a_cluster_and_ctrl_c_stops_it_cleanly(ray_cluster, tmp_path):
    process = subprocess.Popen(
        cli("ppo", "--steps", "500", "--prompts-per-step", "4", "--group-size", "4", "--address", ray_cluster,
            "--output", str(tmp_path / "interrupted")),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    metrics = Path(tmp_path / "interrupted" / "metrics.jsonl")
    deadline = time.monotonic() + 240
    while not (metrics.exists() and metrics.read_text().strip()) and time.monotonic() < deadline:
        assert process.poll() is None, process.communicate()[1][-3000:]
        time.sleep(0.5)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 130, stderr[-3000:]
    assert "interrupted" in stderr
    deadline = time.monotonic() + 60  # the interrupted run's actors are gone: both CPUs are free again
    while ray.available_resources().get("CPU", 0) < 2 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert ray.available_resources().get("CPU", 0) == 2
