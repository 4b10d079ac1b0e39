"""Megatron-Bridge's own packing inside its Qwen3-VL model, replaced (``integrations.megatron_bridge``).

Tested against the bridge's functions as installed (loaded without the package ``__init__``, which needs Transformer
Engine: ``tests/megatron_bridge_modules.py``), on the current stack; skipped where Megatron-Bridge is absent.

- where the bridge's ``preprocess_packed_seqs`` is right, ours returns what it returns (ids, ``[B, S, H]``
  embeddings in float32 and bfloat16, ``[B, S, 3]`` MRoPE ids; TP 1/2, CP 1/2/4, every rank; TP/CP from megatron's
  parallel state or from ``pg_collection``), and equals verl 0.9.1's own ``preprocess_packed_seqs`` always — where
  the bridge's copy raises on a short sequence too;
- on a mask verl's ``build_vlm_attn_mask_thd`` made, ours packs the rows into the stream of the ``PackedSeqParams``
  verl's ``preprocess_thd_engine`` made for the same ids (FP8 padding, length buckets, the contiguous layout): the
  packed ids are the ones verl packed, the embeddings line up with them, the MRoPE ids with verl's positions;
- ``get_packed_seq_cp_partition_indices``: Transformer Engine's zigzag cut (the slow oracle's port) for params made
  elsewhere, the plan's own positions for ours;
- the binding: in the module that defines each function and in ``model.py``, which binds it by name; a copy that
  changed, or another bridge release, stays the bridge's with the reason in ``status()``.
"""

from __future__ import annotations

import types

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests import oracle
from tests.distributed import run_gloo
from tests.megatron_bridge_modules import QWEN3_VL, load
from verl_cppack import ParallelContext
from verl_cppack.integrations import megatron, megatron_bridge
from verl_cppack.integrations.verl import dropins, vlm_masks

bridge_utils = load(f"{QWEN3_VL}.utils")
bridge_seq_utils = load(megatron_bridge.PACKED_SEQ_UTILS)
verl_util = pytest.importorskip("verl.models.mcore.util")

SHAPES = [(1, 1), (1, 2), (2, 1), (1, 4), (2, 2)]  # (TP, CP)


@pytest.fixture(autouse=True)
def bridges_own_functions():
    """The bridge's own functions in its modules while a test runs (the plugin, imported by other tests of this
    process, may have bound ours there), put back as they were after it."""
    was_installed = megatron_bridge.status()["installed"]
    megatron_bridge.uninstall()
    yield
    megatron_bridge.uninstall()
    if was_installed:
        megatron_bridge.install()


class _Group:
    """What the bridge reads of a process group in ``pg_collection``: ``size()`` and ``rank()``."""

    def __init__(self, size: int, rank: int) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


@pytest.fixture
def parallel(monkeypatch):
    """Sets TP/CP/rank for everyone: megatron's getters (the bridge and verl read them) and the drop-ins' context."""
    from megatron.core import parallel_state as mpu

    def use(tp_size: int, cp_size: int, cp_rank: int) -> None:
        ctx = ParallelContext(tp_size, cp_size, cp_rank)
        monkeypatch.setattr(dropins, "megatron_context", lambda local_cp_size=None: ctx)
        monkeypatch.setattr(mpu, "get_tensor_model_parallel_world_size", lambda: tp_size)
        monkeypatch.setattr(mpu, "get_context_parallel_world_size", lambda: cp_size)
        monkeypatch.setattr(mpu, "get_context_parallel_rank", lambda: cp_rank)
        dropins.clear_plan_caches()

    return use


def _inputs(mask: torch.Tensor) -> dict[str, torch.Tensor]:
    batch_size, seq_len = mask.shape
    generator = torch.Generator().manual_seed(batch_size * 100 + seq_len)
    ids = torch.randint(1, 1000, (batch_size, seq_len), generator=generator)
    embeddings = torch.randn(batch_size, seq_len, 5, generator=generator)
    return {
        "ids": ids,
        "embeddings": embeddings,
        "embeddings bf16": embeddings.to(torch.bfloat16),
        "mrope": torch.randint(1, 50, (batch_size, seq_len, 3), generator=generator),
    }


def _bridge_is_right(mask: torch.Tensor, tp_size: int, cp_size: int, cp_rank: int) -> bool:
    """Where the bridge's copy packs correctly: under CP, rank ``r`` copies tokens ``[h*r, h*(r+1))`` of each
    sequence into the first chunk of ``h = P / (2*CP)`` slots (``P`` the padded slot), so each sequence must fill it;
    a shorter one raises (a shape mismatch) or, with one token there, broadcasts it over the chunk — the
    short-sequence defect verl fixed in 0.8 and the copy kept."""
    if cp_size == 1:
        return True
    multiple = tp_size * cp_size * 2
    for n in mask.sum(1).tolist():
        half_chunk = -(-n // multiple) * multiple // (2 * cp_size)
        if max(0, min(n, half_chunk * (cp_rank + 1)) - half_chunk * cp_rank) != half_chunk:
            return False
    return True


masks = st.integers(1, 4).flatmap(
    lambda rows: st.integers(1, 24).flatmap(
        lambda cols: st.lists(st.lists(st.integers(0, 1), min_size=cols, max_size=cols), min_size=rows, max_size=rows)
    )
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mask=masks, shape=st.sampled_from(SHAPES), by_group=st.booleans())
def test_ours_is_the_bridges_where_it_is_right_and_verls_always(parallel, mask, shape, by_group):
    tp_size, cp_size = shape
    mask = torch.tensor(mask, dtype=torch.bool)
    if not mask.any():
        return  # an empty micro-batch: ours refuses it (skip it), the bridge's packs nothing
    for rank in range(cp_size):
        parallel(tp_size, cp_size, rank)
        pg_collection = types.SimpleNamespace(tp=_Group(tp_size, 0), cp=_Group(cp_size, rank)) if by_group else None
        for name, tensor in _inputs(mask).items():
            ours, ours_params = megatron_bridge.preprocess_packed_seqs(tensor, mask, True, pg_collection)
            verls, verls_params = verl_util.preprocess_packed_seqs(tensor, mask, pre_process=True)
            assert ours.dtype == tensor.dtype and torch.equal(ours, verls), name
            for field in ("cu_seqlens_q", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
                assert torch.equal(getattr(ours_params, field), getattr(verls_params, field)), field
            assert ours_params.max_seqlen_q == verls_params.max_seqlen_q
            if _bridge_is_right(mask, tp_size, cp_size, rank):
                bridges, bridges_params = bridge_utils.preprocess_packed_seqs(tensor, mask, True, pg_collection)
                assert torch.equal(ours, bridges), name
                assert torch.equal(ours_params.cu_seqlens_q_padded, bridges_params.cu_seqlens_q_padded)
            else:  # it raises, or puts a token where verl (and we) leave padding
                try:
                    bridges = bridge_utils.preprocess_packed_seqs(tensor, mask, True, pg_collection)[0]
                except RuntimeError:
                    continue
                assert not torch.equal(bridges, verls), name


def test_where_the_bridge_raises_on_a_short_sequence_ours_packs_as_verl(parallel):
    """TP4 CP2, lengths [3, 40]: the bridge's copy cannot cut a 3-token sequence into its zigzag halves."""
    mask = torch.zeros(2, 40, dtype=torch.bool)
    mask[0, :3], mask[1, :] = True, True
    ids = torch.arange(1, 81).view(2, 40)
    for rank in range(2):
        parallel(4, 2, rank)
        if rank == 1:
            with pytest.raises(RuntimeError):
                bridge_utils.preprocess_packed_seqs(ids, mask)
        assert torch.equal(
            megatron_bridge.preprocess_packed_seqs(ids, mask)[0], verl_util.preprocess_packed_seqs(ids, mask)[0]
        )


def test_pre_process_false_returns_the_rows_and_the_params(parallel):
    parallel(1, 2, 0)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)
    ids = torch.arange(8).view(2, 4)
    rows, params = megatron_bridge.preprocess_packed_seqs(ids, mask, pre_process=False)
    assert rows is ids and params.cu_seqlens_q_padded.tolist() == [0, 4, 8]


# ------------------------------------------------------------------------- consistency with verl's PackedSeqParams
POLICIES = [dict(), dict(use_fp8_padding=True), dict(pad_to_length_bucket=64)]
# the contiguous layout where megatron-core's PackedSeqParams can say so (cp_partition_mode; not in 0.16-0.19)
if "cp_partition_mode" in megatron.packed_seq_params_fields(megatron.packed_seq_params_class()):
    POLICIES += [dict(cp_layout="contiguous"), dict(use_fp8_padding=True, cp_layout="contiguous")]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    lengths=st.lists(st.integers(1, 30), min_size=1, max_size=4),
    shape=st.sampled_from(SHAPES),
    policy=st.sampled_from(POLICIES),
)
def test_on_verls_vlm_mask_ours_packs_into_verls_stream(parallel, lengths, shape, policy):
    """verl's engine forward for a vision model: ``preprocess_thd_engine`` makes the params the model gets, then
    ``build_vlm_attn_mask_thd`` the ``[B, S]`` rows and mask the model packs again. Ours packs those rows into the
    params' stream: the ids verl packed, embeddings that are those ids' embeddings, MRoPE ids that are verl's
    positions, and ``get_packed_seq_cp_partition_indices`` the params' own positions."""
    tp_size, cp_size = shape
    if policy.get("cp_layout") == "contiguous" and cp_size == 1:
        return
    nested = torch.nested.nested_tensor(
        [torch.arange(1, n + 1) * 7 + i for i, n in enumerate(lengths)], layout=torch.jagged
    )
    table = torch.randn(1000, 3)
    for rank in range(cp_size):
        parallel(tp_size, cp_size, rank)
        packed, params, positions = dropins.preprocess_thd_engine(nested, **policy)  # [1, T/CP], verl's params
        rows, mask = vlm_masks.build_vlm_attn_mask_thd(nested, pad_token_id=0)  # [B, S]
        valid = packed != 0  # [1, T/CP] (ids are never 0)
        assert torch.equal(megatron_bridge.preprocess_packed_seqs(rows, mask)[0], packed)
        embeddings = megatron_bridge.preprocess_packed_seqs(table[rows], mask)[0]  # [1, T/CP, 3]
        assert torch.equal(embeddings, table[packed] * valid[..., None])
        mrope = torch.arange(rows.shape[1]).expand(3, *rows.shape).permute(1, 2, 0)  # [B, S, 3] text positions
        assert torch.equal(
            megatron_bridge.preprocess_packed_seqs(mrope, mask)[0], (positions * valid)[..., None].expand(-1, -1, 3)
        )
        total = int(params.cu_seqlens_q_padded[-1])
        index = megatron_bridge.cp_partition_indices(
            params, total_tokens=total, cp_size=cp_size, cp_rank=rank, device=torch.device("cpu")
        )
        layout = policy.get("cp_layout", "zigzag")
        assert index.tolist() == oracle.local_indices(layout, params.cu_seqlens_q_padded.tolist(), cp_size, rank)


def test_the_bridges_own_copy_would_pack_fp8_batches_elsewhere(parallel):
    """The issue's case (TP2 CP2, FP8 padding, lengths [40, 104, 64]): verl's params hold [0, 48, 160, 1024], the
    bridge's copy packs into [0, 40, 144, 208]; ours into verl's."""
    lengths = [40, 104, 64]
    nested = torch.nested.nested_tensor([torch.arange(1, n + 1) for n in lengths], layout=torch.jagged)
    parallel(2, 2, 0)
    packed, params, _ = dropins.preprocess_thd_engine(nested, use_fp8_padding=True)
    rows, mask = vlm_masks.build_vlm_attn_mask_thd(nested, pad_token_id=0)
    assert params.cu_seqlens_q_padded.tolist() == [0, 48, 160, 1024]
    assert bridge_utils.preprocess_packed_seqs(rows, mask)[1].cu_seqlens_q_padded.tolist() == [0, 40, 144, 208]
    ours, ours_params = megatron_bridge.preprocess_packed_seqs(rows, mask)
    assert ours_params.cu_seqlens_q_padded.tolist() == [0, 48, 160, 1024] and torch.equal(ours, packed)


def test_a_vlm_mask_whose_params_are_unknown_is_refused(parallel):
    """``build_vlm_attn_mask_thd`` on ids ``preprocess_thd_engine`` never planned (verl's own made the params)."""
    parallel(1, 2, 0)
    nested = torch.nested.nested_tensor([torch.arange(1, 6), torch.arange(1, 3)], layout=torch.jagged)
    rows, mask = vlm_masks.build_vlm_attn_mask_thd(nested, pad_token_id=0)
    with pytest.raises(ValueError, match="were not made by verl_cppack's preprocess_thd_engine"):
        megatron_bridge.preprocess_packed_seqs(rows, mask)


def test_another_tensor_parallel_size_than_verls_is_refused(parallel):
    parallel(2, 2, 0)
    nested = torch.nested.nested_tensor([torch.arange(1, 6)], layout=torch.jagged)
    dropins.preprocess_thd_engine(nested)
    rows, mask = vlm_masks.build_vlm_attn_mask_thd(nested, pad_token_id=0)
    pg_collection = types.SimpleNamespace(tp=_Group(1, 0), cp=_Group(2, 0))
    with pytest.raises(ValueError, match="tensor parallel size 1 differs from the 2"):
        megatron_bridge.preprocess_packed_seqs(rows, mask, True, pg_collection)


@pytest.mark.parametrize(
    "bad, error",
    [(dict(cp_rank=2), "Invalid context-parallel rank 2 for size 2"), (dict(total_tokens=9), "cover 8 tokens")],
)
def test_partition_indices_refuse_what_does_not_fit(bad, error):
    params = types.SimpleNamespace(cu_seqlens_q=torch.tensor([0, 4, 8]), cu_seqlens_q_padded=torch.tensor([0, 4, 8]))
    arguments = dict(total_tokens=8, cp_size=2, cp_rank=0, device=torch.device("cpu")) | bad
    with pytest.raises(ValueError, match=error):
        megatron_bridge.cp_partition_indices(params, **arguments)


def test_partition_indices_of_params_made_elsewhere_are_transformer_engines():
    """TE's own test pins: cu=[0,8,16], CP=2 -> rank0 [0,1,6,7,8,9,14,15], rank1 [2,3,4,5,10,11,12,13]."""
    params = types.SimpleNamespace(cu_seqlens_q=torch.tensor([0, 8, 16]), cu_seqlens_q_padded=torch.tensor([0, 8, 16]))
    got = [
        megatron_bridge.cp_partition_indices(params, total_tokens=16, cp_size=2, cp_rank=r, device="cpu").tolist()
        for r in range(2)
    ]
    assert got == [[0, 1, 6, 7, 8, 9, 14, 15], [2, 3, 4, 5, 10, 11, 12, 13]]


# ------------------------------------------------------------------------------------------------ the binding
@pytest.fixture
def installed():
    model = load(f"{QWEN3_VL}.model")
    megatron_bridge.install()
    yield model
    megatron_bridge.uninstall()


def test_install_binds_ours_where_the_bridge_defines_and_binds_them(installed):
    model = installed
    assert bridge_utils.preprocess_packed_seqs is megatron_bridge.preprocess_packed_seqs
    assert model.preprocess_packed_seqs is megatron_bridge.preprocess_packed_seqs
    assert bridge_seq_utils.get_packed_seq_cp_partition_indices is megatron_bridge.cp_partition_indices
    assert model.get_packed_seq_cp_partition_indices is megatron_bridge.cp_partition_indices
    status = megatron_bridge.status()
    assert status["left_to_bridge"] == {}
    assert sorted(status["replaced"]["preprocess_packed_seqs"]) == [f"{QWEN3_VL}.model", f"{QWEN3_VL}.utils"]
    megatron_bridge.uninstall()
    assert (
        model.preprocess_packed_seqs
        is bridge_utils.preprocess_packed_seqs
        is not megatron_bridge.preprocess_packed_seqs
    )


def test_a_changed_copy_or_another_release_stays_the_bridges(monkeypatch):
    load(f"{QWEN3_VL}.model")

    def changed(input_ids, attention_mask, pre_process=True, pg_collection=None, cp_layout="zigzag"):
        return input_ids, None

    monkeypatch.setattr(bridge_utils, "preprocess_packed_seqs", changed)
    monkeypatch.setattr(megatron_bridge, "installed_version", lambda: "0.6.2")
    try:
        megatron_bridge.install()
        assert bridge_utils.preprocess_packed_seqs is changed
        assert "parameters are" in megatron_bridge.status()["left_to_bridge"]["preprocess_packed_seqs"]
        megatron_bridge.uninstall()
        monkeypatch.setattr(megatron_bridge, "installed_version", lambda: "0.7.0")
        megatron_bridge.install()
        left = megatron_bridge.status()["left_to_bridge"]
        assert set(left) == {"preprocess_packed_seqs", "get_packed_seq_cp_partition_indices"}
        assert "megatron-bridge 0.7.0 is not >=0.6.0,<0.7" in left["get_packed_seq_cp_partition_indices"]
    finally:
        megatron_bridge.uninstall()


def test_doctor_reads_each_copys_fate_from_the_installed_source(monkeypatch):
    """``verl-cppack doctor`` cannot import the bridge on a CPU machine: it reads the installed source instead."""
    assert megatron_bridge.source_report() == dict.fromkeys(
        ("preprocess_packed_seqs", "get_packed_seq_cp_partition_indices"), "replaced"
    )
    monkeypatch.setattr(megatron_bridge, "installed_version", lambda: "0.7.0")
    assert all("is not >=0.6.0,<0.7" in fate for fate in megatron_bridge.source_report().values())


# ------------------------------------------------------------------------------------------------ real groups
def _world_worker(rank: int, world_size: int, tp_size: int, cp_size: int) -> dict:
    """One rank of a TP x CP gloo world: the bridge's function and ours with a real ``ProcessGroupCollection``, and
    verl's own, on masks where the bridge's copy is right and on one where it is not."""
    from megatron.core import parallel_state as mpu
    from megatron.core.process_groups_config import ProcessGroupCollection

    from tests.megatron_bridge_modules import QWEN3_VL, load
    from verl_cppack.integrations import megatron_bridge

    bridge = load(f"{QWEN3_VL}.utils")
    import verl.models.mcore.util as verl_util

    mpu.initialize_model_parallel(tensor_model_parallel_size=tp_size, context_parallel_size=cp_size)
    try:
        pg_collection = ProcessGroupCollection.use_mpu_process_groups()
        generator = torch.Generator().manual_seed(7)
        results = []
        for lengths, width in (([16, 9, 32], 32), ([3, 40], 40), ([1, 17], 20)):
            mask = torch.arange(width) < torch.tensor(lengths)[:, None]  # [B, S]
            embeddings = torch.randn(len(lengths), width, 4, generator=generator)
            ours = megatron_bridge.preprocess_packed_seqs(embeddings, mask, True, pg_collection)[0]
            verls = verl_util.preprocess_packed_seqs(embeddings, mask, pre_process=True)[0]
            cp_rank = pg_collection.cp.rank()
            right = _bridge_is_right(mask, tp_size, cp_size, cp_rank)
            bridges = bridge.preprocess_packed_seqs(embeddings, mask, True, pg_collection)[0] if right else None
            results.append((torch.equal(ours, verls), right, bridges is None or torch.equal(ours, bridges)))
        return {"cp_rank": pg_collection.cp.rank(), "results": results}
    finally:
        mpu.destroy_model_parallel()


@pytest.mark.slow  # gloo worlds importing verl and Megatron
@pytest.mark.stacks
@pytest.mark.parametrize("tp_size, cp_size", [(1, 2), (2, 2)], ids=["cp2", "tp2-cp2"])
def test_with_a_real_process_group_collection_ours_is_the_bridges_where_right_and_verls_always(tp_size, cp_size):
    results = [
        case for rank in run_gloo(_world_worker, tp_size * cp_size, tp_size, cp_size) for case in rank["results"]
    ]
    assert all(equal_to_verl and equal_to_bridge for equal_to_verl, _, equal_to_bridge in results)
    assert not all(right for _, right, _ in results)  # the short sequences: on some rank the bridge's copy is wrong


# ------------------------------------------------------------------------------------------------ the model
def _qwen3_vl_log_probs(rank: int, world_size: int, use_fp8_padding: bool, ours: bool) -> dict:
    """Megatron-Bridge's ``Qwen3VLModel`` (its language model: what the CPU can build; no vision tower) run as verl's
    engine forward runs a vision model: ``preprocess_thd_engine`` makes the params, ``build_vlm_attn_mask_thd`` the
    ``[B, S]`` rows, the model packs them itself; the next-token log-probs are gathered back with verl's labels."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLConfig

    from tests.megatron_bridge_modules import QWEN3_VL, load
    from verl_cppack.attention.core_attention import core_attention_class
    from verl_cppack.integrations import megatron_bridge
    from verl_cppack.integrations.verl import dropins, vlm_masks
    from verl_cppack.runtime.host_device import host_device_scope
    from verl_cppack.runtime.tiny_gpt import init_megatron_parallel

    init_megatron_parallel(1, world_size)
    model_module, config_module = load(f"{QWEN3_VL}.model"), load(f"{QWEN3_VL}.transformer_config")
    vision = Qwen3VLConfig().vision_config
    vision.deepstack_visual_indexes = [0]
    config = config_module.Qwen3VLTransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=2, num_query_groups=2, kv_channels=32, ffn_hidden_size=128,
        vocab_size=128, context_parallel_size=world_size, use_cpu_initialization=True, attention_dropout=0.0,
        hidden_dropout=0.0, apply_rope_fusion=False, bias_activation_fusion=False, bias_dropout_fusion=False,
        masked_softmax_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
        params_dtype=torch.float32, normalization="RMSNorm", qk_layernorm=True, mrope_section=[4, 6, 6],
        image_token_id=120, video_token_id=121, vision_start_token_id=122, calculate_per_token_loss=True,
    )  # fmt: skip
    spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=True)
    spec.submodules.self_attention.submodules.core_attention = core_attention_class("allgather", use_te=False)
    torch.manual_seed(0)  # the same weights at every CP size
    with host_device_scope():
        model = model_module.Qwen3VLModel(config, spec, vision, add_encoder=False, add_decoder=True)
    if ours:
        megatron_bridge.install()
    else:
        megatron_bridge.uninstall()
    ids = torch.nested.nested_tensor(
        [torch.arange(1, 12), torch.arange(20, 25), torch.arange(30, 47) % 110 + 1], layout=torch.jagged
    )  # [B, j]: 11, 5 and 17 tokens
    try:
        _, params, _ = dropins.preprocess_thd_engine(ids, use_fp8_padding=use_fp8_padding)
        labels = dropins.preprocess_thd_engine(ids, need_roll=True, use_fp8_padding=use_fp8_padding)[0]  # [1, T/CP]
        rows, mask = vlm_masks.build_vlm_attn_mask_thd(ids, pad_token_id=0)
        with torch.no_grad(), host_device_scope():
            logits = model(input_ids=rows, attention_mask=mask, packed_seq_params=params)  # [1, T/CP, V]
        log_probs = torch.log_softmax(logits.float(), -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)  # [1, T/CP]
        gathered = dropins.postprocess_thd_engine(log_probs, params, ids, 3)  # [B, j] on every rank
        return {"values": gathered.values(), "offsets": gathered.offsets()}
    except (RuntimeError, ValueError) as error:  # a stream that does not fit the params, found inside the model
        return {"error": f"{type(error).__name__}: {error}"}
    finally:
        megatron_bridge.uninstall()


@pytest.mark.slow  # gloo worlds building a Megatron-Bridge model
@pytest.mark.stacks
def test_the_qwen3_vl_model_with_ours_gives_verls_labels_their_log_probs_under_fp8_padding_and_cp():
    """With verl's FP8 padding at CP=2, the model's repacked embeddings line up with verl's labels and params: the
    log-probs equal CP=1 without padding (padding never reaches a real token). With the bridge's own copy the same
    run packs the embeddings into another stream than the labels and the params: it raises or differs — while on
    plain padding, where it is right, it gives the reference too."""
    reference = run_gloo(_qwen3_vl_log_probs, 1, False, True)[0]
    for rank in run_gloo(_qwen3_vl_log_probs, 2, False, False):
        assert torch.allclose(rank["values"], reference["values"], atol=1e-5, rtol=0)
    ours = run_gloo(_qwen3_vl_log_probs, 2, True, True)
    bridges = run_gloo(_qwen3_vl_log_probs, 2, True, False)
    for rank in ours:
        assert torch.allclose(rank["values"], reference["values"], atol=1e-5, rtol=0)
    assert torch.equal(ours[0]["offsets"], reference["offsets"])
    for rank in bridges:
        assert "error" in rank or not torch.allclose(rank["values"], reference["values"], atol=1e-3, rtol=0)
