"""Every CP rank calls the same collectives in the same order, whatever its plan caches hold.

verl's BSHD engine path hands back the mask ``preprocess_bshd_engine`` returned; the gather-back finds its plan
in a per-process cache. Here one rank's cache is cleared, evicted (more masks than it keeps), or handed an equal
but different mask object, while the other ranks' caches hold the plan: every rank must still finish (no rank
waiting in a collective the others skipped) with verl's own rows. Real gloo processes at CP=2 and CP=4.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("verl.models.mcore.util")

from tests.distributed import run_gloo  # noqa: E402

pytestmark = pytest.mark.slow

LENGTHS = [5, 1, 12, 7]


def _nested(scale: int = 1) -> torch.Tensor:
    return torch.nested.nested_tensor(
        [scale * torch.arange(1, n + 1) + 100 * i for i, n in enumerate(LENGTHS)], layout=torch.jagged
    )


def _diverging_caches(rank, world_size, mode):
    from megatron.core import parallel_state
    from verl.models.mcore import util as verl_util

    from verl_cppack.integrations.verl import dropins

    parallel_state.initialize_model_parallel(context_parallel_size=world_size)
    try:
        ids = _nested()
        packed, mask, _ = dropins.preprocess_bshd_engine(ids)
        verl_packed, verl_mask, _ = verl_util.preprocess_bshd_engine(ids)
        if rank == 0 and mode == "cleared":
            dropins.clear_plan_caches()
        if rank == 0 and mode == "evicted":
            for scale in range(2, 12):  # more masks than the cache keeps
                dropins.preprocess_bshd_engine(_nested(scale))
        if rank == 0 and mode == "equal copy":
            mask = mask.clone()
        ours = dropins.postprocess_bshd_engine(packed * 10, mask)
        theirs = verl_util.postprocess_bshd_engine(verl_packed * 10, verl_mask)
        return [row.tolist() for row in ours.unbind()], [row.tolist() for row in theirs.unbind()]
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("cp_size", [2, 4])
@pytest.mark.parametrize("mode", ["cleared", "evicted", "equal copy"])
def test_a_rank_whose_cache_differs_still_gathers_with_the_others(cp_size, mode):
    for ours, theirs in run_gloo(_diverging_caches, cp_size, mode):
        assert ours == theirs
        assert ours == [[10 * (v + 100 * i) for v in range(1, n + 1)] for i, n in enumerate(LENGTHS)]
