"""PackedSeqParams from a plan, and the ParallelContext read from megatron.core.parallel_state (integrations.megatron)."""

import dataclasses

import pytest
import torch

from tests.distributed import run_gloo
from verl_cppack import ParallelContext, plan_from_lengths
from verl_cppack.integrations import megatron as megatron_integration
from verl_cppack.integrations.megatron import packed_seq_params, parallel_context_from_megatron


def test_packed_seq_params_carry_global_padded_offsets():
    plan = plan_from_lengths([4, 3, 6], ParallelContext(cp_size=2, cp_rank=1))
    params = packed_seq_params(plan)
    assert params.qkv_format == "thd"
    for name in ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
        assert getattr(params, name).tolist() == [0, 4, 8, 16]
        assert getattr(params, name).dtype == torch.int32
    assert params.max_seqlen_q == params.max_seqlen_kv == 8


def test_each_call_returns_a_new_packed_seq_params():
    """Like verl's, every call hands out its own object: a caller editing one does not change the next."""
    plan = plan_from_lengths([4, 3, 6], ParallelContext(cp_size=2))
    first = packed_seq_params(plan)
    first.max_seqlen_q = 1
    second = packed_seq_params(plan)
    assert second is not first and second.max_seqlen_q == 8
    assert second.cu_seqlens_q_padded.tolist() == [0, 4, 8, 16]


def test_real_seqlens_in_attention_uses_unpadded_offsets():
    params = packed_seq_params(plan_from_lengths([4, 3, 6], ParallelContext(cp_size=2)), real_seqlens_in_attention=True)
    assert params.cu_seqlens_q.tolist() == [0, 4, 7, 13]
    assert params.cu_seqlens_q_padded.tolist() == [0, 4, 8, 16]
    assert params.max_seqlen_q == 6


def test_uses_megatron_class_when_installed():
    megatron = pytest.importorskip("megatron.core.packed_seq_params")
    params = packed_seq_params(plan_from_lengths([3], ParallelContext()))
    assert type(params) is megatron.PackedSeqParams


def test_fallback_dataclass_without_megatron(monkeypatch):
    monkeypatch.setattr(
        megatron_integration, "packed_seq_params_class", lambda: megatron_integration.FallbackPackedSeqParams
    )
    params = packed_seq_params(plan_from_lengths([3, 5], ParallelContext(cp_size=2), layout="contiguous"))
    assert isinstance(params, megatron_integration.FallbackPackedSeqParams)
    assert params.cu_seqlens_q_padded.tolist() == [0, 4, 12]  # slots padded to 2 * CP = 4


def test_contiguous_layout_needs_cp_partition_mode_on_megatron():
    pytest.importorskip("megatron.core.packed_seq_params")
    plan = plan_from_lengths([3, 5], ParallelContext(cp_size=2), layout="contiguous")
    if "cp_partition_mode" in megatron_integration.packed_seq_params_fields(
        megatron_integration.packed_seq_params_class()
    ):
        assert packed_seq_params(plan).cp_partition_mode == "contiguous"
    else:
        with pytest.raises(ValueError, match="cp_partition_mode"):
            packed_seq_params(plan)


def test_parallel_context_from_megatron_before_initialisation_is_a_clear_error():
    pytest.importorskip("megatron.core")
    with pytest.raises(ValueError, match="not initialised"):
        parallel_context_from_megatron()


def _context_from_megatron(rank, world_size):
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(context_parallel_size=world_size)
    try:
        ctx = parallel_context_from_megatron()
        same_group = ctx.cp_group is parallel_state.get_context_parallel_group()
        again = parallel_context_from_megatron()
    finally:
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world_size)  # a new state: TP=2, CP=1
    try:
        after_reinit = parallel_context_from_megatron()
        parallel_state.set_tensor_model_parallel_world_size(4)  # megatron's override of the TP size
        overridden = parallel_context_from_megatron()
        parallel_state.set_tensor_model_parallel_world_size(None)
        override_lifted = parallel_context_from_megatron()
    finally:
        parallel_state.destroy_model_parallel()
    try:  # the contexts of both states are kept, but a torn-down state has no context
        parallel_context_from_megatron()
        after_destroy = "no error"
    except ValueError as error:
        after_destroy = str(error)
    later = (after_reinit, overridden, override_lifted, after_destroy)
    return dataclasses.replace(ctx, cp_group=None), same_group, again == ctx, later


@pytest.mark.slow  # a gloo world with Megatron imported in every rank
def test_parallel_context_from_megatron_reads_parallel_state():
    """Read once per parallel state (the context is kept per group), and read afresh after re-initialisation
    or when megatron's TP-size override changes; after ``destroy_model_parallel`` it is an error again."""
    pytest.importorskip("megatron.core")
    for rank, (ctx, same_group, same_again, later) in enumerate(run_gloo(_context_from_megatron, 2)):
        assert ctx == ParallelContext(tp_size=1, cp_size=2, cp_rank=rank)
        assert same_group and same_again
        after_reinit, overridden, override_lifted, after_destroy = later
        assert after_reinit == override_lifted == ParallelContext(tp_size=2, cp_size=1, cp_rank=0)
        assert overridden == ParallelContext(tp_size=4, cp_size=1, cp_rank=0)
        assert "not initialised" in after_destroy
