"""The drop-ins equal the installed verl's own util functions, run side by side in real gloo processes.

Megatron's ``parallel_state.initialize_model_parallel`` works on CPU under gloo unchanged: initialise
torch.distributed with the gloo backend, then call it. Each world (CP 1, 2, 4 and TP2xCP2) runs the release
harness (``tests/verl_release_harness.py``, the one the release matrix runs on every release) on rollout-shaped and
anywhere-padded batches: every packing function the plugin replaces, on every tensor verl sends through it (token
ids, labels, bool label masks, ``[B,S,3]`` positions, uint8 router indices, bf16 embeddings) and every option, the
gather-backs in values, dtype and local gradient, on every rank. Every finding must be an intended difference of
the installed release (``comparison.intended_keys``); both functions raising counts as a finding here.
"""

from __future__ import annotations

import functools

import pytest

from tests.distributed import run_gloo

CP1_ONLY = ("preprocess_bshd", "postprocess_bshd")  # verl refuses CP>1 there (an assertion), as ours does


def equality_checks(tp_size: int, cp_size: int, cp_rank: int, batches: tuple) -> dict:
    """Every drop-in against verl's own function, inside an initialised megatron parallel state."""
    import verl.models.mcore.util as verl_util

    from tests.verl_release_harness import compare_release
    from verl_cppack.integrations.verl import clear_plan_caches, patching
    from verl_cppack.integrations.verl.comparison import unexcused

    chosen, left = patching.plan_replacements(patching.util_functions(verl_util))
    ours = {name: dropin.function for name, dropin in chosen.items() if cp_size == 1 or name not in CP1_ONLY}
    clear_plan_caches()
    compared = compare_release(verl_util, ours, cp_size, cp_rank, batches, strict=True)
    prefix = f"tp={tp_size} cp={cp_size} rank={cp_rank}"
    failures = [
        f"{prefix} {f.function} {f.describe()}"
        for f in unexcused(compared.findings, patching.release_of(verl_util), cp_size)
    ]
    failures += [f"{prefix} {name} left to verl: {why}" for name, why in left.items()]
    return {"compared": compared.compared, "failures": failures, "functions": sorted(ours)}


def world_worker(rank: int, world_size: int, tp_size: int, batches: tuple) -> dict:
    """One gloo world runs every check of the verl test files (process start and imports dominate the cost)."""
    from megatron.core import parallel_state as mpu

    from tests import test_verl_cost, test_verl_fixes, test_verl_patching

    cp_size = world_size // tp_size
    mpu.initialize_model_parallel(tensor_model_parallel_size=tp_size, context_parallel_size=cp_size)
    try:
        cp_rank = mpu.get_context_parallel_rank()
        results = {"equality": equality_checks(tp_size, cp_size, cp_rank, batches)}
        results["op_counts"] = test_verl_cost.op_count_checks()
        if tp_size == 1:
            results["fixes"] = test_verl_fixes.fixes_checks(cp_size, cp_rank)
        if tp_size == 1 and cp_size <= 2:  # last: it installs and uninstalls the patch
            results["patching"] = test_verl_patching.patch_checks()
        return results
    finally:
        mpu.destroy_model_parallel()


# name -> (world size, TP size, batches as (seed, shortest row, padding))
BOTH = ((0, 1, "rollout"), (1, 1, "anywhere"))
WORLDS = {
    "cp1": (1, 1, BOTH),
    "cp2": (2, 1, BOTH),
    "cp4": (4, 1, ((2, 1, "rollout"),)),
    "tp2-cp2": (4, 2, ((3, 1, "anywhere"),)),
}


@functools.cache
def world(name: str) -> list[dict]:
    """Per-rank results of ``world_worker`` for one of ``WORLDS`` (run once per pytest session)."""
    pytest.importorskip("verl")
    pytest.importorskip("megatron.core")
    world_size, tp_size, batches = WORLDS[name]
    return run_gloo(world_worker, world_size, tp_size, batches)


@pytest.mark.slow  # gloo worlds with verl and Megatron imported in every rank
@pytest.mark.stacks
@pytest.mark.parametrize(
    "name",
    [
        pytest.param(name, marks=[pytest.mark.slow, pytest.mark.stacks] if name in ("cp4", "tp2-cp2") else [])
        for name in WORLDS
    ],
)
def test_dropins_equal_verl_util(name):
    results = world(name)
    failures = [failure for result in results for failure in result["equality"]["failures"]]
    assert not failures, "\n".join(failures[:40])
    for result in results:  # every function compared on every rank (a crash on every batch would compare nothing)
        compared = result["equality"]["compared"]
        assert len(result["equality"]["functions"]) >= 9, result["equality"]["functions"]
        assert all(compared.get(function, 0) >= 2 for function in result["equality"]["functions"]), compared
        assert sum(compared.values()) > 100, compared
