"""PackedSeqParams as verl 0.9.1 builds them: by keyword, for megatron's class or a duck-typed stand-in.

verl passes every field by keyword and counts a class whose ``__init__`` takes ``**kwargs`` as accepting all
of them, ``cp_partition_mode`` included (its comment: "duck-typed replacements (e.g. test stubs taking
``**kwargs``) also count"); the contiguous CP layout is allowed exactly when ``cp_partition_mode`` is accepted.
An unknown ``cp_layout`` raises verl's own ``ValueError`` message.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_gloo
from verl_cppack import ParallelContext, plan_from_lengths
from verl_cppack.integrations.megatron import packed_seq_params

pytest.importorskip("megatron.core.packed_seq_params")


class KwargsParams:
    """A duck-typed PackedSeqParams: takes anything by keyword and keeps it."""

    def __init__(self, **kwargs):
        self.received = dict(kwargs)
        self.__dict__.update(kwargs)


class NamedFieldsParams:
    """Names the fields megatron-core 0.16.1 has, no ``cp_partition_mode``, no ``**kwargs``."""

    def __init__(
        self,
        qkv_format=None,
        cu_seqlens_q=None,
        cu_seqlens_kv=None,
        cu_seqlens_q_padded=None,
        cu_seqlens_kv_padded=None,
        max_seqlen_q=None,
        max_seqlen_kv=None,
    ):
        self.received = {k: v for k, v in locals().items() if k != "self" and v is not None}


class WithPartitionMode:
    def __init__(
        self,
        qkv_format=None,
        cu_seqlens_q=None,
        cu_seqlens_kv=None,
        cu_seqlens_q_padded=None,
        cu_seqlens_kv_padded=None,
        max_seqlen_q=None,
        max_seqlen_kv=None,
        cp_partition_mode="zigzag",
    ):
        self.received = {k: v for k, v in locals().items() if k != "self"}


THD_FIELDS = {
    "qkv_format",
    "cu_seqlens_q",
    "cu_seqlens_kv",
    "cu_seqlens_q_padded",
    "cu_seqlens_kv_padded",
    "max_seqlen_q",
    "max_seqlen_kv",
}


@pytest.fixture
def use_class(monkeypatch):
    import megatron.core.packed_seq_params as module

    return lambda cls: monkeypatch.setattr(module, "PackedSeqParams", cls)


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_a_class_taking_kwargs_gets_every_field(use_class, layout):
    use_class(KwargsParams)
    plan = plan_from_lengths([4, 3, 6], ParallelContext(cp_size=2), layout=layout)
    params = packed_seq_params(plan)
    assert set(params.received) == THD_FIELDS | {"cp_partition_mode"}
    assert params.cp_partition_mode == layout
    assert params.cu_seqlens_q_padded.tolist() == params.cu_seqlens_kv.tolist() == [0, 4, 8, 16]
    assert params.max_seqlen_q == params.max_seqlen_kv == 8 and params.qkv_format == "thd"


def test_the_contiguous_layout_follows_cp_partition_mode_as_in_verl(use_class):
    use_class(NamedFieldsParams)
    plan = plan_from_lengths([4, 3, 6], ParallelContext(cp_size=2), layout="contiguous")
    with pytest.raises(ValueError, match="cp_partition_mode"):
        packed_seq_params(plan)
    assert set(packed_seq_params(plan_from_lengths([4, 3], ParallelContext(cp_size=2))).received) == THD_FIELDS
    use_class(WithPartitionMode)
    params = packed_seq_params(plan_from_lengths([4, 3, 6], ParallelContext(cp_size=2), layout="contiguous"))
    assert params.received["cp_partition_mode"] == "contiguous"


def test_an_unknown_cp_layout_raises_verls_error():
    util = pytest.importorskip("verl.models.mcore.util")
    from verl_cppack.integrations.verl import dropins

    nested = torch.nested.nested_tensor([torch.ones(3), torch.ones(2)], layout=torch.jagged)
    for layout in ("ring", ["zigzag"], None):
        for ours, theirs in (
            (
                lambda: dropins.preprocess_thd_engine(nested, cp_layout=layout),
                lambda: util.preprocess_thd_engine(nested, cp_layout=layout),
            ),
            (
                lambda: dropins.postprocess_thd_engine(nested, None, nested, 2, cp_layout=layout),
                lambda: util.postprocess_thd_engine(nested, None, nested, 2, cp_layout=layout),
            ),
        ):
            with pytest.raises(ValueError) as verl_error:
                theirs()
            with pytest.raises(type(verl_error.value)) as our_error:
                ours()
            assert str(our_error.value) == str(verl_error.value) == f"Unsupported context parallel layout: {layout}"


def _side_by_side(rank, world_size):
    """verl's preprocess_thd_engine and ours, both building the same stand-in class, at CP=world_size."""
    import inspect

    import megatron.core.packed_seq_params as module
    import verl.models.mcore.util as util
    from megatron.core import parallel_state as mpu

    from tests.test_verl_packed_seq_params import KwargsParams, NamedFieldsParams, WithPartitionMode
    from verl_cppack.integrations.verl import dropins

    mpu.initialize_model_parallel(context_parallel_size=world_size)
    results = {}
    try:
        nested = torch.nested.nested_tensor([torch.arange(5), torch.arange(3), torch.arange(9)], layout=torch.jagged)
        for name, cls in (("kwargs", KwargsParams), ("named", NamedFieldsParams), ("partition", WithPartitionMode)):
            parameters = inspect.signature(cls.__init__).parameters
            module.PackedSeqParams = util.PackedSeqParams = cls  # what each builds
            util._PACKED_SEQ_PARAMS_HAS_CP_PARTITION_MODE = "cp_partition_mode" in parameters or any(
                p.kind is p.VAR_KEYWORD for p in parameters.values()
            )  # as verl computes it at import, for this class
            for layout in ("zigzag", "contiguous"):
                outcome = []
                for function in (util.preprocess_thd_engine, dropins.preprocess_thd_engine):
                    try:
                        _, params, _ = function(nested, cp_layout=layout)
                        received = params.received.items()
                        outcome.append({k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in received})
                    except ValueError as error:
                        outcome.append(("ValueError", "cp_partition_mode" in str(error)))
                results[name, layout] = outcome
    finally:
        mpu.destroy_model_parallel()
    return results


@pytest.mark.slow  # gloo worlds importing verl
@pytest.mark.stacks
def test_fields_and_contiguous_support_equal_verls():
    pytest.importorskip("verl.models.mcore.util")
    for results in run_gloo(_side_by_side, 2):
        for (name, layout), (verl_outcome, our_outcome) in results.items():
            assert our_outcome == verl_outcome, (name, layout, verl_outcome, our_outcome)
        assert results["named", "contiguous"][0] == ("ValueError", True)
        assert results["kwargs", "contiguous"][0]["cp_partition_mode"] == "contiguous"
        assert results["partition", "contiguous"][0]["cp_partition_mode"] == "contiguous"
