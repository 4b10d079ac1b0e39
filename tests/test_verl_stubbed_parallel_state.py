"""Under the stand-ins verl's own unit tests use, the drop-ins run as verl's functions do and give their results.

verl's tests run single-process: they replace ``megatron.core.parallel_state``'s getters with lambdas (no
initialised parallel state), hand over a plain object (or a tuple) as the CP group — one torch.distributed knows
nothing of — and stand in ``torch.distributed.all_gather`` (here it hands every simulated CP rank's output,
collected beforehand, into buffers that must have the shape of the local output, as verl's stand-ins copy them;
``all_reduce`` too, which the BSHD gather-back calls on every call so that no rank's cache decides its
collectives). The drop-ins trust megatron's getters for the group's size and this rank, as verl does: torch.distributed
is never asked about the group. What megatron says is still checked: a rank outside the size, a string or a number
as the group are refused. Compared with verl 0.9.1's own functions at CP=2 (both simulated ranks) and with the batch
itself.
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.distributed

verl_util = pytest.importorskip("verl.models.mcore.util")

from verl_cppack import ParallelContext  # noqa: E402
from verl_cppack.integrations import verl as ours  # noqa: E402

CP = 2
MASK = torch.tensor([[0, 1, 1, 1, 1, 0, 0], [1, 1, 0, 0, 0, 0, 0], [0, 0, 1, 1, 1, 1, 1]], dtype=torch.bool)
IDS = torch.arange(1, MASK.numel() + 1).view(MASK.shape)


class Stubs:
    """verl-style stand-ins for one simulated CP rank at a time."""

    def __init__(self, monkeypatch, group: object) -> None:
        self.monkeypatch, self.group, self.rank, self.gathered, self.buffer_shapes = monkeypatch, group, 0, [], []
        mpu = verl_util.mpu  # megatron's parallel_state module, as verl's util holds it
        monkeypatch.setattr(mpu, "get_tensor_model_parallel_world_size", lambda: 1)
        monkeypatch.setattr(mpu, "get_context_parallel_world_size", lambda: CP)
        monkeypatch.setattr(mpu, "get_context_parallel_rank", lambda: self.rank)
        monkeypatch.setattr(mpu, "get_context_parallel_group", lambda: self.group)
        monkeypatch.setattr(torch.distributed, "all_gather", self.all_gather)
        monkeypatch.setattr(torch.distributed, "all_reduce", self.all_reduce)
        ours.clear_plan_caches()

    def all_reduce(self, tensor, op=None, group=None, async_op=False):
        """The BSHD gather-back's sum of real-token counts over CP (verl's own function needs none): every
        simulated rank's counts, known beforehand — each row's tokens."""
        assert group is self.group
        tensor.copy_(MASK.sum(dim=1))

    def all_gather(self, outputs, tensor, group=None):  # the arguments verl passes (no async_op)
        assert group is self.group and len(outputs) == CP
        self.buffer_shapes.append({tuple(output.shape) for output in outputs} | {tuple(tensor.shape)})
        for output, rank_output in zip(outputs, self.gathered):
            output.copy_(rank_output.reshape(output.shape))


def _nested(x: torch.Tensor) -> torch.Tensor:
    return torch.nested.nested_tensor([row[keep] for row, keep in zip(x, MASK)], layout=torch.jagged)


def _round_trip(stubs: Stubs, preprocess, postprocess) -> list:
    """Pack on both simulated ranks, then gather every rank's packed rows (times 10, as a model output) back."""
    packed = []
    for rank in range(CP):
        stubs.rank = rank
        packed.append(preprocess())
    stubs.gathered = [result[0] * 10 for result in packed]
    gathered = []
    for rank in range(CP):
        stubs.rank = rank
        gathered.append(postprocess(stubs.gathered[rank], packed[rank]))
    return [result[0] for result in packed] + gathered


@pytest.mark.parametrize("group", [object(), ("cp", 0, 1)], ids=["object", "tuple"])
def test_the_drop_ins_run_under_verls_test_stubs_and_equal_verl(monkeypatch, group):
    stubs = Stubs(monkeypatch, group)
    batch_size, seq_len = MASK.shape
    cases = {
        "packed": lambda impl: _round_trip(
            stubs,
            lambda: impl.preprocess_packed_seqs(IDS, MASK),
            lambda y, pre: impl.postprocess_packed_seqs(y, pre[1], MASK, batch_size, seq_len),
        ),
        "thd engine": lambda impl: _round_trip(
            stubs,
            lambda: impl.preprocess_thd_engine(_nested(IDS)),
            lambda y, pre: impl.postprocess_thd_engine(y, pre[1], _nested(IDS), batch_size),
        ),
        "bshd engine": lambda impl: _round_trip(
            stubs,
            lambda: impl.preprocess_bshd_engine(_nested(IDS)),
            lambda y, pre: impl.postprocess_bshd_engine(y, pre[1]),
        ),
    }
    for name, case in cases.items():
        theirs, mine = case(verl_util), case(ours)
        if name != "bshd engine":  # verl's THD buffers are shaped like its local output [1, T/CP]: so are ours
            assert stubs.buffer_shapes[-1] == {tuple(stubs.gathered[0].shape)}, name
        for a, b in zip(theirs, mine):
            a, b = (a.values(), b.values()) if a.is_nested else (a, b)
            assert torch.equal(a, b), name
        full = mine[-1].values() if mine[-1].is_nested else mine[-1][MASK]
        assert torch.equal(full, IDS[MASK] * 10), name  # every rank gathered the whole batch back


@pytest.mark.parametrize("group", ["cp", 0, 1.5])
def test_a_string_or_a_number_is_no_group_whatever_the_stubs_answer(monkeypatch, group):
    Stubs(monkeypatch, group)
    with pytest.raises(TypeError, match="cp_group must be a torch.distributed.ProcessGroup"):
        ours.preprocess_packed_seqs(IDS, MASK)
    with pytest.raises(TypeError, match="cp_group must be a torch.distributed.ProcessGroup"):
        ParallelContext(cp_size=CP, cp_group=group)


def test_torch_distributed_is_never_asked_about_megatrons_group(monkeypatch):
    stubs = Stubs(monkeypatch, object())

    def refuse(*args, **kwargs):
        raise AssertionError("torch.distributed asked about the group")

    monkeypatch.setattr(torch.distributed, "get_world_size", refuse)
    monkeypatch.setattr(torch.distributed, "get_rank", refuse)
    local, params = ours.preprocess_packed_seqs(IDS, MASK)
    stubs.gathered = [local * 10] * CP
    ours.postprocess_packed_seqs(local * 10, params, MASK, *MASK.shape)


def test_a_rank_megatron_places_outside_its_size_is_refused(monkeypatch):
    stubs = Stubs(monkeypatch, object())
    stubs.rank = CP
    with pytest.raises(ValueError, match="cp_rank must satisfy 0 <= cp_rank < cp_size, got cp_rank=2, cp_size=2"):
        ours.preprocess_packed_seqs(IDS, MASK)


@pytest.mark.parametrize(
    "options",
    [{}, {"cp_layout": "contiguous"}, {"local_cp_size": CP}, {"min_local_rows": 16}],
    ids=["zigzag", "contiguous", "dynamic-cp", "min-local-rows"],
)
def test_the_engine_preprocess_equals_verls_under_its_stubs_position_ids_included(monkeypatch, options):
    """verl's tests of ``preprocess_thd_engine`` check the position ids too, padding included (under zigzag CP verl
    numbers the padding of each slot's front chunk with its offsets); dynamic CP hands a tuple as the group, from
    ``get_dynamic_data_context_parallel_groups``, and the rank from ``torch.distributed.get_rank`` as verl asks it."""
    stubs = Stubs(monkeypatch, object())
    monkeypatch.setattr(
        verl_util.mpu, "get_dynamic_data_context_parallel_groups", lambda group_size: ("dcp", group_size), raising=False
    )

    class PackedSeqParams:  # verl's stand-in: takes any field (the contiguous layout's cp_partition_mode too)
        def __init__(self, **kwargs):
            self.__dict__.update(kwargs)

    monkeypatch.setattr(verl_util, "PackedSeqParams", PackedSeqParams)
    monkeypatch.setattr(verl_util, "_PACKED_SEQ_PARAMS_HAS_CP_PARTITION_MODE", True)  # as its import would find
    monkeypatch.setattr(sys.modules["megatron.core.packed_seq_params"], "PackedSeqParams", PackedSeqParams)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: stubs.rank)
    for rank in range(CP):
        stubs.rank = rank
        theirs = verl_util.preprocess_thd_engine(_nested(IDS), **options)
        mine = ours.preprocess_thd_engine(_nested(IDS), **options)
        assert torch.equal(mine[0], theirs[0]) and torch.equal(mine[2], theirs[2]), rank
        assert torch.equal(mine[1].cu_seqlens_q_padded, theirs[1].cu_seqlens_q_padded)
        if "local_cp_size" in options:
            assert mine[1].cp_group == theirs[1].cp_group == ("dcp", CP) and mine[1].local_cp_size == CP
