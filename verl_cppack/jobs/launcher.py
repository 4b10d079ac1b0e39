"""Run ``verl.trainer.main_ppo`` as a child process with verl_cppack on, follow its metrics, write the results.

Outputs: ``DIR/metrics.jsonl`` (from verl's ``file`` logger, one line per step) and ``DIR/trainer.log``."""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from verl_cppack.jobs.call_counts import sum_calls
from verl_cppack.jobs.output import MetricsWriter, fifth_means, read_metrics
from verl_cppack.jobs.parallel_shape import ParallelShape
from verl_cppack.jobs.trainer_config import CONFIG_NAME
from verl_cppack.jobs.worker_env import runtime_environment, worker_environment

EXIT_TRAINER_FAILED = 3
EXIT_INTERRUPTED = 130
SHUTDOWN_GRACE_S = 30.0
WATCH_INTERVAL_S = 2.0
STEP_TIMEOUT_S = 600.0  # the longest wait for the next step (a CPU step of the jobs takes seconds)
FIRST_STEP_TIMEOUT_S = 1800.0  # the longest wait for the first: Ray's and vLLM's start-up and worker init included


class TrainerFailed(RuntimeError):
    """verl's trainer (or the Ray cluster under it) did not finish; the message says where to look."""


@dataclass
class TrainerRun:
    overrides: list[str]
    output_dir: Path
    shape: ParallelShape = field(default_factory=ParallelShape)
    address: str | None = None  # the GCS address of the job's cluster (None: verl starts its own)
    task_dir: Path | None = None  # shipped to every worker as its working directory
    verbose: bool = False
    extra_env: dict[str, str] = field(default_factory=dict)
    rollout: str = "hf"  # vllm | hf: which rollout's variables the workers get (worker_env)
    step_timeout_s: float = STEP_TIMEOUT_S  # no step logged for this long (nor an exit): the run is stopped
    first_step_timeout_s: float = FIRST_STEP_TIMEOUT_S  # the same for the first step, counted from the start

    verl_metrics_path = property(lambda self: self.output_dir / "verl_metrics.jsonl")
    call_count_dir = property(lambda self: self.output_dir / "dropin_calls")
    log_path = property(lambda self: self.output_dir / "trainer.log")
    # this run's key in the cluster's key-value store (the output directory is fresh, so it is unique)
    call_count_key = property(lambda self: f"calls/{self.output_dir.resolve()}")

    def environment(self) -> dict[str, str]:
        base = worker_environment(
            self.verl_metrics_path, self.call_count_key, self.call_count_dir, self.shape.nnodes, rollout=self.rollout
        )
        return {**base, **self.extra_env}

    def command(self) -> list[str]:
        runtime_env = runtime_environment(self.environment(), self.task_dir)
        env_vars, py_modules = runtime_env.pop("env_vars"), runtime_env.pop("py_modules")
        ray_init = [f"++ray_kwargs.ray_init.runtime_env.env_vars.{k}={hydra_string(v)}" for k, v in env_vars.items()]
        ray_init.append(f"++ray_kwargs.ray_init.runtime_env.py_modules=[{','.join(map(hydra_string, py_modules))}]")
        ray_init += [f"++ray_kwargs.ray_init.runtime_env.{k}={hydra_string(v)}" for k, v in runtime_env.items()]
        if self.address:
            ray_init.append(f"++ray_kwargs.ray_init.address={hydra_string(self.address)}")
        hydra_dir = f"hydra.run.dir={hydra_string(str((self.output_dir / 'hydra').resolve()))}"  # not ./outputs
        return [
            sys.executable,
            "-m",
            "verl.trainer.main_ppo",
            f"--config-name={CONFIG_NAME}",
            *self.overrides,
            *ray_init,
            hydra_dir,
        ]


def hydra_string(value: str) -> str:
    """A Hydra override value that stays a string ('false', '1' and paths would otherwise be parsed)."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def run_trainer(
    run: TrainerRun, on_step: Callable[[dict[str, Any]], None], watch: Callable[[], str | None] = lambda: None
) -> list[dict[str, Any]]:
    """Run verl's trainer to the end, ``on_step(record)`` per step as it lands; returns the records. The trainer
    stopped first, ``TrainerFailed`` on a non-zero exit, a ``watch()`` problem or no step in time."""
    run.output_dir.mkdir(parents=True, exist_ok=True)
    writer = MetricsWriter(run.output_dir / "metrics.jsonl")
    records: list[dict[str, Any]] = []
    with run.log_path.open("w") as log:
        child = subprocess.Popen(  # in the task directory, as every worker: verl's driver opens the files it names too
            run.command(),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=run.task_dir,
            env={**os.environ, **run.environment()},
            start_new_session=True,
            preexec_fn=_trainer_setup(),
        )
        follower = _LineFollower(run.verl_metrics_path)
        trainer_output = _LineFollower(run.log_path) if run.verbose else None
        problem, next_watch = None, time.monotonic() + WATCH_INTERVAL_S
        last_progress = time.monotonic()  # the trainer's start, then each step's arrival
        try:
            while True:
                finished = child.poll() is not None
                for line in trainer_output.new_lines() if trainer_output else ():
                    print(line, file=sys.stderr, flush=True)
                for line in follower.new_lines():
                    record = step_record(json.loads(line), run.shape)
                    writer.write(record)
                    records.append(record)
                    last_progress = time.monotonic()
                    on_step(record)
                if finished:
                    break
                if time.monotonic() >= next_watch:
                    problem = watch() or stalled(run, time.monotonic() - last_progress, records)
                    next_watch = time.monotonic() + WATCH_INTERVAL_S
                    if problem is not None:
                        stop_process_group(child)
                        break
                time.sleep(0.5)
        except BaseException:  # Ctrl-C, and anything else that ends the launcher (a closed stdout, a bad line)
            stop_process_group(child)  # the trainer runs in its own session: nothing else would stop it
            raise
        finally:
            writer.close()
    if problem is not None:
        raise TrainerFailed(f"{problem}; verl's trainer was stopped (its output: {run.log_path})")
    if child.returncode != 0:
        raise TrainerFailed(
            f"verl's trainer exited with status {child.returncode}; its output: {run.log_path}\n"
            + last_error_lines(run.log_path)
        )
    return records


def stalled(run: TrainerRun, waited_s: float, records: Sequence[dict[str, Any]]) -> str | None:
    """Why the run cannot go on when the trainer has logged no step (nor exited) for longer than it may."""
    limit = run.step_timeout_s if records else run.first_step_timeout_s
    if waited_s <= limit:
        return None
    since = f"after step {records[-1]['step']}" if records else "since it started, start-up included"
    return (
        f"verl's trainer logged no step for {waited_s:.0f} s {since} (limit {limit:g} s, --step-timeout): a call "
        "that hangs without failing (a stalled vLLM engine, a collective waiting on a rank); if steps are that "
        "slow, raise --step-timeout"
    )


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _trainer_setup() -> Callable[[], None]:
    """The trainer's ``preexec_fn``: SIGINT back to its default and, on Linux, SIGKILL when the launcher dies (not
    SIGINT: a clean driver shutdown would wait on the vanished local GCS); libc is loaded here, not in the child."""
    prctl = None
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            prctl = ctypes.CDLL(None, use_errno=True).prctl
    launcher = os.getpid()

    def setup() -> None:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        if prctl is not None:
            prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
            if os.getppid() != launcher:  # the launcher died before the request was in place
                os.kill(os.getpid(), signal.SIGKILL)

    return setup


class _LineFollower:
    """Complete lines appended to a file since the last call (the file may not exist yet)."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.partial = path, 0, ""

    def new_lines(self) -> list[str]:
        if not self.path.exists():
            return []
        with self.path.open() as handle:
            handle.seek(self.offset)
            text = handle.read()
            self.offset = handle.tell()
        lines = (self.partial + text).split("\n")
        self.partial = lines.pop()
        return [line for line in lines if line.strip()]


def stop_process_group(child: subprocess.Popen) -> None:
    """SIGINT to the trainer's process group (verl and Ray shut down), SIGKILL whatever is left after a grace."""
    for sig, wait_s in ((signal.SIGINT, SHUTDOWN_GRACE_S), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(child.pid, sig)
        except ProcessLookupError:
            return
        try:
            child.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def last_error_lines(log_path: Path, count: int = 15) -> str:
    lines = log_path.read_text(errors="replace").splitlines() if log_path.exists() else []
    return "\n".join(lines[-count:])


def step_record(logged: dict[str, Any], shape: ParallelShape) -> dict[str, Any]:
    """One line of verl's file logger (``{"step", "data"}``) as a metrics.jsonl record: verl's numeric metrics plus
    ``step``, ``reward_mean``, ``tp``, ``cp``, ``dp``; non-finite values are left out, named under ``non_finite``."""
    data = logged["data"]
    numbers = {k: v for k, v in data.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    non_finite = sorted(k for k, v in numbers.items() if isinstance(v, float) and not math.isfinite(v))
    record = {k: v for k, v in numbers.items() if k not in non_finite}
    record.update(
        step=int(logged["step"]), reward_mean=float(data["critic/score/mean"]), tp=shape.tp, cp=shape.cp, dp=shape.dp
    )
    if non_finite:
        record["non_finite"] = non_finite
    return record


def summarize(
    records: Sequence[dict[str, Any]],
    call_records: Sequence[dict[str, Any]],
    run: TrainerRun,
    wall_s: float,
    verl_version: str,
) -> dict[str, Any]:
    """The run's summary: verl's metrics over the steps, the shape, and the drop-in calls the workers recorded."""
    if not records:
        raise TrainerFailed(f"verl's trainer finished without logging a step; its output: {run.log_path}")
    first, last = fifth_means([record["reward_mean"] for record in records])
    calling = [record for record in call_records if sum(record.get("counts", {}).values())]
    by_name = sum_calls(call_records)
    return {
        "trainer": "verl.trainer.main_ppo",
        "verl_version": verl_version,
        "tp": run.shape.tp,
        "cp": run.shape.cp,
        "dp": run.shape.dp,
        "world_size": run.shape.workers,
        "nodes": len({record["node"] for record in calling}),  # distinct Ray nodes whose workers called the drop-ins
        "gloo_interfaces": sorted({str(record.get("gloo_interface")) for record in calling}),
        "steps": len(records),
        "reward_first_fifth": first,
        "reward_last_fifth": last,
        "reward_gain": last - first,
        "rollout_probs_diff_max": max(r.get("training/rollout_probs_diff_max", float("nan")) for r in records),
        "dropin_calls": sum(by_name.values()),
        "dropin_calls_by_name": by_name,
        "dropin_calls_by_role": sum_calls(call_records, "roles"),  # policy (actor and reference) / critic
        "workers": [  # every process that called the drop-ins: where it ran and what it ran with
            {key: record.get(key) for key in ("node", "host", "pid", "gloo_interface", "working_dir", "package_dir")}
            | {"calls": sum(record["counts"].values())}
            for record in calling
        ],
        "wall_s": round(wall_s, 1),
        "output_dir": str(run.output_dir),
    }


__all__ = ["TrainerFailed", "TrainerRun", "read_metrics", "run_trainer", "summarize"]
