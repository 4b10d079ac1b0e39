"""What a job hands verl's trainer and every Ray worker it starts: environment variables, code and files.

One place for the protocol between the launcher and the processes it never starts itself:

- ``VERL_PLATFORM=cpu`` and ``VERL_USE_EXTERNAL_MODULES=verl_cppack.verl_plugin``: every verl process loads the
  plugin (the drop-ins) and arms the CPU runtime;
- ``VERL_FILE_LOGGER_PATH``: verl's ``file`` logger writes one JSON line per step there (the launcher follows it);
- the drop-in call records (``integrations.verl.call_counts``): published in the cluster's key-value store under
  a key of this run, so that workers on every node reach the launcher; a directory as the fallback for a process
  that is not connected to Ray;
- gloo's interface: loopback on one node; across nodes each worker binds to the interface holding its node's
  Ray address (``integrations.verl.cpu.gloo_interface``); a ``GLOO_SOCKET_IFNAME`` the user set is passed on;
- vLLM's CPU build (``--rollout vllm``): its KV cache (``VLLM_CPU_KVCACHE_SPACE``, GiB per replica), its threads
  (``VLLM_CPU_OMP_THREADS_BIND=nobind``: OpenMP places them, the trainer's workers share the cores with it) and no
  core reserved for its scheduler (``VLLM_CPU_NUM_OF_RESERVED_CPU=0``: by default vLLM keeps one of the machine's two
  cores away from everything else);
- Ray's runtime environment: the task directory as every worker's working directory (the config names the
  task's files relative to it) and the ``verl_cppack`` package as a ``py_module``, so that no node needs the
  driver's file system or its own install of verl_cppack.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import verl_cppack
from verl_cppack.integrations.verl.call_counts import COUNT_DIR_ENV, COUNT_RAY_KEY_ENV
from verl_cppack.jobs.trainer_config import PLUGIN
from verl_cppack.runtime import PLATFORM_ENV
from verl_cppack.runtime.gloo_interface import (
    GLOO_INTERFACE_ENV,
    INTERFACE_REQUEST_ENV,
    RAY_NODE_INTERFACE,
)

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
        EXTERNAL_MODULES_ENV: PLUGIN,
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
