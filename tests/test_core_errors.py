"""Bad input: a TypeError/ValueError that says what is wrong and how to fix it, before any work."""

import pytest
import torch

from verl_cppack import Alignment, ParallelContext, plan_from_lengths, plan_from_mask, plan_from_nested

CP2 = ParallelContext(cp_size=2, cp_rank=0)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(tp_size=0), ValueError, "tp_size must be >= 1"),
        (dict(cp_size=0), ValueError, "cp_size must be >= 1"),
        (dict(cp_size=2, cp_rank=2), ValueError, "0 <= cp_rank < cp_size"),
        (dict(cp_rank=-1), ValueError, "0 <= cp_rank < cp_size"),
        (dict(tp_size=2.0), TypeError, "tp_size must be an int"),
        (dict(cp_size=True), TypeError, "cp_size must be an int"),
    ],
)
def test_parallel_context(kwargs, error, match):
    with pytest.raises(error, match=match):
        ParallelContext(**kwargs)


@pytest.mark.parametrize(
    "mask, error, match",
    [
        ([[1, 0]], TypeError, "torch.Tensor"),
        (torch.ones(4, dtype=torch.bool), ValueError, r"2-D \[B, S\]"),
        (torch.ones(2, 3, 1, dtype=torch.bool), ValueError, r"2-D \[B, S\]"),
        (torch.ones(2, 3), TypeError, "bool or integer 0/1"),
        (torch.tensor([[1, 2, 0]]), ValueError, "values must be 0 or 1; found 1"),
        (torch.tensor([[1, -1, 0]]), ValueError, "values must be 0 or 1"),
        (torch.ones(0, 3, dtype=torch.bool), ValueError, "B >= 1 and S >= 1"),
        (torch.zeros(3, 4, dtype=torch.bool), ValueError, "zero valid tokens"),
    ],
)
def test_attention_mask(mask, error, match):
    with pytest.raises(error, match=match):
        plan_from_mask(mask, CP2)


@pytest.mark.parametrize(
    "layout, alignment, ctx, match",
    [
        ("zigzag", 6, CP2, "divisible by 4"),
        ("zigzag", Alignment.per_stream(8), CP2, "divisible by 4"),
        ("contiguous", Alignment.per_stream(3), CP2, "multiple of cp_size \\* tp_size = 2"),
        ("zigzag", 4, ParallelContext(tp_size=4, cp_size=2), "multiple of cp_size \\* tp_size = 8"),
        ("zigzag", 3, ParallelContext(tp_size=2), "multiple of cp_size \\* tp_size = 2"),
    ],
)
def test_alignment_the_layout_cannot_satisfy(layout, alignment, ctx, match):
    with pytest.raises(ValueError, match=match):
        plan_from_mask(torch.ones(2, 5, dtype=torch.bool), ctx, layout=layout, alignment=alignment)


def test_alignment_arguments():
    with pytest.raises(ValueError, match="either fp8=True"):
        plan_from_mask(torch.ones(1, 4, dtype=torch.bool), alignment=4, fp8=True)
    with pytest.raises(TypeError, match="alignment must be an int"):
        plan_from_mask(torch.ones(1, 4, dtype=torch.bool), alignment=4.0)
    with pytest.raises(ValueError, match="must be a multiple of slot_multiple"):
        Alignment(slot_multiple=4, stream_multiple=6)
    with pytest.raises(ValueError, match="slot_multiple must be >= 1"):
        Alignment(slot_multiple=0)


@pytest.mark.parametrize(
    "seqlens, error, match",
    [
        ([3, -1], ValueError, "seqlens must be >= 0"),
        (torch.tensor([2.0, 3.0]), TypeError, "integer tensor"),
        (torch.tensor([[2, 3]]), ValueError, "1-D"),
        ([], ValueError, "at least one sequence"),
        ([2, True], TypeError, "sequence of ints"),
        ([0, 0], ValueError, "zero valid tokens"),
    ],
)
def test_lengths(seqlens, error, match):
    with pytest.raises(error, match=match):
        plan_from_lengths(seqlens, CP2)


def test_nested_source_must_be_jagged():
    with pytest.raises(TypeError, match="jagged nested tensor"):
        plan_from_nested(torch.ones(2, 3))


def test_pack_rejects_tensors_that_do_not_fit_the_plan():
    mask_plan = plan_from_mask(torch.ones(2, 4, dtype=torch.bool), CP2)
    with pytest.raises(ValueError, match=r"\[B, S, \*\] = \[2, 4, \*\]"):
        mask_plan.pack(torch.ones(2, 5))
    with pytest.raises(ValueError, match=r"\[B, S, \*\] = \[2, 4, \*\]"):
        mask_plan.pack(torch.ones(8))
    nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged)
    with pytest.raises(TypeError, match="padded \\[B, S, \\*\\] tensor"):
        mask_plan.pack(nested)
    with pytest.raises(ValueError, match="shift must be >= 0"):
        mask_plan.pack(torch.ones(2, 4), shift=-1)

    lengths_plan = plan_from_lengths([2, 2], CP2)
    with pytest.raises(TypeError, match="jagged nested tensor"):
        lengths_plan.pack(torch.ones(2, 2))
    with pytest.raises(ValueError, match="2 sequences / 5 tokens, the plan expects 2 / 4"):
        lengths_plan.pack(nested)


def test_unpack_rejects_a_local_tensor_of_the_wrong_length():
    plan = plan_from_mask(torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="T_local=8"):
        plan.unpack(torch.ones(1, 7))
    with pytest.raises(ValueError, match="T_local=8"):
        plan.unpack(torch.ones(8))
    with pytest.raises(ValueError, match="one local output per CP rank"):
        plan.restore([torch.ones(1, 8), torch.ones(1, 8)])
    with pytest.raises(ValueError, match="gradient must be 'local' or 'sum'"):
        plan.unpack(torch.ones(1, 8), gradient="mean")


def test_unpack_with_cp_needs_a_group():
    plan = plan_from_mask(torch.ones(2, 4, dtype=torch.bool), CP2)
    with pytest.raises(ValueError, match="needs ctx.cp_group"):
        plan.unpack(plan.pack(torch.ones(2, 4)))


def test_empty_rows_are_fine_when_some_row_has_tokens():
    plan = plan_from_mask(torch.tensor([[0, 0, 0], [0, 1, 0]]), CP2)
    assert plan.seqlens.tolist() == [0, 1]
    assert plan.cu_seqlens_padded.tolist() == [0, 0, 4]
