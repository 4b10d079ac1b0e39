"""Where verl is wrong (docs/design.md, "Intended differences"), the drop-ins are right: checked against the slow
pure-Python oracle.

Integer 0/1 attention masks, short sequences under CP, FP8 (and MXFP8) padding under CP, ``need_roll`` at the end
of a sequence, dtype of nested CP outputs, multi-dimensional trailing dims, stream lengths that verl would leave
unaligned (``min_local_rows`` / ``pad_to_length_bucket``), and clear errors for bad input.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests import oracle

pytest.importorskip("megatron.core")


def _expected_local(
    mask: list[list[int]], x: torch.Tensor, slot: int, stream: int, cp: int, rank: int, min_total: int = 0
):
    """Oracle: this rank's packed rows of ``x`` [B, S, *] (zeros at padding) and the padded offsets."""
    lengths = [sum(row) for row in mask]
    padded = oracle.padded_lengths(lengths, slot, stream, min_total)
    cu = oracle.offsets(padded)
    rows = oracle.stream_of_rows(mask, padded)
    index = oracle.local_indices("zigzag", cu, cp, rank)
    zero = torch.zeros_like(x[0, 0])
    return torch.stack([zero if rows[p] is None else x[rows[p]] for p in index]).unsqueeze(0), cu


def _rolled_expected(mask: list[list[int]], x: torch.Tensor, slot: int, cp: int, rank: int) -> torch.Tensor:
    """Oracle for need_roll: each real token's successor in its own sequence, the first token after the last."""
    lengths = [sum(row) for row in mask]
    padded = oracle.padded_lengths(lengths, slot, slot)
    rows = oracle.stream_of_rows(mask, padded)
    index = oracle.local_indices("zigzag", oracle.offsets(padded), cp, rank)
    successor = {}
    for row_index, row in enumerate(mask):
        columns = [c for c, value in enumerate(row) if value]
        for k, column in enumerate(columns):
            successor[(row_index, column)] = (row_index, columns[(k + 1) % len(columns)])
    zero = torch.zeros_like(x[0, 0])
    return torch.stack([zero if rows[p] is None else x[successor[rows[p]]] for p in index]).unsqueeze(0)


# left-padded prompts / right-padded responses with 1-, 2- and 3-token sequences
SHORT_MASK = [
    [0, 0, 0, 1, 0, 0, 0],
    [0, 0, 1, 1, 0, 0, 0],
    [0, 1, 1, 1, 1, 1, 0],
    [0, 0, 0, 1, 1, 1, 0],
    [1, 1, 1, 1, 1, 1, 1],
]


def fixes_checks(cp: int, rank: int) -> list[str]:
    """Run inside an initialised megatron parallel state with TP=1 and CP=cp; returns failure descriptions."""
    from verl_cppack.integrations import verl as ours

    failures = []

    def check(name: str, ok: bool) -> None:
        if not ok:
            failures.append(f"cp={cp} rank={rank}: {name}")

    bool_mask = torch.tensor(SHORT_MASK, dtype=torch.bool)
    generator = torch.Generator().manual_seed(5)
    x = torch.randint(1, 100, (*bool_mask.shape, 2, 3), generator=generator)  # [B, S, 2, 3] trailing dims

    # short sequences under CP: exact zigzag layout, zeros at padding
    slot = 2 * cp if cp > 1 else 1  # verl's alignment with TP=1
    packed, params = ours.preprocess_packed_seqs(x, bool_mask)
    expected, cu = _expected_local(SHORT_MASK, x, slot, slot, cp, rank)
    check("short sequences: packed rows", torch.equal(packed, expected))
    check("short sequences: cu_seqlens_padded", params.cu_seqlens_q_padded.tolist() == cu)

    # integer 0/1 masks select the same tokens as the bool mask (verl would index positions 0 and 1)
    for dtype in (torch.int64, torch.int32, torch.uint8):
        packed_int, _ = ours.preprocess_packed_seqs(x, bool_mask.to(dtype))
        check(f"integer mask {dtype}: packed rows", torch.equal(packed_int, expected))
        back = ours.postprocess_packed_seqs(packed_int, _, bool_mask.to(dtype), *bool_mask.shape)
        check(f"integer mask {dtype}: gather-back", torch.equal(back, x * bool_mask[..., None, None]))

    # FP8 under CP: slots to lcm(16, 2*cp), the stream to 2*cp*128
    packed_fp8, params_fp8 = ours.preprocess_packed_seqs(x, bool_mask, use_fp8_padding=True)
    expected_fp8, cu_fp8 = _expected_local(SHORT_MASK, x, math.lcm(16, slot), slot * 128, cp, rank)
    check("fp8: packed rows", torch.equal(packed_fp8, expected_fp8))
    check("fp8: cu_seqlens_padded", params_fp8.cu_seqlens_q_padded.tolist() == cu_fp8)
    back = ours.postprocess_packed_seqs(packed_fp8.float(), params_fp8, bool_mask, *bool_mask.shape)
    check("fp8: gather-back", torch.equal(back, (x * bool_mask[..., None, None]).float()))

    # MXFP8 (verl's fp8_recipe="mxfp8") under CP: slots to lcm(32, 2*cp), the stream to 2*cp*128, exact round trip
    packed_mx, params_mx = ours.preprocess_packed_seqs(x, bool_mask, use_fp8_padding=True, fp8_recipe="mxfp8")
    expected_mx, cu_mx = _expected_local(SHORT_MASK, x, math.lcm(32, slot), slot * 128, cp, rank)
    check("mxfp8: packed rows", torch.equal(packed_mx, expected_mx))
    check("mxfp8: cu_seqlens_padded", params_mx.cu_seqlens_q_padded.tolist() == cu_mx)
    back = ours.postprocess_packed_seqs(packed_mx.float(), params_mx, bool_mask, *bool_mask.shape)
    check("mxfp8: gather-back", torch.equal(back, (x * bool_mask[..., None, None]).float()))

    # nested engine path: need_roll wraps inside each sequence, dtypes kept through the gather-back
    nested = torch.nested.nested_tensor([row[keep] for row, keep in zip(x, bool_mask)], layout=torch.jagged)
    local_mx, params_thd_mx, _ = ours.preprocess_thd_engine(nested, use_fp8_padding=True, fp8_recipe="mxfp8")
    check("mxfp8 nested: cu_seqlens_padded", params_thd_mx.cu_seqlens_q_padded.tolist() == cu_mx)
    back = ours.postprocess_thd_engine(local_mx, params_thd_mx, nested, nested.size(0))
    check("mxfp8 nested: round trip", torch.equal(back.values(), nested.values()))
    rolled, _, _ = ours.preprocess_thd_engine(nested, need_roll=True)
    check(
        "need_roll: successor inside the sequence", torch.equal(rolled, _rolled_expected(SHORT_MASK, x, slot, cp, rank))
    )
    local, params_thd, _ = ours.preprocess_thd_engine(nested)
    for dtype in (torch.bfloat16, torch.float16, torch.int64, torch.uint8):
        out = ours.postprocess_thd_engine(local.to(dtype), params_thd, nested, nested.size(0))
        check(
            f"nested gather-back keeps {dtype}",
            out.dtype == dtype and torch.equal(out.values(), nested.values().to(dtype)),
        )

    # stream lengths verl leaves unaligned: we round up to the next aligned length
    for option in ({"min_local_rows": 3}, {"pad_to_length_bucket": 6}):
        local_rows, params_odd, _ = ours.preprocess_thd_engine(nested, **option)
        total = params_odd.cu_seqlens_q_padded[-1].item()
        offsets = params_odd.cu_seqlens_q_padded.tolist()
        slots_ok = all(b - a >= 0 and (b - a) % (2 * cp) == 0 for a, b in zip(offsets, offsets[1:]))
        check(f"{option}: every slot divisible by 2*cp", slots_ok or cp == 1)
        if "min_local_rows" in option:
            check(f"{option}: at least cp*min_local_rows rows", total >= cp * 3)
        else:
            check(f"{option}: stream a multiple of the bucket", total % 6 == 0)
        out = ours.postprocess_thd_engine(local_rows, params_odd, nested, nested.size(0))
        check(f"{option}: exact round trip", torch.equal(out.values(), nested.values()))

    # BSHD engine round trip with trailing dims, all dtypes
    rows, attention, _ = ours.preprocess_bshd_engine(nested)
    out = ours.postprocess_bshd_engine(rows, attention)
    check("bshd engine round trip", torch.equal(out.values(), nested.values()))

    # the verl 0.7 names: 3-tuple, same as the engine
    three = ours.preprocess_thd_no_padding(nested)
    check("preprocess_thd_no_padding returns 3 items", len(three) == 3 and torch.equal(three[0], local))
    back = ours.postprocess_thd_no_padding(three[0], three[1], nested, 5)
    check("postprocess_thd_no_padding", torch.equal(back.values(), nested.values()))
    rows_07, mask_07, _ = ours.preprocess_bshd_no_padding(nested)
    check(
        "bshd_no_padding round trip",
        torch.equal(ours.postprocess_bshd_no_padding(rows_07, mask_07).values(), nested.values()),
    )

    # errors, raised before any work
    expectations = [
        (TypeError, lambda: ours.preprocess_packed_seqs(x, bool_mask.float())),
        (ValueError, lambda: ours.preprocess_packed_seqs(x, torch.zeros_like(bool_mask))),
        (ValueError, lambda: ours.preprocess_packed_seqs(x, bool_mask.long() * 2)),
        (ValueError, lambda: ours.preprocess_thd_engine(nested, cp_layout="ring")),
        (ValueError, lambda: ours.preprocess_thd_engine(nested, pad_to_length_bucket=0)),
        (TypeError, lambda: ours.preprocess_thd_engine(x)),
        (ValueError, lambda: ours.postprocess_packed_seqs(packed, params_fp8, bool_mask, *bool_mask.shape)),
        (ValueError, lambda: ours.postprocess_thd_engine(local, params_thd, nested, 4)),
    ]
    if cp <= 2:  # the aligned row length stays below the longest sequence (7 tokens)
        expectations.append((ValueError, lambda: ours.preprocess_bshd_engine(nested, forced_max_seqlen=2)))
    if cp > 1:  # megatron-core 0.16.1 has no PackedSeqParams.cp_partition_mode
        expectations.append((ValueError, lambda: ours.preprocess_thd_engine(nested, cp_layout="contiguous")))
        expectations.append((ValueError, lambda: ours.preprocess_bshd(x, bool_mask, bool_mask.long())))
    for index, (error, call) in enumerate(expectations):
        try:
            call()
            failures.append(f"cp={cp} rank={rank}: error case {index} raised nothing")
        except error:
            pass
        except Exception as other:  # noqa: BLE001 - report the wrong kind
            failures.append(f"cp={cp} rank={rank}: error case {index} raised {type(other).__name__}: {other}")

    if cp == 1:  # the defect is real: verl 0.9.1 indexes positions 0/1 with an integer mask
        import verl.models.mcore.util as verl_util

        full_rows = torch.ones(2, 4, dtype=torch.long)  # rows without padding: verl does not even crash
        ids = torch.arange(8).view(2, 4) + 1
        check(
            "verl itself misreads integer masks",
            not torch.equal(
                verl_util.preprocess_packed_seqs(ids, full_rows)[0],
                verl_util.preprocess_packed_seqs(ids, full_rows.bool())[0],
            ),
        )
        check("ours reads them right", torch.equal(ours.preprocess_packed_seqs(ids, full_rows)[0], ids.view(1, 8)))
    return failures


@pytest.mark.slow  # reads test_verl_equality's gloo worlds (verl and Megatron imported in every rank)
@pytest.mark.parametrize("name", ["cp1", "cp2", pytest.param("cp4", marks=pytest.mark.slow)])
def test_dropins_are_right_where_verl_is_wrong(name):
    from tests.test_verl_equality import world

    failures = [failure for result in world(name) for failure in result["fixes"]]
    assert not failures, "\n".join(failures)
