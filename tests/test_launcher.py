"""The launcher's promise about verl's trainer process: whatever ends the launcher's wait, the trainer (which runs
in its own session, out of reach of the terminal's Ctrl-C) is stopped by SIGINT, its clean shutdown path — or, when
the launcher itself is killed outright, by the kernel's SIGKILL. A trainer that logs no step for the run's step
timeout is stopped the same way, and the run fails saying so.

A stand-in trainer (a small Python program) plays verl's: it logs one step the way verl's file logger does (or,
"silent", none), then waits, and records how it ended.
"""

from __future__ import annotations

import json
import signal
import sys
import textwrap
from pathlib import Path

import pytest

from verl_cppack.jobs.launcher import TrainerFailed, TrainerRun, run_trainer

STAND_IN = textwrap.dedent(
    """
    import json, os, sys, time
    ended = sys.argv[1]
    with open(ended + ".pid", "w") as file:
        file.write(str(os.getpid()))
    if sys.argv[2] != "silent":
        with open(os.environ["VERL_FILE_LOGGER_PATH"], "a") as log:
            log.write(json.dumps({"step": 1, "data": {"critic/score/mean": 0.25}}) + "\\n")
    if sys.argv[2] == "fail":
        print("Traceback: the stand-in trainer failed", flush=True)
        sys.exit(7)
    def record(how):  # written whole, then renamed: a test polling for the file never reads it half-written
        with open(ended + ".partial", "w") as file:
            file.write(how)
        os.replace(ended + ".partial", ended)
    try:
        time.sleep(600)
        record("slept")
    except KeyboardInterrupt:
        record("interrupted")
    """
)


class StandInRun(TrainerRun):
    def __init__(self, output_dir: Path, behaviour: str, **timeouts: float) -> None:
        super().__init__(overrides=[], output_dir=output_dir, **timeouts)
        self.script = output_dir / "stand_in.py"
        self.ended = output_dir / "ended"
        self.behaviour = behaviour

    def command(self) -> list[str]:
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.script.write_text(STAND_IN)
        return [sys.executable, str(self.script), str(self.ended), self.behaviour]


class StepHandlerFailed(RuntimeError):
    pass


def _raise(error: BaseException):
    def on_step(record):
        assert record["step"] == 1 and record["reward_mean"] == 0.25 and record["cp"] == 2
        raise error

    return on_step


@pytest.mark.parametrize("error", [KeyboardInterrupt(), StepHandlerFailed("on_step failed"), BrokenPipeError()])
def test_whatever_ends_the_wait_stops_the_trainer_with_sigint(tmp_path, error):
    """Ctrl-C, an exception from on_step and a closed stdout all propagate, after the trainer got SIGINT."""
    run = StandInRun(tmp_path, "wait")
    with pytest.raises(type(error)):
        run_trainer(run, _raise(error))
    assert run.ended.read_text() == "interrupted"
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1]


def test_the_trainer_gets_sigint_even_when_the_command_was_started_with_it_ignored(tmp_path):
    """`nohup verl-cppack grpo &` starts the command with SIGINT ignored; the trainer must still get the launcher's
    SIGINT (its clean shutdown), not wait out the grace period for SIGKILL."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        run = StandInRun(tmp_path, "wait")
        with pytest.raises(StepHandlerFailed):
            run_trainer(run, _raise(StepHandlerFailed("stop")))
    finally:
        signal.signal(signal.SIGINT, previous)
    assert run.ended.read_text() == "interrupted"


def test_a_trainer_that_fails_is_trainer_failed_with_its_last_lines(tmp_path):
    run = StandInRun(tmp_path, "fail")
    with pytest.raises(TrainerFailed, match="exited with status 7") as failure:
        run_trainer(run, lambda record: None)
    assert "the stand-in trainer failed" in str(failure.value)


@pytest.mark.parametrize(
    "behaviour, timeouts, since, limit",
    [
        ("wait", dict(step_timeout_s=3.0, first_step_timeout_s=60.0), "after step 1", 3),
        ("silent", dict(step_timeout_s=60.0, first_step_timeout_s=4.0), "since it started, start-up included", 4),
    ],
    ids=["a later step", "the first step"],
)
def test_a_trainer_that_logs_no_step_in_time_is_stopped_and_the_run_fails(tmp_path, behaviour, timeouts, since, limit):
    """A call that hangs without failing (no process dies, no call ends) would otherwise hold the job forever; the
    first step, which includes the start-up, has its own limit."""
    import time

    run = StandInRun(tmp_path, behaviour, **timeouts)
    started = time.monotonic()
    with pytest.raises(
        TrainerFailed, match=f"logged no step for [0-9]+ s {since} \\(limit {limit} s, --step-timeout\\)"
    ):
        run_trainer(run, lambda record: None)
    assert limit < time.monotonic() - started < 30
    assert run.ended.read_text() == "interrupted"  # stopped by its clean shutdown path, not left sleeping
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == (behaviour == "wait")


def running(process) -> bool:
    import psutil

    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's prctl")
def test_a_launcher_killed_outright_still_stops_its_trainer(tmp_path):
    """SIGKILL (or a terminal's SIGHUP) gives the launcher no chance to clean up; the trainer, in its own session,
    is killed by the kernel (parent-death signal SIGKILL) instead of training on unattended."""
    import subprocess
    import time

    psutil = pytest.importorskip("psutil")
    from tests.interrupts import default_sigint

    launcher = textwrap.dedent(
        f"""
        from pathlib import Path
        from tests.test_launcher import StandInRun
        from verl_cppack.jobs.launcher import run_trainer
        run_trainer(StandInRun(Path({str(tmp_path)!r}), "wait"), lambda record: print("step", flush=True))
        """
    )
    process = subprocess.Popen(
        [sys.executable, "-c", launcher],
        cwd=Path(__file__).resolve().parents[1],
        stdout=subprocess.PIPE,
        text=True,
        preexec_fn=default_sigint,
    )
    try:
        assert process.stdout.readline() == "step\n"
        trainer = psutil.Process(int((tmp_path / "ended.pid").read_text()))  # a recycled pid is not mistaken for it
        assert trainer.is_running()
        process.kill()
        process.wait()
        deadline = time.monotonic() + 30
        while running(trainer) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not running(trainer)
        assert not (tmp_path / "ended").exists()  # killed, not asked: it recorded nothing
    finally:
        if process.poll() is None:
            process.kill()
