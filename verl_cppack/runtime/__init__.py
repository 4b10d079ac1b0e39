"""verl's own trainer on the host: a 'cpu' platform, a Hugging Face rollout and version-checked fixes to verl,
Megatron-core, mbridge and vLLM internals (``cpu_fixes.FIXES``), armed only with ``VERL_PLATFORM=cpu``."""

from __future__ import annotations

import os

from verl_cppack.runtime.checked_fix import Fix, FixSet, FixStatus, FixTargetChanged

PLATFORM_ENV = "VERL_PLATFORM"
_FIX_SET = FixSet()


def cpu_requested() -> bool:
    """``VERL_PLATFORM=cpu``: the user asked verl to run on the host."""
    return os.environ.get(PLATFORM_ENV, "").strip().lower() == "cpu"


def activate() -> list[FixStatus]:
    """Arm every CPU fix in this process (idempotent); returns their statuses."""
    from verl_cppack.runtime.cpu_fixes import FIXES

    for fix in FIXES:
        _FIX_SET.arm(fix)
    return report()


def activate_if_requested() -> bool:
    """``activate()`` when ``VERL_PLATFORM=cpu``; never in a GPU run. Returns whether it activated."""
    if not cpu_requested():
        return False
    from verl_cppack.runtime.gloo_interface import bind_gloo_to_ray_node_interface

    bind_gloo_to_ray_node_interface()  # before any process group is made
    activate()
    return True


def report() -> list[FixStatus]:
    """One status per armed fix: 'waiting' (its module is not loaded here), 'applied' or 'refused'."""
    return list(_FIX_SET.statuses.values())


__all__ = ["Fix", "FixStatus", "FixTargetChanged", "activate", "activate_if_requested", "cpu_requested", "report"]
