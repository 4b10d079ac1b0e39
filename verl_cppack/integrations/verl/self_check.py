"""``self_check()``: the installed verl's packing functions against their drop-ins on random batches, here and now.

What ``verl-cppack doctor --verify`` runs after installing the patch: ``release_check.compare_release`` at CP=1 (a
1-rank gloo world and megatron parallel state of its own when this process has none) between each function
``install`` replaced (``patching.originals()``) and its drop-in, every option the release takes, the gather-backs
and their gradients. A difference that is not intended for the release (``compare.intended_keys``) puts verl's
function back in this process (``patching.put_back``), with the same ``BehaviourChanged`` warning a run's
verification gives; verl raising on a batch ours packs is no difference.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import warnings
from collections.abc import Iterator
from types import SimpleNamespace

from verl_cppack.integrations.verl import compare, patching
from verl_cppack.integrations.verl.verification import BehaviourChanged

BATCHES = ((11, 1), (13, 2))  # (seed, shortest sequence) of release_check.random_batch


@contextlib.contextmanager
def _one_rank_world() -> Iterator[None]:
    """A gloo world of this process alone and megatron's parallel state at TP=CP=1, unless both are there."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    started_world = not dist.is_initialized()
    with tempfile.TemporaryDirectory(prefix="verl_cppack_self_check_") as folder:
        if started_world:
            dist.init_process_group("gloo", init_method=f"file://{os.path.join(folder, 'store')}", rank=0, world_size=1)
        started_state = not mpu.model_parallel_is_initialized()
        try:
            if started_state:
                mpu.initialize_model_parallel()
            yield
        finally:
            if started_state:
                mpu.destroy_model_parallel()
            if started_world:
                dist.barrier()
                dist.destroy_process_group()


def self_check(batches: tuple[tuple[int, int], ...] = BATCHES) -> dict[str, str]:
    """Compare every replaced function with its drop-in; put back those that differ. Returns name -> the first
    difference, for the functions put back now."""
    from verl_cppack.integrations.verl.release_check import compare_release

    originals, ours = patching.originals(), patching.dropin_functions()
    if not originals:
        return {}
    release = patching.status()["release"]
    excused = compare.intended_keys(release)
    with _one_rank_world():
        from megatron.core import parallel_state as mpu

        if mpu.get_context_parallel_world_size() != 1:
            raise ValueError("self_check() compares at CP=1; run it in a process whose megatron CP size is 1")
        comparison = compare_release(SimpleNamespace(**originals), ours, 1, 0, batches)
    differences: dict[str, str] = {}
    for finding in comparison.findings:
        if finding.where.startswith("verl-raised"):
            continue  # a crash the drop-in fixes
        if compare.difference_key(finding.function, finding.where, 1) in excused:
            continue
        differences.setdefault(finding.function, finding.describe())
    for name, reason in differences.items():
        label = f"verl {release}" if release else "this verl"
        warnings.warn(
            f"verl_cppack: {label}'s {name} gives other results than its drop-in ({reason}); verl's own {name} is "
            "put back for the rest of this process",
            BehaviourChanged,
            stacklevel=2,
        )
        patching.put_back(name, reason)
    return differences
