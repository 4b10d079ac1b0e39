"""The drop-ins cost the same number of ATen ops whatever the batch size, and one host sync per micro-batch."""

from __future__ import annotations

import pytest
import torch

from verl_cppack.bench.counters import HostReadCounter, OpCounter


def _batch(batch_size: int, seq_len: int = 24):
    generator = torch.Generator().manual_seed(batch_size)
    lengths = torch.randint(1, seq_len + 1, (batch_size,), generator=generator)
    starts = torch.randint(0, seq_len, (batch_size,), generator=generator) % (seq_len - lengths + 1)
    columns = torch.arange(seq_len)
    mask = (columns >= starts[:, None]) & (columns < (starts + lengths)[:, None])  # one run per row, anywhere
    ids = torch.randint(1, 100, (batch_size, seq_len), generator=generator)
    nested = torch.nested.nested_tensor([row[keep] for row, keep in zip(ids, mask)], layout=torch.jagged)
    return mask, ids, nested


def _count(call) -> dict[str, int]:
    from verl_cppack.integrations.verl import clear_plan_caches

    clear_plan_caches()
    with OpCounter() as counter:
        call()
    return dict(counter.ops)


def _calls(ours, mask, ids, nested):
    """Each drop-in (pre and post) as a zero-argument call on this batch."""
    batch, seq_len = mask.shape

    def legacy_round_trip():
        packed, params = ours.preprocess_packed_seqs(ids, mask)
        ours.postprocess_packed_seqs(packed.float(), params, mask, batch, seq_len)

    def engine_thd_round_trip():
        packed, params, _ = ours.preprocess_thd_engine(nested, need_roll=True)
        ours.postprocess_thd_engine(packed.float(), params, nested, batch)

    def engine_bshd_round_trip():
        rows, attention, _ = ours.preprocess_bshd_engine(nested, forced_max_seqlen=seq_len)
        ours.postprocess_bshd_engine(rows.float(), attention)

    return {
        "preprocess_packed_seqs": lambda: ours.preprocess_packed_seqs(ids, mask),
        "packed round trip": legacy_round_trip,
        "preprocess_thd_engine": lambda: ours.preprocess_thd_engine(nested),
        "thd engine round trip": engine_thd_round_trip,
        "bshd engine round trip": engine_bshd_round_trip,
    }


def micro_batch_syncs(ours, mask, ids, nested) -> dict[str, int]:
    """Host syncs of everything verl does with one micro-batch: pack inputs, labels, label mask; gather 2 outputs."""
    from verl_cppack.integrations.verl import clear_plan_caches

    batch, seq_len = mask.shape
    clear_plan_caches()
    with HostReadCounter() as legacy_tolist, OpCounter() as legacy:
        packed, params = ours.preprocess_packed_seqs(ids, mask)
        ours.preprocess_packed_seqs(ids, mask)  # labels
        ours.preprocess_packed_seqs(mask, mask)  # label mask
        for _ in range(2):  # log-probs, entropy
            ours.postprocess_packed_seqs(packed.float(), params, mask, batch, seq_len)
    with HostReadCounter() as engine_tolist, OpCounter() as engine:
        packed, params, _ = ours.preprocess_thd_engine(nested)
        ours.preprocess_thd_engine(nested, need_roll=True)
        for _ in range(2):
            ours.postprocess_thd_engine(packed.float(), params, nested, batch)
    return {"legacy": legacy.syncs() + legacy_tolist.calls, "engine": engine.syncs() + engine_tolist.calls}


def op_count_checks() -> dict[str, tuple[int, int]]:
    """Run inside an initialised megatron parallel state: op counts at B=4 and B=64, per drop-in; syncs."""
    from verl_cppack.integrations import verl as ours

    small, large = _calls(ours, *_batch(4)), _calls(ours, *_batch(64))
    counts = {name: (_count(small[name]), _count(large[name])) for name in small}
    return {"ops": counts, "syncs": micro_batch_syncs(ours, *_batch(64))}


@pytest.mark.slow  # op counts of verl's and ours in gloo worlds, about ten seconds each
@pytest.mark.parametrize("name", ["cp1", "cp2", "cp4"])
def test_op_counts_do_not_grow_with_batch_size(name):
    from tests.test_verl_equality import world

    for result in world(name):
        counts = result["op_counts"]["ops"]
        assert len(counts) == 5
        for call, (small, large) in counts.items():
            assert sum(small.values()) > 0, call
            assert small == large, (call, small, large)  # every op, the zeroing and the host tables included


@pytest.mark.slow  # reads test_verl_equality's gloo worlds (verl and Megatron imported in every rank)
@pytest.mark.parametrize("name", ["cp1", "cp2"])
def test_one_host_sync_per_micro_batch(name):
    from tests.test_verl_equality import world

    for result in world(name):
        assert result["op_counts"]["syncs"] == {"legacy": 1, "engine": 1}
