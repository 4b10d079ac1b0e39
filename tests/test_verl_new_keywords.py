"""What verl is adding, taken and honoured: ``fp8_recipe`` (MXFP8 pads slots to ``lcm(32, base)``) and
``include_total_tokens`` (``PackedSeqParams.total_tokens`` / ``seq_idx``), and the ``PackedSeqParams`` fields of
newer megatron-core (0.17: ``total_tokens``, ``seq_idx``; 0.19: ``tokens_per_sample``, ``pad_between_seqs``), set
whenever the installed class names them.

On the current stack (megatron-core 0.18/0.19) these tests use the installed ``PackedSeqParams``; on the pinned stack
(0.16.1: megatron-core 0.17+ needs Python >= 3.12) stand-ins with those releases' field sets and 0.17's
``__post_init__``. Either way the class's own ``__post_init__`` (which derives ``seq_idx`` from ``total_tokens``) is
the oracle for ``seq_idx``. The
expected ``include_total_tokens`` results for a ``**kwargs`` stand-in are those of the verl pull request's own
tests. The TP/CP context verl reads from megatron is set explicitly (CP ranks without a group: packing needs no
communication).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from tests import oracle
from verl_cppack import ParallelContext
from verl_cppack.integrations import megatron
from verl_cppack.integrations.verl import dropins
from verl_cppack.packing.builders import plan_from_lengths

pytest.importorskip("megatron.core.packed_seq_params")


@pytest.fixture
def context(monkeypatch):
    def use(tp_size: int = 1, cp_size: int = 1, cp_rank: int = 0) -> None:
        ctx = ParallelContext(tp_size, cp_size, cp_rank)
        monkeypatch.setattr(dropins, "megatron_context", lambda local_cp_size=None: ctx)
        dropins.clear_plan_caches()

    use()
    return use


@pytest.fixture
def params_class(monkeypatch):
    import megatron.core.packed_seq_params as module

    return lambda cls: monkeypatch.setattr(module, "PackedSeqParams", cls)


INSTALLED = pytest.importorskip("megatron.core.packed_seq_params").PackedSeqParams
INSTALLED_FIELDS = megatron.packed_seq_params_fields(INSTALLED)


@dataclass
class Megatron017Params:
    """megatron-core 0.17's field set; its ``__post_init__`` as released (``seq_idx`` from ``total_tokens``)."""

    qkv_format: str = None
    cu_seqlens_q: torch.Tensor = None
    cu_seqlens_kv: torch.Tensor = None
    cu_seqlens_q_padded: torch.Tensor = None
    cu_seqlens_kv_padded: torch.Tensor = None
    max_seqlen_q: int = None
    max_seqlen_kv: int = None
    local_cp_size: int = None
    cp_group: object = None
    total_tokens: int = None
    seq_idx: torch.Tensor = None

    def __post_init__(self):
        cu_seqlens = self.cu_seqlens_q_padded if self.cu_seqlens_q_padded is not None else self.cu_seqlens_q
        if isinstance(cu_seqlens, torch.Tensor) and self.total_tokens is not None:
            total = torch.tensor([self.total_tokens], dtype=cu_seqlens.dtype, device=cu_seqlens.device)
            lengths = (torch.cat([cu_seqlens, total])[1:] - torch.cat([cu_seqlens, total])[:-1]).clamp(min=0)
            self.seq_idx = torch.repeat_interleave(torch.arange(lengths.numel()), lengths).to(torch.int32).unsqueeze(0)


@dataclass
class Megatron019Params(Megatron017Params):
    """megatron-core 0.19 adds ``tokens_per_sample`` and ``pad_between_seqs``."""

    tokens_per_sample: int = None
    pad_between_seqs: bool = None


# The classes with megatron-core 0.17's fields (total_tokens, seq_idx) and with 0.19's (tokens_per_sample,
# pad_between_seqs): the installed one where it has them, else the stand-ins.
WITH_TOTAL_TOKENS = INSTALLED if "total_tokens" in INSTALLED_FIELDS else Megatron017Params
WITH_TOKENS_PER_SAMPLE = INSTALLED if "tokens_per_sample" in INSTALLED_FIELDS else Megatron019Params
ONLY_TOTAL_TOKENS = WITH_TOTAL_TOKENS if "tokens_per_sample" not in INSTALLED_FIELDS else Megatron017Params


class KwargsParams:
    """A duck-typed PackedSeqParams taking anything by keyword (verl's tests use such stubs)."""

    def __init__(self, **kwargs):
        self.__dict__.update(kwargs)


# ------------------------------------------------------------------------------------------------ fp8_recipe
MASK = [[0, 1, 1, 1, 0, 0, 0], [1, 1, 0, 0, 0, 0, 0], [0, 0, 1, 1, 1, 1, 1]]


@pytest.mark.parametrize(
    "recipe, block", [("mxfp8", 32), ("blockwise", 16), ("delayed", 16), ("tensorwise", 16), (None, 16)]
)
@pytest.mark.parametrize("tp_size, cp_size", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_fp8_padding_follows_the_recipe(context, recipe, block, tp_size, cp_size):
    """With ``use_fp8_padding``: slots to ``lcm(block, base)`` (32 for MXFP8, else 16), the stream to ``base*128``;
    the packed rows of every CP rank are the oracle's (``preprocess_packed_seqs`` and the nested
    ``preprocess_thd_engine`` / 0.7 ``preprocess_thd_no_padding``)."""
    mask = torch.tensor(MASK, dtype=torch.bool)
    ids = torch.arange(1, mask.numel() + 1).view(mask.shape)
    nested = torch.nested.nested_tensor([row[keep] for row, keep in zip(ids, mask)], layout=torch.jagged)
    base = tp_size * cp_size * 2 if cp_size > 1 else tp_size
    padded = oracle.padded_lengths([sum(row) for row in MASK], math.lcm(block, base), base * 128)
    cu = oracle.offsets(padded)
    rows = oracle.stream_of_rows(MASK, padded)
    for rank in range(cp_size):
        context(tp_size, cp_size, rank)
        index = oracle.local_indices("zigzag", cu, cp_size, rank)
        expected = [0 if rows[p] is None else ids[rows[p]].item() for p in index]
        packed, params = dropins.preprocess_packed_seqs(ids, mask, use_fp8_padding=True, fp8_recipe=recipe)
        assert params.cu_seqlens_q_padded.tolist() == cu and packed[0].tolist() == expected
        for preprocess in (dropins.preprocess_thd_engine, dropins.preprocess_thd_no_padding):
            packed, params, _ = preprocess(nested, use_fp8_padding=True, fp8_recipe=recipe)
            assert params.cu_seqlens_q_padded.tolist() == cu and packed[0].tolist() == expected


def test_fp8_recipe_by_megatrons_enum_and_without_fp8_padding(context):
    from megatron.core.enums import Fp8Recipe

    mask = torch.tensor(MASK, dtype=torch.bool)
    ids = torch.ones(mask.shape, dtype=torch.long)
    by_name = dropins.preprocess_packed_seqs(ids, mask, use_fp8_padding=True, fp8_recipe="mxfp8")[1]
    by_enum = dropins.preprocess_packed_seqs(ids, mask, use_fp8_padding=True, fp8_recipe=Fp8Recipe.mxfp8)[1]
    assert by_name.cu_seqlens_q_padded.tolist() == by_enum.cu_seqlens_q_padded.tolist() == [0, 32, 64, 128]
    plain = dropins.preprocess_packed_seqs(ids, mask, fp8_recipe="mxfp8")[1]  # the recipe pads only with fp8 padding
    assert plain.cu_seqlens_q_padded.tolist() == [0, 3, 5, 10]


def test_a_gather_back_finds_an_mxfp8_stream_it_did_not_make(context):
    """``postprocess_packed_seqs`` given MXFP8 params made elsewhere (a copy without our plan) re-plans them."""
    mask = torch.tensor(MASK, dtype=torch.bool)
    ids = torch.arange(1, mask.numel() + 1).view(mask.shape)
    packed, params = dropins.preprocess_packed_seqs(ids, mask, use_fp8_padding=True, fp8_recipe="mxfp8")
    foreign = KwargsParams(**{k: v for k, v in vars(params).items() if not k.startswith("_")})
    assert torch.equal(dropins.postprocess_packed_seqs(packed, foreign, mask, *mask.shape), ids * mask)


@pytest.mark.parametrize(
    "recipe, error, message",
    [
        ("mxfp4", ValueError, "fp8_recipe must be one of delayed, tensorwise, mxfp8, blockwise, custom"),
        (32, TypeError, "fp8_recipe must be None or a recipe name"),
        (True, TypeError, "fp8_recipe must be None"),
    ],
)
def test_a_bad_fp8_recipe_is_refused_naming_it(context, recipe, error, message):
    mask = torch.tensor(MASK, dtype=torch.bool)
    nested = torch.nested.nested_tensor([torch.ones(3), torch.ones(2)], layout=torch.jagged)
    for call in (
        lambda: dropins.preprocess_packed_seqs(mask.long(), mask, use_fp8_padding=True, fp8_recipe=recipe),
        lambda: dropins.preprocess_thd_engine(nested, fp8_recipe=recipe),
    ):
        with pytest.raises(error, match=message):
            call()


@pytest.mark.parametrize(
    "options, error, message",
    [
        ({"fp8_recipe": ["mxfp8"]}, TypeError, "fp8_recipe must be None or a recipe name"),
        ({"min_local_rows": [3]}, TypeError, "min_local_rows must be an int"),
        ({"min_local_rows": -1}, ValueError, "min_local_rows must be >= 0"),
        ({"pad_to_length_bucket": [64]}, ValueError, "pad_to_length_bucket must be a positive integer"),
        ({"pad_to_length_bucket": True}, ValueError, "pad_to_length_bucket must be a positive integer"),
    ],
)
def test_the_engine_padding_is_kept_per_arguments_and_bad_ones_are_refused_each_time(context, options, error, message):
    """The engine's padding policy is worked out once per arguments; one that cannot be a key (a list) is refused
    with its own error as any other, and a refused call leaves nothing kept."""
    nested = torch.nested.nested_tensor([torch.ones(3), torch.ones(2)], layout=torch.jagged)
    for _ in range(2):
        with pytest.raises(error, match=message):
            dropins.preprocess_thd_engine(nested, **options)
    kept = dropins.preprocess_thd_engine(nested, min_local_rows=8, pad_to_length_bucket=16, fp8_recipe="mxfp8")
    again = dropins.preprocess_thd_engine(nested, min_local_rows=8, pad_to_length_bucket=16, fp8_recipe="mxfp8")
    assert kept[0].shape == again[0].shape == (1, 16)  # 5 tokens, the stream to a multiple of 16 (at least 8)


# ------------------------------------------------------------------------------------------------ total_tokens
def _nested(*rows):
    return torch.nested.nested_tensor([torch.tensor(row) for row in rows], layout=torch.jagged)


def test_include_total_tokens_as_verls_pull_request_tests_it(context, params_class):
    """verl's tests of the keyword (a ``**kwargs`` PackedSeqParams stub): TP=2 — total 6, rows ``[1,2,3,0,4,5]``;
    CP=2 — the global total 8 on both ranks, each its own rows and positions; a 1-token sequence under CP — total 4."""
    params_class(KwargsParams)
    context(tp_size=2)
    packed, params, positions = dropins.preprocess_thd_engine(_nested([1, 2, 3], [4, 5]), include_total_tokens=True)
    assert (
        params.total_tokens == 6
        and packed.tolist() == [[1, 2, 3, 0, 4, 5]]
        and positions.tolist() == [[0, 1, 2, 0, 0, 1]]
    )
    for rank, tokens, expected_positions in ((0, [[1, 2, 0, 0]], [[0, 1, 0, 0]]), (1, [[3, 4, 5, 0]], [[2, 3, 4, 0]])):
        context(cp_size=2, cp_rank=rank)
        packed, params, positions = dropins.preprocess_thd_engine(_nested([1, 2, 3, 4, 5]), include_total_tokens=True)
        assert params.total_tokens == 8 and packed.tolist() == tokens and positions.tolist() == expected_positions
    # rank 1's front chunk is padding, numbered with its slot offset as verl 0.9.1 and main number it
    for rank, tokens, expected_positions in ((0, [[7, 0]], [[0, 0]]), (1, [[0, 0]], [[1, 0]])):
        context(cp_size=2, cp_rank=rank)
        packed, params, positions = dropins.preprocess_thd_engine(_nested([7]), include_total_tokens=True)
        assert params.total_tokens == 4 and packed.tolist() == tokens and positions.tolist() == expected_positions


@pytest.fixture
def post_init_calls(monkeypatch):
    """Counts the ``__post_init__`` runs of a class that derive ``seq_idx`` (a repeat_interleave that syncs on a GPU)."""

    def count(cls: type) -> list[int]:
        calls = []
        original = cls.__post_init__

        def counted(self):
            original(self)
            if self.total_tokens is not None:
                calls.append(1)

        monkeypatch.setattr(cls, "__post_init__", counted)
        return calls

    return count


@pytest.mark.parametrize("cls", sorted({WITH_TOTAL_TOKENS, WITH_TOKENS_PER_SAMPLE}, key=lambda c: c.__qualname__))
@pytest.mark.parametrize("cp_size", [1, 2])
def test_total_tokens_and_seq_idx_are_megatrons_without_its_sync(context, params_class, post_init_calls, cls, cp_size):
    """``total_tokens`` is the global padded stream length and ``seq_idx`` what the class's own ``__post_init__``
    derives from it, yet that derivation never ran on our objects (set after they are made)."""
    params_class(cls)
    context(cp_size=cp_size)
    mask = torch.tensor(MASK, dtype=torch.bool)
    calls = post_init_calls(cls)
    for params in (
        dropins.preprocess_packed_seqs(mask.long(), mask, include_total_tokens=True)[1],
        dropins.preprocess_thd_engine(_nested([1, 2, 3], [4, 5], [6]), include_total_tokens=True, use_fp8_padding=True)[
            1
        ],
    ):
        total = int(params.cu_seqlens_q_padded[-1])
        reference = cls(cu_seqlens_q_padded=params.cu_seqlens_q_padded, total_tokens=total)
        assert params.total_tokens == total
        assert params.seq_idx.dtype == torch.int32 and torch.equal(params.seq_idx, reference.seq_idx)
    assert len(calls) == 2  # the two references only


def test_without_include_total_tokens_the_fields_stay_unset(context, params_class):
    params_class(WITH_TOTAL_TOKENS)
    params = dropins.preprocess_thd_engine(_nested([1, 2, 3], [4, 5]))[1]
    assert params.total_tokens is None and params.seq_idx is None


@pytest.mark.parametrize("cp_size", [1, 2])
def test_pad_between_seqs_and_tokens_per_sample_are_set_when_the_class_names_them(context, params_class, cp_size):
    """0.19's fields: ``pad_between_seqs`` as Transformer Engine would compute it (cu_seqlens_q/kv against the padded
    offsets, all but the last), ``tokens_per_sample`` this rank's row length; 0.17's class gets neither."""
    params_class(WITH_TOKENS_PER_SAMPLE)
    context(cp_size=cp_size)
    params = dropins.preprocess_thd_engine(_nested([1, 2, 3], [4, 5]))[1]
    te_pad_between_seqs = not torch.equal(params.cu_seqlens_q_padded[:-1], params.cu_seqlens_q[:-1])
    assert params.pad_between_seqs is te_pad_between_seqs is False
    assert params.tokens_per_sample == int(params.cu_seqlens_q_padded[-1]) // cp_size
    plan = plan_from_lengths([3, 2], ParallelContext(tp_size=2, cp_size=cp_size))  # slots of 2 or 8: padding
    real = megatron.packed_seq_params(plan, real_seqlens_in_attention=True)  # padding now lies between sequences
    assert real.pad_between_seqs is (not torch.equal(real.cu_seqlens_q_padded[:-1], real.cu_seqlens_q[:-1])) is True
    params_class(ONLY_TOTAL_TOKENS)
    assert not hasattr(dropins.preprocess_thd_engine(_nested([1, 2]))[1], "tokens_per_sample")


def test_include_total_tokens_needs_a_class_that_can_hold_it(context, params_class):
    """A PackedSeqParams without ``total_tokens`` (megatron-core 0.16.1's): refused, naming the keyword and the fix."""
    if "total_tokens" in INSTALLED_FIELDS:
        params_class(megatron.FallbackPackedSeqParams)  # 0.16.1's field set
    mask = torch.tensor(MASK, dtype=torch.bool)
    with pytest.raises(
        ValueError, match=r"include_total_tokens=True needs PackedSeqParams fields total_tokens, seq_idx"
    ):
        dropins.preprocess_packed_seqs(mask.long(), mask, include_total_tokens=True)
    with pytest.raises(TypeError, match="include_total_tokens must be True or False, got str"):
        dropins.preprocess_thd_engine(_nested([1, 2]), include_total_tokens="yes")
