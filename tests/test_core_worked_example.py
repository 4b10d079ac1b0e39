"""The worked example of docs/design.md, by hand: B=2, S=8, CP=2, TP=1; documents [4, 3, 6]. Every number below is hand-computed."""

import pytest
import torch

from verl_cppack import ParallelContext, plan_from_lengths, plan_from_mask, plan_from_nested, zigzag_indices

DOCUMENTS = [list("abcE"), list("deE"), list("fghijE")]
TOKENS = [t for doc in DOCUMENTS for t in doc]
CODE = {t: i + 1 for i, t in enumerate(sorted(set(TOKENS)))}  # 0 stays free for padding


def _nested_tokens() -> torch.Tensor:
    return torch.nested.nested_tensor([torch.tensor([CODE[t] for t in doc]) for doc in DOCUMENTS], layout=torch.jagged)


def _decode(packed: torch.Tensor, valid: torch.Tensor) -> list[str]:
    by_code = {v: k for k, v in CODE.items()}
    return [by_code[int(c)] if v else "P" for c, v in zip(packed.tolist(), valid.tolist())]


def test_offsets_and_padding_for_cp2():
    plan = plan_from_lengths([4, 3, 6], ParallelContext(cp_size=2, cp_rank=0))
    assert plan.cu_seqlens.tolist() == [0, 4, 7, 13]
    assert plan.seqlens_padded.tolist() == [4, 4, 8]
    assert plan.cu_seqlens_padded.tolist() == [0, 4, 8, 16]
    assert plan.cu_seqlens.dtype == plan.cu_seqlens_padded.dtype == torch.int32
    assert plan.max_seqlen_padded == 8
    assert (plan.total_length, plan.local_length, plan.num_valid_tokens) == (16, 8, 13)
    stream_valid = (plan.stream_source < plan.source_rows).int().tolist()
    assert stream_valid == [1, 1, 1, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1, 0, 0]


@pytest.mark.parametrize(
    "rank, index, tokens, num_valid",
    [
        (0, [0, 3, 4, 7, 8, 9, 14, 15], "a E d P f g P P", 5),
        (1, [1, 2, 5, 6, 10, 11, 12, 13], "b c e E h i j E", 8),
    ],
)
def test_zigzag_ranks(rank, index, tokens, num_valid):
    nested = _nested_tokens()
    plan = plan_from_nested(nested, ParallelContext(cp_size=2, cp_rank=rank), layout="zigzag")
    assert plan.local_index.tolist() == index
    packed = plan.pack(nested)
    assert packed.shape == (1, 8)
    assert _decode(packed[0], plan.local_valid_mask) == tokens.split()
    assert int(plan.local_valid_mask.sum()) == num_valid
    assert torch.equal(zigzag_indices(plan.cu_seqlens_padded, 2, rank), torch.tensor(index))


@pytest.mark.parametrize("rank, index", [(0, list(range(0, 8))), (1, list(range(8, 16)))])
def test_contiguous_ranks(rank, index):
    nested = _nested_tokens()
    plan = plan_from_nested(nested, ParallelContext(cp_size=2, cp_rank=rank), layout="contiguous")
    assert plan.cu_seqlens_padded.tolist() == [0, 4, 8, 16]
    assert plan.local_index.tolist() == index
    expected = "a b c E d e E P" if rank == 0 else "f g h i j E P P"
    assert _decode(plan.pack(nested)[0], plan.local_valid_mask) == expected.split()


def test_cp1_is_the_whole_unpadded_stream():
    nested = _nested_tokens()
    plan = plan_from_nested(nested, ParallelContext())
    assert plan.cu_seqlens_padded.tolist() == [0, 4, 7, 13]
    assert plan.local_index.tolist() == list(range(13))
    assert _decode(plan.pack(nested)[0], plan.local_valid_mask) == TOKENS
    assert plan.local_position_ids.tolist() == [0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3, 4, 5]


def test_positions_restart_per_sequence_on_each_rank():
    plans = [plan_from_lengths([4, 3, 6], ParallelContext(cp_size=2, cp_rank=r)) for r in range(2)]
    assert plans[0].local_position_ids.tolist() == [0, 3, 0, 3, 0, 1, 6, 7]
    assert plans[1].local_position_ids.tolist() == [1, 2, 1, 2, 2, 3, 4, 5]


def test_restore_puts_every_token_back():
    nested = _nested_tokens()
    plans = [plan_from_nested(nested, ParallelContext(cp_size=2, cp_rank=r)) for r in range(2)]
    restored = plans[0].restore([p.pack(nested) for p in plans])
    assert [t.tolist() for t in restored.unbind()] == [t.tolist() for t in nested.unbind()]


def test_transformer_engine_pin():
    """TE's own test: cu=[0,8,16], CP=2."""
    cu = torch.tensor([0, 8, 16], dtype=torch.int32)
    assert zigzag_indices(cu, 2, 0).tolist() == [0, 1, 6, 7, 8, 9, 14, 15]
    assert zigzag_indices(cu, 2, 1).tolist() == [2, 3, 4, 5, 10, 11, 12, 13]


def test_padded_rows_give_the_same_stream_as_the_example_rows():
    """The same sequences as rows of a right-padded [3, 6] batch pack identically."""
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1]])
    x = torch.zeros(3, 6, dtype=torch.long)
    for row, doc in enumerate(DOCUMENTS):
        x[row, : len(doc)] = torch.tensor([CODE[t] for t in doc])
    plan = plan_from_mask(mask, ParallelContext(cp_size=2, cp_rank=1))
    assert plan.cu_seqlens_padded.tolist() == [0, 4, 8, 16]
    assert _decode(plan.pack(x)[0], plan.local_valid_mask) == ["b", "c", "e", "E", "h", "i", "j", "E"]
