"""``run_gloo``: the tests' name for the project's one multi-process harness (``verl_cppack.runtime.gloo_world``).

A rank's failure becomes an ``AssertionError`` carrying that rank's traceback, so pytest shows where it failed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from verl_cppack.runtime.gloo_world import RankFailed, run_world


def run_gloo(fn: Callable, world_size: int, *args: Any) -> list[Any]:
    """``fn(rank, world_size, *args)`` in ``world_size`` spawned gloo processes; returns the per-rank results.

    ``fn`` must be a module-level function; its return value must be something ``torch.save`` writes.
    """
    try:
        return run_world(fn, world_size, *args)
    except RankFailed as error:
        raise AssertionError(f"a gloo rank failed ({error}):\n{error.report}") from None
