"""Specification of pack_documents: documents cut at EOD / PAD, in-document labels and MTP targets, alignment."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verl_cppack import ParallelContext
from verl_cppack.core.alignment import Alignment
from verl_cppack.packing.documents import PackedDocuments, pack_documents

PAD, EOD = 0, 1
LETTERS = {letter: 10 + index for index, letter in enumerate("abcdefghij")}
NAMES = {PAD: "P", EOD: "E", **{token: letter for letter, token in LETTERS.items()}}


def ids(text: str) -> list[int]:
    """'abcE_' -> token ids; '_' is PAD, 'E' is EOD."""
    return [PAD if c == "_" else EOD if c == "E" else LETTERS[c] for c in text]


def names(tensor: torch.Tensor) -> str:
    return " ".join(NAMES[t] for t in tensor.reshape(-1).tolist())


def bits(tensor: torch.Tensor) -> str:
    return "".join(str(int(v)) for v in tensor.reshape(-1).tolist())


def pack_all_ranks(tokens: torch.Tensor, cp_size: int, tp_size: int = 1, **kwargs) -> list[PackedDocuments]:
    return [
        pack_documents(
            tokens, eod_id=EOD, pad_id=PAD, ctx=ParallelContext(tp_size=tp_size, cp_size=cp_size, cp_rank=r), **kwargs
        )
        for r in range(cp_size)
    ]


WORKED = torch.tensor([ids("abcEdeE_"), ids("fghijE__")])


# ----------------------------------------------------------------------------- the worked example (docs/design.md)
def test_worked_example_cp2_zigzag_matches_design_section_5():
    rank0, rank1 = pack_all_ranks(WORKED, cp_size=2)
    for docs in (rank0, rank1):
        assert docs.cu_seqlens.tolist() == [0, 4, 7, 13] and docs.cu_seqlens.dtype == torch.int32
        assert docs.cu_seqlens_padded.tolist() == [0, 4, 8, 16] and docs.cu_seqlens_padded.dtype == torch.int32
        assert docs.max_seqlen_padded == 8 and docs.max_seqlen == 6 and docs.num_documents == 3
    # rank0 holds stream positions [0,3,4,7,8,9,14,15], rank1 [1,2,5,6,10,11,12,13]
    assert names(rank0.tokens) == "a E d P f g P P"
    assert names(rank1.tokens) == "b c e E h i j E"
    assert bits(rank0.valid_mask) == "11101100" and bits(rank1.valid_mask) == "11111111"
    assert int(rank0.valid_mask.sum()) + int(rank1.valid_mask.sum()) == 13
    # labels: the next token of the same document; the last token of every document is masked
    assert names(rank0.labels) == "b P e P g h P P"
    assert bits(rank0.loss_mask) == "10101100"
    assert names(rank1.labels) == "c E E P i j E P"
    assert bits(rank1.loss_mask) == "11101110"
    # positions restart in every document (offset in the slot at padding)
    assert rank0.position_ids.tolist() == [[0, 3, 0, 3, 0, 1, 6, 7]]
    assert rank1.position_ids.tolist() == [[1, 2, 1, 2, 2, 3, 4, 5]]
    assert rank0.document_ids.tolist() == [[0, 0, 1, 1, 2, 2, 2, 2]]
    assert all(t.shape == (1, 8) for t in (rank0.tokens, rank0.labels, rank0.loss_mask, rank0.position_ids))


def test_worked_example_cp1_is_the_whole_unsliced_stream():
    # CP=1, TP=1, verl's default alignment (TP=1): no padding at all.
    (docs,) = pack_all_ranks(WORKED, cp_size=1)
    assert docs.cu_seqlens.tolist() == [0, 4, 7, 13] and docs.cu_seqlens_padded.tolist() == [0, 4, 7, 13]
    assert names(docs.tokens) == "a b c E d e E f g h i j E"
    assert names(docs.labels) == "b c E P e E P g h i j E P"
    assert bits(docs.loss_mask) == "1110110111110"
    assert docs.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3, 4, 5]]
    assert bits(docs.valid_mask) == "1" * 13
    # with the example's alignment of 4: the whole [1, 16] stream of the worked example
    (docs,) = pack_all_ranks(WORKED, cp_size=1, alignment=4)
    assert docs.cu_seqlens_padded.tolist() == [0, 4, 8, 16] and docs.max_seqlen_padded == 8
    assert names(docs.tokens) == "a b c E d e E P f g h i j E P P"
    assert bits(docs.valid_mask) == "1111111011111100"
    assert names(docs.labels) == "b c E P e E P P g h i j E P P P"
    assert bits(docs.loss_mask) == "1110110011111000"
    assert docs.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7]]


def test_worked_example_contiguous_layout():
    # default for contiguous: only the stream total is padded (to TP*CP*2 = 4), folded into the last slot
    rank0, rank1 = pack_all_ranks(WORKED, cp_size=2, layout="contiguous")
    assert rank0.cu_seqlens.tolist() == [0, 4, 7, 13] and rank0.cu_seqlens_padded.tolist() == [0, 4, 7, 16]
    assert names(rank0.tokens) == "a b c E d e E f" and names(rank1.tokens) == "g h i j E P P P"
    assert names(rank0.labels) == "b c E P e E P g" and bits(rank0.loss_mask) == "11101101"
    assert names(rank1.labels) == "h i j E P P P P" and bits(rank1.loss_mask) == "11110000"
    assert rank1.position_ids.tolist() == [[1, 2, 3, 4, 5, 6, 7, 8]]
    # with per-document alignment 4 it is the worked example's stream cut in halves: rank0 [0..7], rank1 [8..15]
    rank0, rank1 = pack_all_ranks(WORKED, cp_size=2, layout="contiguous", alignment=4)
    assert rank0.cu_seqlens_padded.tolist() == [0, 4, 8, 16]
    assert names(rank0.tokens) == "a b c E d e E P" and names(rank1.tokens) == "f g h i j E P P"
    assert bits(rank0.valid_mask) == "11111110" and bits(rank1.valid_mask) == "11111100"


def test_worked_example_mtp_targets():
    (docs,) = pack_all_ranks(WORKED, cp_size=1, mtp_depth=2)
    assert docs.mtp_depth == 2
    # depth 1 predicts t+2, depth 2 predicts t+3, never past the document's end
    assert names(docs.mtp_labels[0]) == "c E P P E P P h i j E P P"
    assert bits(docs.mtp_loss_masks[0]) == "1100100111100"
    assert names(docs.mtp_labels[1]) == "E P P P P P P i j E P P P"
    assert bits(docs.mtp_loss_masks[1]) == "1000000111000"
    rank0, rank1 = pack_all_ranks(WORKED, cp_size=2, mtp_depth=1)
    assert names(rank0.mtp_labels[0]) == "c P E P h i P P" and names(rank1.mtp_labels[0]) == "E P P P j E P P"


# ----------------------------------------------------------------------------- corner cases (EOD and PAD anywhere)
@pytest.mark.parametrize(
    "rows, documents",
    [
        (["abcdefgh"], ["abcdefgh"]),  # a document filling the whole row, no EOD
        (["abcdefgE"], ["abcdefgE"]),  # a document filling the whole row, ending exactly at EOD
        (["abEcd___", "efgE____"], ["abE", "cd", "efgE"]),  # last document of a row without EOD
        (["abEcdE", "efgh_E"], ["abE", "cdE", "efgh", "E"]),  # row ending exactly at EOD; pad before an EOD
        (["abc_____", "________", "deE_____"], ["abc", "deE"]),  # an all-pad row
        (["ab__cdE_", "__efE__g"], ["ab", "cdE", "efE", "g"]),  # padding in the middle of a row (SFT data)
        (["EEaE", "E_E_"], ["E", "E", "aE", "E", "E"]),  # single-token documents
    ],
)
@pytest.mark.parametrize("cp_size", [1, 2, 4])
def test_corner_cases_cut_documents_and_labels_exactly(rows, documents, cp_size):
    width = max(len(r) for r in rows)
    tokens = torch.tensor([ids(r.ljust(width, "_")) for r in rows])
    lengths = [len(d) for d in documents]
    ranks = pack_all_ranks(tokens, cp_size=cp_size)
    expected_cu = [sum(lengths[:i]) for i in range(len(lengths) + 1)]
    for docs in ranks:
        assert docs.cu_seqlens.tolist() == expected_cu
        slots = docs.cu_seqlens_padded.diff()
        assert (slots >= docs.cu_seqlens.diff()).all()
        if cp_size > 1:  # zigzag: every document slot a multiple of 2*CP, even documents shorter than 2*CP
            assert (slots % (2 * cp_size) == 0).all()
    # the stream, restored from all ranks, reads document after document; labels stay inside
    stream_tokens = restore_stream([d.tokens for d in ranks], ranks[0])
    stream_labels = restore_stream([d.labels for d in ranks], ranks[0])
    stream_mask = restore_stream([d.loss_mask for d in ranks], ranks[0])
    starts = ranks[0].cu_seqlens_padded.tolist()
    for index, document in enumerate(documents):
        start = starts[index]
        assert names(stream_tokens[start : start + len(document)]) == " ".join("P" if c == "_" else c for c in document)
        expected_labels = " ".join(list(document[1:]) + ["P"])
        assert names(stream_labels[start : start + len(document)]) == expected_labels
        assert bits(stream_mask[start : start + len(document)]) == "1" * (len(document) - 1) + "0"
        assert bits(stream_mask[start + len(document) : starts[index + 1]]) == "0" * (
            starts[index + 1] - start - len(document)
        )


def restore_stream(local_tensors: list[torch.Tensor], docs: PackedDocuments) -> torch.Tensor:
    """Put every rank's [1, T_local] tensor back at its global stream position (test helper: uses local_index)."""
    cp_size = len(local_tensors)
    stream = torch.zeros(docs.plan.total_length, dtype=local_tensors[0].dtype)
    for rank, local in enumerate(local_tensors):
        index = pack_documents_index(docs, cp_size, rank)
        stream[index] = local.reshape(-1)
    return stream


def pack_documents_index(docs: PackedDocuments, cp_size: int, rank: int) -> torch.Tensor:
    from verl_cppack.core.layouts import get_layout

    partition = get_layout(docs.plan.layout.name).partition(docs.cu_seqlens_padded, cp_size)
    return partition[rank]


def test_documents_shorter_than_2cp_are_padded_per_document():
    tokens = torch.tensor([ids("aEbEcdE_")])  # documents of length 2, 2, 3 with CP=4 -> slots of 8
    ranks = pack_all_ranks(tokens, cp_size=4)
    assert ranks[0].cu_seqlens_padded.tolist() == [0, 8, 16, 24]
    assert sum(int(d.valid_mask.sum()) for d in ranks) == 7
    assert sum(int(d.loss_mask.sum()) for d in ranks) == 4


def test_fp8_alignment_and_tp():
    rank0, _ = pack_all_ranks(WORKED, cp_size=2, fp8=True)
    slots = rank0.cu_seqlens_padded.diff()
    assert (slots % 16 == 0).all() and int(rank0.cu_seqlens_padded[-1]) % (4 * 128) == 0
    rank0, _ = pack_all_ranks(WORKED, cp_size=2, tp_size=2)
    assert (rank0.cu_seqlens_padded.diff() % 8 == 0).all()
    contiguous0, _ = pack_all_ranks(WORKED, cp_size=2, layout="contiguous", fp8=True)
    assert contiguous0.cu_seqlens_padded.tolist() == [0, 4, 7, 512]


def test_other_tensors_pack_and_outputs_unpack_to_the_token_batch():
    ranks = pack_all_ranks(WORKED, cp_size=2)
    weights = torch.arange(16, dtype=torch.float64).view(2, 8) + 0.5
    local = [d.pack(weights) for d in ranks]
    restored = ranks[0].plan.restore(local)  # [B, S], zero at PAD
    assert torch.equal(restored, torch.where(WORKED != PAD, weights, 0))
    assert ranks[0].plan.restore([d.tokens for d in ranks]).tolist() == WORKED.tolist()


# ----------------------------------------------------------------------------- bad input
def test_bad_input_is_rejected_with_a_clear_error():
    with pytest.raises(ValueError, match="zero valid tokens"):
        pack_documents(torch.zeros(2, 4, dtype=torch.long), eod_id=EOD, pad_id=PAD)
    with pytest.raises(ValueError, match="eod_id and pad_id"):
        pack_documents(WORKED, eod_id=0, pad_id=0)
    with pytest.raises(TypeError, match="tokens must be an integer tensor"):
        pack_documents(WORKED.float(), eod_id=EOD, pad_id=PAD)
    with pytest.raises(ValueError, match=r"\[B, S\]"):
        pack_documents(WORKED.view(-1), eod_id=EOD, pad_id=PAD)
    with pytest.raises(TypeError, match="eod_id must be an int"):
        pack_documents(WORKED, eod_id=1.0, pad_id=PAD)
    with pytest.raises(ValueError, match="mtp_depth"):
        pack_documents(WORKED, eod_id=EOD, pad_id=PAD, mtp_depth=-1)
    with pytest.raises(ValueError, match="not both"):
        pack_documents(WORKED, eod_id=EOD, pad_id=PAD, fp8=True, alignment=4)
    with pytest.raises(ValueError, match="slot_multiple"):
        pack_documents(
            WORKED, eod_id=EOD, pad_id=PAD, ctx=ParallelContext(cp_size=2), alignment=Alignment.per_stream(4)
        )
    docs = pack_documents(WORKED, eod_id=EOD, pad_id=PAD)
    with pytest.raises(ValueError, match=r"\[2, 8, \*\]"):
        docs.pack(torch.zeros(2, 7))


# ----------------------------------------------------------------------------- property test against a slow oracle
def oracle_documents(rows: list[list[int]]) -> list[list[tuple[int, int]]]:
    """Slow, obviously-correct document cut: lists of (row, column) per document, in row-major order."""
    documents, current = [], []
    for b, row in enumerate(rows):
        for s, token in enumerate(row):
            if token == PAD:
                if current:
                    documents.append(current)
                current = []
                continue
            current.append((b, s))
            if token == EOD:
                documents.append(current)
                current = []
        if current:
            documents.append(current)
        current = []
    return documents


token_rows = st.integers(1, 4).flatmap(
    lambda b: st.integers(1, 12).flatmap(
        lambda s: st.lists(
            st.lists(st.sampled_from([PAD, PAD, EOD, EOD, 10, 11, 12, 13]), min_size=s, max_size=s),
            min_size=b,
            max_size=b,
        )
    )
)


@settings(max_examples=60, deadline=None)
@given(
    rows=token_rows,
    cp_size=st.sampled_from([1, 2, 4]),
    tp_size=st.sampled_from([1, 2]),
    layout=st.sampled_from(["zigzag", "contiguous"]),
    mtp_depth=st.integers(0, 3),
)
def test_labels_never_cross_a_document_and_follow_the_oracle(rows, cp_size, tp_size, layout, mtp_depth):
    tokens = torch.tensor(rows)
    documents = oracle_documents(rows)
    if not documents:
        with pytest.raises(ValueError, match="zero valid tokens"):
            pack_documents(tokens, eod_id=EOD, pad_id=PAD)
        return
    document_of = {cell: (d, i) for d, cells in enumerate(documents) for i, cell in enumerate(cells)}
    flat = [token for row in rows for token in row]
    width = len(rows[0])
    coordinate = torch.arange(len(flat)).view(tokens.shape)  # identifies the source cell of a packed position
    lengths = [len(d) for d in documents]

    seen = []
    for rank in range(cp_size):
        ctx = ParallelContext(tp_size=tp_size, cp_size=cp_size, cp_rank=rank)
        docs = pack_documents(tokens, eod_id=EOD, pad_id=PAD, ctx=ctx, layout=layout, mtp_depth=mtp_depth)
        assert docs.cu_seqlens.tolist() == [sum(lengths[:i]) for i in range(len(lengths) + 1)]
        assert docs.plan.total_length % (cp_size * tp_size) == 0
        cells = docs.pack(coordinate)[0].tolist()
        targets = [(docs.labels, docs.loss_mask)] + list(zip(docs.mtp_labels, docs.mtp_loss_masks))
        assert len(targets) == 1 + mtp_depth
        for t, valid in enumerate(docs.valid_mask[0].tolist()):
            if not valid:
                assert docs.tokens[0, t] == PAD and not any(mask[0, t] for _, mask in targets)
                continue
            cell = divmod(cells[t], width)
            document, offset = document_of[cell]
            seen.append(cell)
            assert docs.tokens[0, t] == flat[cells[t]]
            assert docs.position_ids[0, t] == offset and docs.document_ids[0, t] == document
            for shift, (labels, mask) in enumerate(targets, start=1):
                if offset + shift < len(documents[document]):
                    b, s = documents[document][offset + shift]
                    assert mask[0, t] and labels[0, t] == rows[b][s]
                else:
                    assert not mask[0, t] and labels[0, t] == PAD
    assert sorted(seen) == sorted(document_of)  # every token packed exactly once over the CP ranks


@pytest.mark.parametrize("cp_size", [1, 2])
def test_tokens_of_any_strides_pack_as_their_contiguous_copy(cp_size):
    """A transposed (non-contiguous) batch packs like the same values laid out contiguously."""
    base = torch.tensor([[1, 5, 7, 2], [3, EOD, PAD, 4], [EOD, 6, PAD, EOD], [2, 2, PAD, 9], [8, EOD, PAD, PAD]])
    tokens = base.t()  # [4, 5], strides (1, 4)
    assert not tokens.is_contiguous()
    for got, want in zip(pack_all_ranks(tokens, cp_size), pack_all_ranks(tokens.contiguous(), cp_size)):
        for name in ("tokens", "labels", "loss_mask", "position_ids", "document_ids", "cu_seqlens_padded"):
            assert torch.equal(getattr(got, name), getattr(want, name)), name
