"""Layouts: zigzag equals Transformer Engine's partitioner token for token; every layout is a permutation."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.oracle import te_partitioned_indices
from verl_cppack import get_layout, zigzag_indices
from verl_cppack.core import runs as runs_module
from verl_cppack.core.runs import count_up


@st.composite
def packs(draw):
    cp_size = draw(st.sampled_from([1, 2, 3, 4, 8]))
    chunks = draw(st.lists(st.integers(0, 5), min_size=1, max_size=12))  # 0 = zero-length slot
    cu = [0]
    for n in chunks:
        cu.append(cu[-1] + n * 2 * cp_size)
    return cp_size, cu


@settings(max_examples=150, deadline=None)
@given(packs())
def test_zigzag_matches_te_kernel_port(pack):
    cp_size, cu = pack
    for dtype in (torch.int32, torch.int64):
        cu_tensor = torch.tensor(cu, dtype=dtype)
        for rank in range(cp_size):
            expected = te_partitioned_indices(cu, cu[-1], cp_size, rank)
            got = zigzag_indices(cu_tensor, cp_size, rank)
            assert got.dtype == torch.int64
            assert got.tolist() == expected


@settings(max_examples=100, deadline=None)
@given(packs(), st.sampled_from(["zigzag", "contiguous"]))
def test_ranks_together_hold_every_position_exactly_once(pack, layout_name):
    cp_size, cu = pack
    partition = get_layout(layout_name).partition(torch.tensor(cu), cp_size)
    assert partition.shape == (cp_size, cu[-1] // cp_size)
    assert sorted(partition.reshape(-1).tolist()) == list(range(cu[-1]))


def test_contiguous_is_consecutive_ranges():
    partition = get_layout("contiguous").partition(torch.tensor([0, 4, 12]), 3)
    assert partition.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]


def test_zigzag_rank_holds_front_and_mirrored_back_chunk():
    # one slot of 12 tokens, CP=3: chunks of 2; rank r holds chunk r and chunk 5-r
    assert zigzag_indices(torch.tensor([0, 12]), 3, 0).tolist() == [0, 1, 10, 11]
    assert zigzag_indices(torch.tensor([0, 12]), 3, 1).tolist() == [2, 3, 8, 9]
    assert zigzag_indices(torch.tensor([0, 12]), 3, 2).tolist() == [4, 5, 6, 7]


@pytest.mark.parametrize(
    "cu, cp_size, rank, error, match",
    [
        (torch.tensor([0.0, 4.0]), 2, 0, TypeError, "integer"),
        ([0, 4], 2, 0, TypeError, "torch.Tensor"),
        (torch.tensor([[0, 4]]), 2, 0, ValueError, "1-D"),
        (torch.tensor([0]), 2, 0, ValueError, "at least 2"),
        (torch.tensor([4, 8]), 2, 0, ValueError, "start at 0"),
        (torch.tensor([0, 8, 4]), 2, 0, ValueError, "non-decreasing"),
        (torch.tensor([0, 6]), 2, 0, ValueError, "divisible by 4"),
        (torch.tensor([0, 8]), 2, 2, ValueError, "cp_rank"),
        (torch.tensor([0, 8]), 0, 0, ValueError, "cp_size"),
        (torch.tensor([0, 8]), 2.0, 0, TypeError, "cp_size"),
    ],
)
def test_zigzag_indices_rejects_bad_input(cu, cp_size, rank, error, match):
    with pytest.raises(error, match=match):
        zigzag_indices(cu, cp_size, rank)


def test_unknown_layout_is_rejected():
    with pytest.raises(ValueError, match="layout must be one of"):
        get_layout("striped")


def test_counting_is_a_read_only_arange_kept_up_to_a_bound(monkeypatch):
    """The counting table every expansion adds: 0, 1, 2, ... of the asked dtype, never writable (it is shared), kept
    between calls up to a bound; a longer one is made for its caller alone."""
    monkeypatch.setattr(runs_module, "_COUNTS", {})
    monkeypatch.setattr(runs_module, "_KEPT_COUNTS", 64)
    for size, dtype in [(5, np.int64), (40, np.int32), (3, np.int32), (64, np.int64), (0, np.int64)]:
        counts = runs_module.counting(size, dtype)
        assert counts.dtype == dtype and counts.tolist() == list(range(size)) and not counts.flags.writeable
    assert runs_module._COUNTS[np.dtype(np.int32)].size == 40 and runs_module._COUNTS[np.dtype(np.int64)].size == 64
    long = runs_module.counting(100, np.int64)
    assert long.tolist() == list(range(100)) and not long.flags.writeable
    assert runs_module._COUNTS[np.dtype(np.int64)].size == 64  # not kept past the bound


runs_tables = st.lists(st.tuples(st.integers(0, 6), st.integers(-1000, 1000), st.booleans()), min_size=1, max_size=12)
CPU = torch.device("cpu")


@settings(max_examples=120, deadline=None)
@given(runs_tables, st.sampled_from([torch.int64, torch.int32]))
def test_count_up_counts_like_a_loop(runs, dtype):
    """Run k counts up by one from its first value; zero-length runs anywhere (first, last, in a row); as int64 and
    as int32."""
    lengths, firsts, _ = (np.array(column, dtype=np.int64) for column in zip(*runs))
    expected = [first + i for length, first in zip(lengths, firsts) for i in range(length)]
    assert count_up(firsts, lengths).tolist() == expected
    narrow = count_up(firsts, lengths, np.int32 if dtype == torch.int32 else np.int64)
    assert narrow.dtype == (np.int32 if dtype == torch.int32 else np.int64) and narrow.tolist() == expected
