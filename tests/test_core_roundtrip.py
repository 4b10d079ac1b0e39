"""Property: pack on every rank, then restore, is the identity on valid tokens and zero at padding.

Every packed value is also checked against the pure-Python oracle (tests/oracle.py), for random masks
(left / right / middle padding, empty rows), CP in {1,2,3,4,8}, TP in {1,2,4}, FP8 on/off, both layouts,
dtypes int64 / bool / bf16 / fp32 and trailing dims.
"""

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests import oracle
from verl_cppack import ParallelContext, plan_from_lengths, plan_from_mask, plan_from_nested
from verl_cppack.packing.mask_rows import MaskRows

DTYPES = [torch.int64, torch.bool, torch.bfloat16, torch.float32]


@st.composite
def mask_rows(draw, width):
    kind = draw(st.sampled_from(["left", "right", "middle", "scattered", "empty", "full"]))
    if kind == "empty":
        return [0] * width
    if kind == "full":
        return [1] * width
    if kind == "scattered":
        return draw(st.lists(st.integers(0, 1), min_size=width, max_size=width))
    n = draw(st.integers(0, width))
    if kind == "left":
        return [0] * (width - n) + [1] * n
    if kind == "right":
        return [1] * n + [0] * (width - n)
    start = draw(st.integers(0, width - n))
    return [0] * start + [1] * n + [0] * (width - n - start)


@st.composite
def batches(draw):
    width = draw(st.integers(1, 10))
    mask = draw(st.lists(mask_rows(width), min_size=1, max_size=6))
    if not any(any(row) for row in mask):
        mask[draw(st.integers(0, len(mask) - 1))][draw(st.integers(0, width - 1))] = 1
    return mask


def _oracle_alignment(tp_size, cp_size, fp8):
    base = tp_size * cp_size * 2 if cp_size > 1 else tp_size
    return (math.lcm(16, base), base * 128) if fp8 else (base, base)


def _random_values(shape, dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    values = torch.randint(1, 100, shape, generator=generator)
    return values.bool() if dtype == torch.bool else values.to(dtype)


@settings(max_examples=120, deadline=None)
@given(
    mask=batches(),
    cp_size=st.sampled_from([1, 2, 3, 4, 8]),
    tp_size=st.sampled_from([1, 2, 4]),
    fp8=st.booleans(),
    layout=st.sampled_from(["zigzag", "contiguous"]),
    dtype=st.sampled_from(DTYPES),
    trailing=st.sampled_from([(), (1,), (3,), (2, 2)]),
    integer_mask=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_pack_matches_oracle_and_restore_is_identity(
    mask, cp_size, tp_size, fp8, layout, dtype, trailing, integer_mask, seed
):
    batch_size, seq_len = len(mask), len(mask[0])
    mask_tensor = torch.tensor(mask, dtype=torch.long if integer_mask else torch.bool)
    x = _random_values((batch_size, seq_len, *trailing), dtype, seed)

    lengths = [sum(row) for row in mask]
    slot_multiple, stream_multiple = _oracle_alignment(tp_size, cp_size, fp8)
    padded = oracle.padded_lengths(lengths, slot_multiple, stream_multiple)
    cu_padded = oracle.offsets(padded)
    stream = oracle.stream_of_rows(mask, padded)
    zero = torch.zeros(trailing, dtype=dtype)

    locals_ = []
    for rank in range(cp_size):
        ctx = ParallelContext(tp_size=tp_size, cp_size=cp_size, cp_rank=rank)
        plan = plan_from_mask(mask_tensor, ctx, layout=layout, fp8=fp8)
        assert plan.seqlens.tolist() == lengths
        assert plan.cu_seqlens.tolist() == oracle.offsets(lengths)
        assert plan.cu_seqlens_padded.tolist() == cu_padded
        assert plan.max_seqlen_padded == max(padded)
        assert plan.local_length * cp_size == plan.total_length == cu_padded[-1]
        assert plan.local_length % tp_size == 0
        index = oracle.local_indices(layout, cu_padded, cp_size, rank)
        assert plan.local_index.tolist() == index

        packed = plan.pack(x)
        assert packed.shape == (1, len(index), *trailing) and packed.dtype == dtype
        for j, position in enumerate(index):
            source = stream[position]
            assert torch.equal(packed[0, j], zero if source is None else x[source])
            assert bool(plan.local_valid_mask[j]) == (source is not None)
            slot = max(i for i in range(batch_size) if cu_padded[i] <= position < cu_padded[i + 1])
            assert int(plan.local_position_ids[j]) == position - cu_padded[slot]
        locals_.append(packed)

    restored = plan.restore(locals_)
    expected = torch.where(mask_tensor.bool().view(batch_size, seq_len, *[1] * len(trailing)), x, zero)
    assert restored.dtype == dtype
    assert torch.equal(restored, expected)


@settings(max_examples=60, deadline=None)
@given(
    mask=batches(),
    cp_size=st.sampled_from([1, 2, 3, 4]),
    layout=st.sampled_from(["zigzag", "contiguous"]),
    shift=st.integers(1, 3),
    wrap=st.booleans(),
)
def test_shift_takes_the_token_k_later_in_the_same_sequence(mask, cp_size, layout, shift, wrap):
    batch_size, seq_len = len(mask), len(mask[0])
    x = torch.arange(1, batch_size * seq_len + 1).view(batch_size, seq_len)
    lengths = [sum(row) for row in mask]
    padded = oracle.padded_lengths(lengths, *_oracle_alignment(1, cp_size, False))
    cu_padded = oracle.offsets(padded)
    tokens_of_row = [[x[r, c].item() for c in range(seq_len) if mask[r][c]] for r in range(batch_size)]
    for rank in range(cp_size):
        plan = plan_from_mask(torch.tensor(mask).bool(), ParallelContext(cp_size=cp_size, cp_rank=rank), layout=layout)
        targets = plan.pack(x, shift=shift, wrap=wrap)[0].tolist()
        has_target = plan.target_mask(shift, wrap=wrap)[0].tolist()
        for j, position in enumerate(oracle.local_indices(layout, cu_padded, cp_size, rank)):
            row = max(i for i in range(batch_size) if cu_padded[i] <= position < cu_padded[i + 1])
            offset, tokens = position - cu_padded[row], tokens_of_row[row]
            if offset >= len(tokens):
                expected = None
            elif wrap:
                expected = tokens[(offset + shift) % len(tokens)]
            else:
                expected = tokens[offset + shift] if offset + shift < len(tokens) else None
            assert has_target[j] == (expected is not None)
            assert targets[j] == (0 if expected is None else expected)


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 9), min_size=1, max_size=6).filter(any),
    cp_size=st.sampled_from([1, 2, 3, 4, 8]),
    tp_size=st.sampled_from([1, 2]),
    layout=st.sampled_from(["zigzag", "contiguous"]),
    dtype=st.sampled_from(DTYPES),
)
def test_nested_pack_and_restore_round_trip(lengths, cp_size, tp_size, layout, dtype):
    rows = [_random_values((n, 2), dtype, seed=i) for i, n in enumerate(lengths)]
    nested = torch.nested.nested_tensor(rows, layout=torch.jagged)
    plans = [
        plan_from_nested(nested, ParallelContext(tp_size=tp_size, cp_size=cp_size, cp_rank=r), layout=layout)
        for r in range(cp_size)
    ]
    same = plan_from_lengths(lengths, ParallelContext(tp_size=tp_size, cp_size=cp_size), layout=layout)
    assert torch.equal(same.cu_seqlens_padded, plans[0].cu_seqlens_padded)
    restored = plans[0].restore([plan.pack(nested) for plan in plans])
    assert restored.is_nested
    assert [t.shape[0] for t in restored.unbind()] == lengths
    for got, want in zip(restored.unbind(), rows):
        assert got.dtype == dtype and torch.equal(got, want)


@settings(max_examples=80, deadline=None)
@given(mask=batches(), cp_size=st.sampled_from([1, 2, 4]))
def test_stream_source_names_each_token_row_and_distinct_sinks_at_padding(mask, cp_size):
    """The global stream's source rows (any mask, rows with gaps too): the oracle's row and column at every
    token; padding positions get distinct rows past the source."""
    batch_size, seq_len = len(mask), len(mask[0])
    plan = plan_from_mask(torch.tensor(mask, dtype=torch.bool), ParallelContext(cp_size=cp_size))
    slot_multiple, stream_multiple = _oracle_alignment(1, cp_size, False)
    stream = oracle.stream_of_rows(
        mask, oracle.padded_lengths([sum(row) for row in mask], slot_multiple, stream_multiple)
    )
    source = plan.stream_source.tolist()
    assert len(source) == len(stream)
    assert [s for s, where in zip(source, stream) if where] == [r * seq_len + c for r, c in filter(None, stream)]
    sinks = [s for s, where in zip(source, stream) if where is None]
    assert len(set(sinks)) == len(sinks) and all(s >= batch_size * seq_len for s in sinks)


def test_one_plan_serves_every_tensor_of_the_micro_batch():
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 0, 0]])
    plan = plan_from_mask(mask, ParallelContext(cp_size=2, cp_rank=1))
    input_ids = torch.tensor([[0, 5, 6, 7], [8, 9, 0, 0]])
    position_ids = torch.arange(4).repeat(2, 1).unsqueeze(-1).expand(2, 4, 3)  # [B, S, 3] like mrope
    embeddings = torch.randn(2, 4, 5)
    packed = [plan.pack(t) for t in (input_ids, position_ids, embeddings)]
    assert [tuple(p.shape) for p in packed] == [(1, 4), (1, 4, 3), (1, 4, 5)]
    # rank 1 of zigzag CP=2 with slots [4, 4]: positions [1, 2, 5, 6] -> row0 tokens 1,2 (cols 2,3); row1 token 1 (col 1), pad
    assert packed[0].tolist() == [[6, 7, 9, 0]]
    assert torch.equal(packed[2][0, 0], embeddings[0, 2])


@st.composite
def wide_masks(draw):
    """Wide and narrow rows (S up to 8192, odd widths too; where S is a multiple of 8 the compiled build reads 8
    columns at a time), runs that start and end anywhere, gapped, empty and full rows; also a view at a storage offset."""
    seq_len = draw(st.sampled_from([8, 16, 1016, 1024, 2056, 13, 100, 4104, 4099, 8192]))
    rows = []
    for _ in range(draw(st.integers(1, 5))):
        kind = draw(st.sampled_from(["run", "run", "gapped", "empty", "full"]))
        row = [0] * seq_len
        if kind == "full":
            row = [1] * seq_len
        elif kind != "empty":
            start = draw(st.integers(0, seq_len - 1))
            end = draw(st.integers(start + 1, seq_len))
            row[start:end] = [1] * (end - start)
            if kind == "gapped" and end - start >= 3:
                row[draw(st.integers(start + 1, end - 2))] = 0
        rows.append(row)
    if not any(any(row) for row in rows):
        rows[0][0] = 1
    return rows, draw(st.booleans())


@settings(max_examples=80, deadline=None)
@given(case=wide_masks(), cp_size=st.sampled_from([1, 2]))
def test_wide_masks_count_and_pack_like_the_oracle(case, cp_size):
    """The mask scan (count, first and last token per row, by tensor ops: what an accelerator runs) agrees with a
    per-row count, and the plan (a CPU mask's compiled build) packs like the oracle."""
    _check_wide_mask(*case, cp_size)


def _check_wide_mask(mask, offset_view, cp_size):
    batch_size, seq_len = len(mask), len(mask[0])
    mask_tensor = torch.tensor(mask, dtype=torch.bool)
    if offset_view:  # the same rows, but not at the start of their storage
        mask_tensor = torch.cat([torch.zeros(1, seq_len, dtype=torch.bool), mask_tensor])[1:]
    x = torch.arange(batch_size * seq_len).view(batch_size, seq_len)
    lengths = [sum(row) for row in mask]
    counts, first, last = MaskRows(mask_tensor).scan()  # each row's token count, first and last token column
    assert counts.tolist() == lengths
    for row, row_first, row_last in zip(mask, first, last):
        if any(row):
            assert (row_first, row_last) == (row.index(1), seq_len - 1 - row[::-1].index(1))
    slot_multiple, stream_multiple = _oracle_alignment(1, cp_size, False)
    cu_padded = oracle.offsets(oracle.padded_lengths(lengths, slot_multiple, stream_multiple))
    stream = oracle.stream_of_rows(mask, oracle.padded_lengths(lengths, slot_multiple, stream_multiple))
    local_outputs = []
    for rank in range(cp_size):
        plan = plan_from_mask(mask_tensor, ParallelContext(cp_size=cp_size, cp_rank=rank))
        local_outputs.append(plan.pack(x))
        assert plan.seqlens.tolist() == lengths
        index = oracle.local_indices("zigzag", cu_padded, cp_size, rank)
        expected = [0 if stream[p] is None else int(x[stream[p]]) for p in index]
        assert plan.pack(x)[0].tolist() == expected
        assert plan.pack(x, shift=1)[0].tolist() == [
            int(x[stream[p + 1]])
            if stream[p] is not None
            and p + 1 < len(stream)
            and stream[p + 1] is not None
            and stream[p + 1][0] == stream[p][0]
            else 0
            for p in index
        ]
    assert torch.equal(plan.restore(local_outputs), x * mask_tensor)  # back to the rows, zeros at padding


def test_a_plan_does_not_share_memory_with_its_inputs():
    """The host read is a view on the CPU; editing the caller's lengths or mask afterwards must not change a plan."""
    seqlens = torch.tensor([3, 1, 2])
    plan = plan_from_lengths(seqlens)
    seqlens[0] = 7
    assert plan.tables.seqlens.tolist() == [3, 1, 2] and plan.seqlens.tolist() == [3, 1, 2]
    nested = torch.nested.nested_tensor([torch.arange(3), torch.arange(1), torch.arange(2)], layout=torch.jagged)
    assert plan.pack(nested)[0].tolist() == [0, 1, 2, 0, 0, 1]


def test_the_copy_back_never_shares_memory_with_the_local_output():
    """At CP=1 the jagged outputs are copied from the model's output itself (no zero row to add): still a copy, as
    verl's, so editing one never changes the other."""
    nested = torch.nested.nested_tensor([torch.arange(3.0), torch.arange(1.0), torch.arange(2.0)], layout=torch.jagged)
    plan = plan_from_nested(nested)
    local = plan.pack(nested)  # [1, T, *] stands for the model output
    for restored in (plan.unpack(local), plan.unpack_nested(local)):
        assert restored.values().untyped_storage().data_ptr() != local.untyped_storage().data_ptr()
        assert [t.tolist() for t in restored.unbind()] == [[0.0, 1.0, 2.0], [0.0], [0.0, 1.0]]
    mask_plan = plan_from_mask(torch.tensor([[0, 1, 1], [1, 0, 0]]))
    rows = mask_plan.unpack(mask_plan.pack(torch.tensor([[5.0, 6.0, 7.0], [8.0, 9.0, 1.0]])))
    assert rows.tolist() == [[0.0, 6.0, 7.0], [8.0, 0.0, 0.0]]
