"""Bad input: a TypeError/ValueError that says what is wrong and how to fix it, before any work."""

import pytest
import torch

from verl_cppack import Alignment, ParallelContext, plan_from_lengths, plan_from_mask, plan_from_nested
from verl_cppack.packing.builders import plan_from_checked_mask
from verl_cppack.packing.mask_rows import MaskRows

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
        (torch.ones(3, 4, dtype=torch.bool, device="meta"), ValueError, "meta tensor .* pass it with data"),
    ],
)
def test_attention_mask(mask, error, match):
    with pytest.raises(error, match=match):
        plan_from_mask(mask, CP2)


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled-build", "tensor-scan"])
@pytest.mark.parametrize(
    "mask, found",
    [(torch.tensor([[1, 2, 0], [2, 2, 1]]), 3), (torch.tensor([[1, -1, 0], [0, 1, 1]], dtype=torch.int8), 1)],
)
def test_mask_values_other_than_0_and_1_are_counted_by_either_scan(compiled, mask, found):
    """Both scans (a CPU mask's compiled build, the tensor ops an accelerator runs) count every offending entry."""
    with pytest.raises(ValueError, match=f"values must be 0 or 1; found {found} offending"):
        plan_from_checked_mask(mask, CP2, compiled=compiled)
    with pytest.raises(ValueError, match=f"values must be 0 or 1; found {found} offending"):
        MaskRows(mask).scan()
    valid = (mask == 1).to(mask.dtype)  # the same rows as 0/1 integers: planned like the bool mask
    assert plan_from_mask(valid, CP2).tables.seqlens.tolist() == (mask == 1).sum(1).tolist()


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
        (torch.ones(2, dtype=torch.long, device="meta"), ValueError, "meta tensor .* pass the lengths with data"),
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


def test_layout_must_be_a_name_or_a_layout():
    with pytest.raises(
        TypeError, match=r"layout must be one of \['contiguous', 'zigzag'\] \(a str\) or a Layout, got list"
    ):
        plan_from_mask(torch.ones(2, 4, dtype=torch.bool), layout=["zigzag"])
    with pytest.raises(ValueError, match="layout must be one of"):
        plan_from_mask(torch.ones(2, 4, dtype=torch.bool), layout="ring")


def test_restore_takes_every_ranks_output_as_a_list():
    plan = plan_from_mask(torch.ones(2, 4, dtype=torch.bool), CP2)
    with pytest.raises(TypeError, match="restore takes a list of every CP rank's"):
        plan.restore(torch.ones(1, 4))  # a tensor's rows are not ranks
    with pytest.raises(ValueError, match=r"local_outputs\[1\] must have shape \[1, T_local, \*\]"):
        plan.restore([torch.ones(1, 4), torch.ones(1, 3)])
    with pytest.raises(ValueError, match="same dtype"):
        plan.restore([torch.ones(1, 4), torch.ones(1, 4, dtype=torch.long)])


def test_errors_name_the_argument_the_caller_passed():
    plan = plan_from_mask(torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"^input_ids must have shape \[B, S, \*\]"):
        plan.pack(torch.ones(3, 4), name="input_ids")
    with pytest.raises(ValueError, match=r"^output must have shape \[1, T_local, \*\]"):
        plan.unpack(torch.ones(1, 5), name="output")
    with pytest.raises(TypeError, match="^output must be a torch.Tensor"):
        plan.unpack_nested([1.0], name="output")


def test_all_gather_rank_major_arguments():
    from verl_cppack.collectives.gather import all_gather_rank_major

    local = torch.ones(3, 2)
    with pytest.raises(TypeError, match="ctx must be a ParallelContext .* got NoneType"):
        all_gather_rank_major(local, None)
    with pytest.raises(TypeError, match="local must be a torch.Tensor"):
        all_gather_rank_major([1.0], ParallelContext())
    with pytest.raises(ValueError, match="gradient must be 'local' or 'sum', got 'mean'"):
        all_gather_rank_major(local, ParallelContext(), gradient="mean")
    assert all_gather_rank_major(local, ParallelContext()) is local  # CP=1: nothing to gather


@pytest.mark.parametrize("group", ["world", 0, object()])
def test_cp_group_must_be_a_process_group(group):
    """A string or a number, or an object torch.distributed cannot tell the size of (no process group here)."""
    with pytest.raises(TypeError, match=r"cp_group must be a torch.distributed.ProcessGroup \(or an object "):
        ParallelContext(cp_size=2, cp_group=group)


def test_document_ids_outside_the_documents_are_refused():
    from verl_cppack.loss.document_mean import document_mean_loss

    losses, mask = torch.ones(1, 4), torch.ones(1, 4, dtype=torch.bool)
    for ids in ([[0, 1, 2, 1]], [[0, -1, 1, 1]]):
        with pytest.raises(ValueError, match=r"document_ids must lie in \[0, num_documents\) = \[0, 2\)"):
            document_mean_loss(losses, mask, torch.tensor(ids), 2)
    assert (
        document_mean_loss(losses * torch.tensor([[1.0, 3.0, 3.0, 3.0]]), mask, torch.tensor([[0, 1, 1, 1]]), 2).value
        == 2.0
    )


def test_a_jagged_view_with_holes_is_planned_and_packed_by_its_real_lengths():
    """torch.nested.narrow keeps the base's offsets: lengths() [2, 3, 5, 1] differ from offsets().diff()."""
    base = torch.arange(40).view(4, 10)
    view = torch.nested.narrow(base, 1, torch.tensor([0, 1, 2, 3]), torch.tensor([2, 3, 5, 1]), layout=torch.jagged)
    assert view.offsets().diff().tolist() != [2, 3, 5, 1]
    plan = plan_from_nested(view)
    assert plan.seqlens.tolist() == [2, 3, 5, 1]
    expected = [0, 1, 11, 12, 13, 22, 23, 24, 25, 26, 33]  # base[i, start_i : start_i + length_i]
    assert plan.pack(view).view(-1).tolist() == expected
    assert [row.tolist() for row in plan.unpack(plan.pack(view)).unbind()] == [
        [0, 1],
        [11, 12, 13],
        [22, 23, 24, 25, 26],
        [33],
    ]
