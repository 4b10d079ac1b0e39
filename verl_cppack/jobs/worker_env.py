"""What a job hands verl's trainer and every Ray worker it starts: environment variables, code and files.

``verl_cppack`` travels as a Ray ``py_module``, so no node needs the driver's file system."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import verl_cppack
from verl_cppack.jobs.call_counts import COUNT_DIR_ENV, COUNT_RAY_KEY_ENV
from verl_cppack.jobs.trainer_config import PLUGIN
from verl_cppack.runtime import PLATFORM_ENV
from verl_cppack.runtime.gloo_interface import GLOO_INTERFACE_ENV, INTERFACE_REQUEST_ENV, RAY_NODE_INTERFACE

FILE_LOGGER_ENV = "VERL_FILE_LOGGER_PATH"
VLLM_CPU_KVCACHE_GIB = 1  # per replica: the counting task's 8 + 6 tokens x 128 sequences need ~2 MiB of it
VLLM_CPU_ENVIRONMENT = {
    "VLLM_CPU_KVCACHE_SPACE": str(VLLM_CPU_KVCACHE_GIB),
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
}
EXTERNAL_MODULES_ENV = "VERL_USE_EXTERNAL_MODULES"
PACKAGE_DIR = Path(verl_cppack.__file__).resolve().parent


def worker_environment(
    metrics_path: Path,
    call_count_key: str,
    call_count_dir: Path,
    nnodes: int,
    user_env: dict[str, str] | None = None,
    rollout: str = "hf",
) -> dict[str, str]:
    """The variables set in verl's trainer and in every Ray worker of a run (``rollout``: ``vllm`` or ``hf``)."""
    user_env = os.environ if user_env is None else user_env
    environment = {
        PLATFORM_ENV: "cpu",
        EXTERNAL_MODULES_ENV: f"{PLUGIN},verl_cppack.jobs.call_counts",  # the drop-ins, counted
        FILE_LOGGER_ENV: str(metrics_path.resolve()),
        COUNT_RAY_KEY_ENV: call_count_key,
        COUNT_DIR_ENV: str(call_count_dir.resolve()),
        "TOKENIZERS_PARALLELISM": "false",
    }
    if user_env.get(GLOO_INTERFACE_ENV):
        environment[GLOO_INTERFACE_ENV] = user_env[GLOO_INTERFACE_ENV]
    elif nnodes == 1:
        environment[GLOO_INTERFACE_ENV] = "lo"  # every rank on one node
    else:
        environment[INTERFACE_REQUEST_ENV] = RAY_NODE_INTERFACE
    if rollout == "vllm":
        environment.update({name: user_env.get(name, value) for name, value in VLLM_CPU_ENVIRONMENT.items()})
    return environment


def runtime_environment(environment: dict[str, str], task_dir: Path | None) -> dict[str, Any]:
    """Ray's ``runtime_env`` for the trainer's job: the variables, the task directory, the verl_cppack package."""
    runtime_env: dict[str, Any] = {"env_vars": dict(environment), "py_modules": [str(PACKAGE_DIR)]}
    if task_dir is not None:
        runtime_env["working_dir"] = str(task_dir.resolve())
    return runtime_env
