"""The drop-ins for verl's VLM mask builders against a pure-Python oracle, their cost, and their errors.

``build_vlm_attn_mask_thd`` / ``build_vlm_attn_mask_bshd``: a jagged batch becomes rows of ``S`` tokens (the real
ones first, then ``pad_token_id``) and a bool mask of the real ones; ``S`` is the longest sequence (or
``forced_max_seqlen``) rounded up to ``TP*CP*2`` with CP>1, else to ``TP`` (verl 0.9.1); the variant for verl
0.8.0/0.9.0's thd builder does not round. The parallel context verl would read from megatron is replaced by an
explicit one, so this runs in this process (the matrix of tests/test_verl_release_matrix.py holds them to every
release's own builders in gloo). Equality with verl 0.9.1 itself: tests/test_verl_release_matrix.py.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.op_counts import ops_without_fills
from verl_cppack import ParallelContext
from verl_cppack.bench.counters import HostReadCounter, OpCounter
from verl_cppack.integrations.verl import dropins, vlm_masks


@pytest.fixture
def context(monkeypatch):
    """Set the TP/CP sizes the drop-ins read (instead of an initialised megatron parallel state)."""

    def use(tp_size: int = 1, cp_size: int = 1) -> None:
        monkeypatch.setattr(dropins, "megatron_context", lambda local_cp_size=None: ParallelContext(tp_size, cp_size))
        dropins.clear_plan_caches()

    use()
    return use


def oracle(sequences: list[list], pad, row_length: int) -> tuple[list, list]:
    rows = [sequence + [pad] * (row_length - len(sequence)) for sequence in sequences]
    mask = [[True] * len(sequence) + [False] * (row_length - len(sequence)) for sequence in sequences]
    return rows, mask


def aligned(length: int, tp_size: int, cp_size: int) -> int:
    multiple = tp_size * cp_size * 2 if cp_size > 1 else tp_size
    while length % multiple:
        length += 1
    return length


batches = st.lists(st.lists(st.integers(1, 50), max_size=9), min_size=1, max_size=6)


def nested(sequences: list[list[int]], dtype: torch.dtype = torch.long, trailing: int = 0) -> torch.Tensor:
    tensors = [torch.tensor(sequence, dtype=dtype) for sequence in sequences]
    if trailing:
        tensors = [t.unsqueeze(-1) * torch.arange(1, trailing + 1, dtype=dtype) for t in tensors]
    return torch.nested.nested_tensor(tensors, layout=torch.jagged)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)  # set per example
@given(
    sequences=batches,
    pad=st.integers(0, 5),
    tp_size=st.sampled_from([1, 2]),
    cp_size=st.sampled_from([1, 2, 4]),
    dtype=st.sampled_from([torch.int64, torch.int32]),
    forced=st.integers(0, 6),
)
def test_rows_and_mask_equal_the_oracle(context, sequences, pad, tp_size, cp_size, dtype, forced):
    context(tp_size, cp_size)
    longest = max(map(len, sequences))
    ids = nested(sequences, dtype)
    expected_rows, expected_mask = oracle(sequences, pad, aligned(longest, tp_size, cp_size))
    for build in (
        vlm_masks.build_vlm_attn_mask_thd,
        lambda x, p: vlm_masks.build_vlm_attn_mask_bshd(x, len(sequences), p),
    ):
        rows, mask = build(ids, pad)
        assert rows.dtype == dtype and mask.dtype == torch.bool
        assert rows.tolist() == expected_rows and mask.tolist() == expected_mask
    rows, mask = vlm_masks.build_vlm_attn_mask_thd_unaligned(ids, pad)
    assert (rows.tolist(), mask.tolist()) == oracle(sequences, pad, longest)
    forced_max_seqlen = longest + forced
    rows, mask = vlm_masks.build_vlm_attn_mask_bshd(ids, len(sequences), pad, forced_max_seqlen=forced_max_seqlen)
    assert (rows.tolist(), mask.tolist()) == oracle(sequences, pad, aligned(forced_max_seqlen, tp_size, cp_size))


def test_trailing_dimensions_are_padded_and_masked_like_verls(context):
    """``[B, j, k]`` ids give ``[B, S, k]`` rows and a mask of that shape too (verl builds it ``zeros_like`` the rows)."""
    rows, mask = vlm_masks.build_vlm_attn_mask_thd(nested([[1, 2, 3], [4]], trailing=2), 9)
    assert rows.tolist() == [[[1, 2], [2, 4], [3, 6]], [[4, 8], [9, 9], [9, 9]]]
    assert mask.tolist() == [[[True, True]] * 3, [[True, True], [False, False], [False, False]]]


def test_a_view_with_holes_is_read_by_its_real_lengths(context):
    base = nested([[1, 2, 3, 4], [5, 6, 7]])
    view = torch.nested.narrow(
        base.values().view(1, 7).expand(2, 7).contiguous(),
        1,
        torch.tensor([0, 4]),
        torch.tensor([2, 3]),
        layout=torch.jagged,
    )
    rows, mask = vlm_masks.build_vlm_attn_mask_thd(view, 0)
    assert rows.tolist() == [[1, 2, 0], [5, 6, 7]] and mask.sum().item() == 5


@pytest.mark.parametrize(
    "call, error, message",
    [
        (
            lambda ids: vlm_masks.build_vlm_attn_mask_thd(ids, None),
            TypeError,
            "pad_token_id must be the tokenizer's pad token id, got None",
        ),
        (
            lambda ids: vlm_masks.build_vlm_attn_mask_thd(ids, 1.5),
            TypeError,
            "pad_token_id must be an int token id, got float",
        ),
        (lambda ids: vlm_masks.build_vlm_attn_mask_thd(ids, True), TypeError, "pad_token_id must be an int"),
        (
            lambda ids: vlm_masks.build_vlm_attn_mask_thd(ids.to(torch.int8), 300),
            ValueError,
            "pad_token_id=300 does not fit",
        ),
        (
            lambda ids: vlm_masks.build_vlm_attn_mask_thd(ids, 2**53 + 1),
            ValueError,
            r"pad_token_id=9007199254740993 is beyond 2\*\*53",
        ),
        (
            lambda ids: vlm_masks.build_vlm_attn_mask_thd(torch.ones(2, 3), 0),
            TypeError,
            "input_ids must be a jagged nested tensor",
        ),
        (
            lambda ids: vlm_masks.build_vlm_attn_mask_bshd(ids, 3, 0),
            ValueError,
            r"batch_size \(3\) must equal the number of sequences",
        ),
        (lambda ids: vlm_masks.build_vlm_attn_mask_bshd(ids, 2.0, 0), TypeError, "batch_size must be an int"),
        (
            lambda ids: vlm_masks.build_vlm_attn_mask_bshd(ids, 2, 0, forced_max_seqlen=2),
            ValueError,
            "every sequence must fit the rows of 2 tokens",
        ),
        (
            lambda ids: vlm_masks.build_vlm_attn_mask_bshd(ids, 2, 0, forced_max_seqlen=-1),
            ValueError,
            "forced_max_seqlen must be >= 0",
        ),
        (
            lambda ids: vlm_masks.build_vlm_attn_mask_bshd(ids, 2, 0, forced_max_seqlen="5"),
            TypeError,
            "forced_max_seqlen must be an int",
        ),
    ],
)
def test_bad_input_is_a_clear_error_naming_the_argument(context, call, error, message):
    """verl would raise an unrelated TypeError for a missing pad id, cut sequences for a short ``forced_max_seqlen``
    and ignore ``batch_size``; each is refused here, naming the argument."""
    with pytest.raises(error, match=message):
        call(nested([[1, 2, 3], [4]]))


def _batch(batch_size: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(batch_size)
    lengths = torch.randint(1, 30, (batch_size,), generator=generator).tolist()
    return nested([torch.randint(1, 100, (n,), generator=generator).tolist() for n in lengths])


def _cost(call) -> tuple[dict[str, int], int]:
    with HostReadCounter() as reads, OpCounter() as counter:
        call()
    return ops_without_fills(dict(counter.ops), 0), counter.syncs() + reads.calls


@pytest.mark.parametrize("cp_size", [1, 2])
def test_ops_are_flat_in_the_batch_size_and_the_only_sync_is_the_longest_sequence(context, cp_size):
    """The same ATen ops at B=4 and B=256; one host read (the longest sequence) when nothing is known yet, none
    after ``preprocess_thd_engine`` planned the same batch (as in verl's forward) or with ``forced_max_seqlen``."""
    context(1, cp_size)
    costs = {}
    for batch_size in (4, 256):
        ids = _batch(batch_size)
        dropins.clear_plan_caches()
        alone = _cost(lambda: vlm_masks.build_vlm_attn_mask_thd(ids, 0))
        dropins.clear_plan_caches()
        dropins.preprocess_thd_engine(ids)
        after_plan = _cost(lambda: vlm_masks.build_vlm_attn_mask_thd(ids, 0))
        forced = _cost(lambda: vlm_masks.build_vlm_attn_mask_bshd(ids, batch_size, 0, forced_max_seqlen=40))
        costs[batch_size] = (alone, after_plan, forced)
    assert (
        costs[4][0][0] == costs[256][0][0] and costs[4][1][0] == costs[256][1][0] and costs[4][2][0] == costs[256][2][0]
    )
    for alone, after_plan, forced in costs.values():
        assert (alone[1], after_plan[1], forced[1]) == (1, 0, 0)
