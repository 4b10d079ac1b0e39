"""Dynamic context parallelism (verl's ``local_cp_size``) on released megatron-core.

verl asks ``parallel_state.get_dynamic_data_context_parallel_groups`` (its dev-branch name) for the group of
``local_cp_size`` ranks; released megatron-core (0.16.1 here) names it ``get_hybrid_data_context_parallel_groups``.
In a 2-rank gloo world (static CP=1, so the data-parallel ranks form the dynamic group of 2): the drop-ins find
the released getter when only it exists, and equal verl 0.9.1 — run with the dev name pointed at the released
getter, which it needs — in packed rows, ``PackedSeqParams`` (``local_cp_size``, ``cp_group``), gathered outputs
and local gradients, also for params verl made.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_gloo

pytest.importorskip("verl")
pytest.importorskip("megatron.core")


def _dynamic_cp(rank: int, world_size: int) -> dict:
    import verl.models.mcore.util as verl_util
    from megatron.core import parallel_state as mpu

    from verl_cppack.integrations.verl import dropins

    mpu.initialize_model_parallel()  # CP=1, DP=2
    nested = torch.nested.nested_tensor(
        [torch.arange(1, 6), torch.arange(11, 13), torch.arange(21, 30)], layout=torch.jagged
    )
    try:
        assert not hasattr(mpu, "get_dynamic_data_context_parallel_groups")
        group = mpu.get_hybrid_data_context_parallel_groups(group_size=world_size)
        ours_released = dropins.preprocess_thd_engine(nested, local_cp_size=world_size)
        mpu.get_dynamic_data_context_parallel_groups = mpu.get_hybrid_data_context_parallel_groups  # for verl
        ours_dev = dropins.preprocess_thd_engine(nested, local_cp_size=world_size)
        theirs = verl_util.preprocess_thd_engine(nested, local_cp_size=world_size)
        outputs = {}
        for name, function, params in (
            ("ours", dropins.postprocess_thd_engine, ours_dev[1]),
            ("verl", verl_util.postprocess_thd_engine, theirs[1]),
            ("ours on verl's params", dropins.postprocess_thd_engine, theirs[1]),
        ):
            local = (theirs[0].float() * (rank + 1)).requires_grad_(True)
            gathered = function(local, params, nested, 3, local_cp_size=world_size)
            (gathered.values() * torch.arange(gathered.values().numel())).sum().backward()
            outputs[name] = (gathered.values().detach(), local.grad)
        return {
            "rows": [ours_released[0], ours_dev[0], theirs[0]],
            "groups": [p.cp_group is group for p in (ours_released[1], ours_dev[1], theirs[1])],
            "local_cp_size": [p.local_cp_size for p in (ours_released[1], ours_dev[1], theirs[1])],
            "offsets": [p.cu_seqlens_q_padded for p in (ours_released[1], ours_dev[1], theirs[1])],
            "outputs": outputs,
        }
    finally:
        if hasattr(mpu, "get_dynamic_data_context_parallel_groups"):
            del mpu.get_dynamic_data_context_parallel_groups
        mpu.destroy_model_parallel()


@pytest.mark.slow  # a gloo world importing verl
@pytest.mark.stacks
def test_the_released_dynamic_cp_getter_is_found_and_the_results_equal_verls():
    for result in run_gloo(_dynamic_cp, 2):
        ours_released, ours_dev, theirs = result["rows"]
        assert torch.equal(ours_released, theirs) and torch.equal(ours_dev, theirs)
        assert result["groups"] == [True, True, True] and result["local_cp_size"] == [2, 2, 2]
        assert all(torch.equal(offsets, result["offsets"][2]) for offsets in result["offsets"])
        verl_values, verl_grad = result["outputs"]["verl"]
        for name in ("ours", "ours on verl's params"):
            values, grad = result["outputs"][name]
            assert torch.equal(values, verl_values) and torch.equal(grad, verl_grad), name
