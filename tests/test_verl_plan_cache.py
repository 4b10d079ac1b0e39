"""The drop-ins' plan cache never serves another mask's plan, however the mask's contents changed.

A write through ``.numpy()``, ``.data`` or shared memory changes a tensor without bumping ``tensor._version``;
the cache must then pack the current contents, exactly as a fresh call (and verl) would. In this process at
CP=1, the megatron context replaced by an explicit one (as in test_verl_properties).
"""

from __future__ import annotations

import pytest
import torch

from verl_cppack import ParallelContext
from verl_cppack.bench.counters import HostReadCounter, OpCounter
from verl_cppack.integrations.verl import dropins, plan_cache

FIRST = [[1, 1, 1, 0, 0, 0, 0, 0], [0, 1, 1, 1, 1, 0, 0, 0]]
OTHER = [[0, 0, 0, 0, 1, 1, 1, 1], [1, 0, 1, 0, 1, 0, 1, 1]]


@pytest.fixture(autouse=True)
def single_rank(monkeypatch):
    monkeypatch.setattr(dropins, "megatron_context", lambda local_cp_size=None: ParallelContext())
    dropins.clear_plan_caches()
    yield
    dropins.clear_plan_caches()


def _ids() -> torch.Tensor:
    return torch.arange(1, 17).view(2, 8)


def _fresh(mask_values, dtype) -> tuple[torch.Tensor, object]:
    """What an uncached call returns for these mask values (a new tensor, caches cleared)."""
    dropins.clear_plan_caches()
    packed, params = dropins.preprocess_packed_seqs(_ids(), torch.tensor(mask_values, dtype=dtype))
    dropins.clear_plan_caches()
    return packed, params


def _write_through_numpy(mask, values):
    mask.numpy()[:] = torch.tensor(values, dtype=mask.dtype).numpy()


def _strided(values, dtype) -> torch.Tensor:
    """``values`` as every other column of a wider tensor: a mask whose memory is not contiguous."""
    wide = torch.zeros(len(values), 2 * len(values[0]), dtype=dtype)
    wide[:, ::2] = torch.tensor(values, dtype=dtype)
    return wide[:, ::2]


def _write_through_data(mask, values):
    mask.data.copy_(torch.tensor(values, dtype=mask.dtype))  # .data has its own version counter


def _write_through_shared_memory(mask, values):
    other_view = torch.from_numpy(mask.numpy())  # another tensor over the same memory, its own version
    other_view.copy_(torch.tensor(values, dtype=mask.dtype))


WRITES = [_write_through_numpy, _write_through_data, _write_through_shared_memory]


@pytest.mark.parametrize("contiguous", [True, False])
@pytest.mark.parametrize("write", WRITES)
@pytest.mark.parametrize("dtype", [torch.bool, torch.long])
def test_preprocess_packs_the_masks_current_contents(write, dtype, contiguous):
    expected, expected_params = _fresh(OTHER, dtype)
    mask = torch.tensor(FIRST, dtype=dtype) if contiguous else _strided(FIRST, dtype)
    assert mask.is_contiguous() == contiguous
    dropins.preprocess_packed_seqs(_ids(), mask)
    version = mask._version
    write(mask, OTHER)
    assert mask._version == version  # the write is invisible to torch's version counter
    packed, params = dropins.preprocess_packed_seqs(_ids(), mask)
    assert torch.equal(packed, expected)
    assert torch.equal(params.cu_seqlens_q_padded, expected_params.cu_seqlens_q_padded)


@pytest.mark.parametrize("dtype", [torch.bool, torch.long])
def test_a_strided_mask_is_compared_where_its_elements_are(dtype):
    """A strided mask's elements are spread over more memory than its size: an edit of its last row only (past the
    first ``nbytes`` bytes from its start) is seen too."""
    edited = [FIRST[0], OTHER[1]]
    expected, _ = _fresh(edited, dtype)
    mask = _strided(FIRST, dtype)
    dropins.preprocess_packed_seqs(_ids(), mask)
    _write_through_numpy(mask, edited)
    packed, _ = dropins.preprocess_packed_seqs(_ids(), mask)
    assert torch.equal(packed, expected)


@pytest.mark.parametrize("write", WRITES)
def test_postprocess_unpacks_with_the_masks_current_contents(write):
    """Gather-back after such a write: the current mask's positions (verl's result), or a clear error when the
    packed_seq_params no longer describe the mask."""
    mask = torch.tensor(FIRST, dtype=torch.bool)
    packed, params = dropins.preprocess_packed_seqs(_ids(), mask)
    same_lengths = [[0, 0, 0, 0, 0, 1, 1, 1], [1, 1, 1, 1, 0, 0, 0, 0]]  # 3 and 4 tokens again, other places
    write(mask, same_lengths)
    back = dropins.postprocess_packed_seqs(packed, params, mask, 2, 8)
    expected = torch.zeros(2, 8, dtype=packed.dtype)
    expected[torch.tensor(same_lengths, dtype=torch.bool)] = packed.view(-1)
    assert torch.equal(back, expected)
    write(mask, OTHER)  # 4 and 5 tokens: the packed stream cannot come from this mask
    with pytest.raises(ValueError, match="packed_seq_params does not describe this batch"):
        dropins.postprocess_packed_seqs(packed, params, mask, 2, 8)


@pytest.mark.parametrize(
    "not_params", [None, {"cu_seqlens_q_padded": [0, 3, 7]}, object()], ids=["None", "dict", "object"]
)
def test_gather_back_without_packed_seq_params_is_a_type_error_before_any_plan(not_params, monkeypatch):
    """Something that carries no THD offsets in place of the ``PackedSeqParams`` (``None``, a dict, another object):
    a ``TypeError`` naming what to pass, raised before a plan is built or a mask read (verl's own functions raise
    ``AttributeError`` on ``None.cu_seqlens_q``)."""
    mask = torch.tensor(FIRST, dtype=torch.bool)
    packed, _ = dropins.preprocess_packed_seqs(_ids(), mask)
    nested = torch.nested.nested_tensor_from_jagged(torch.arange(10), offsets=torch.tensor([0, 3, 10]))
    engine_packed, _, _ = dropins.preprocess_thd_engine(nested)

    def no_plan(*args, **kwargs):
        raise AssertionError("a plan was built for a call that must fail first")

    monkeypatch.setattr(dropins, "mask_plan", no_plan)
    monkeypatch.setattr(dropins, "_nested_plan", no_plan)
    message = "packed_seq_params must be the PackedSeqParams the matching preprocess call returned"
    with pytest.raises(TypeError, match=message):
        dropins.postprocess_packed_seqs(packed, not_params, mask, 2, 8)
    with pytest.raises(TypeError, match=message):
        dropins.postprocess_thd_engine(engine_packed, not_params, nested, 2)
    with pytest.raises(TypeError, match=message):
        dropins.postprocess_thd_engine(engine_packed, not_params, nested, 2, local_cp_size=1)


def test_nested_offsets_written_in_place_are_seen():
    values = torch.arange(10)
    offsets = torch.tensor([0, 3, 10])
    nested = torch.nested.nested_tensor_from_jagged(values, offsets=offsets)
    dropins.preprocess_thd_engine(nested)
    nested.offsets().numpy()[:] = [0, 6, 10]  # same tensor, no version bump
    packed, params, _ = dropins.preprocess_thd_engine(nested)
    assert params.cu_seqlens_q_padded.tolist() == [0, 6, 10]
    assert torch.equal(packed.view(-1), values)


def test_bshd_record_checks_the_original_mask():
    mask = torch.tensor(FIRST, dtype=torch.bool)
    rows, new_mask, _ = dropins.preprocess_bshd(_ids(), mask, torch.zeros(2, 8, dtype=torch.long))
    same_lengths = [[0, 0, 0, 0, 0, 1, 1, 1], [1, 1, 1, 1, 0, 0, 0, 0]]
    _write_through_numpy(mask, same_lengths)
    back = dropins.postprocess_bshd(rows, new_mask, mask, 8)
    expected = torch.zeros(2, 8, dtype=rows.dtype)
    expected[torch.tensor(same_lengths, dtype=torch.bool)] = rows[new_mask.bool()]
    assert torch.equal(back, expected)


def test_an_unchanged_mask_is_planned_once():
    mask = torch.tensor(FIRST, dtype=torch.bool)
    _, first = dropins.preprocess_packed_seqs(_ids(), mask)
    _, again = dropins.preprocess_packed_seqs(_ids() * 2, mask)
    record, other = getattr(first, plan_cache.PLAN_ATTRIBUTE), getattr(again, plan_cache.PLAN_ATTRIBUTE)
    assert record[1] is other[1] and record[0] is other[0]  # the same plan, one snapshot


def test_an_accelerator_keeps_no_copy_and_rebuilds_after_an_in_place_edit():
    """Off the CPU (``keep_contents=False``, what a cache of accelerator tensors does) a hit is the same tensor at the
    same version: no copy of the source, no device op, no host read, never a device-side assertion; an in-place edit
    (a new version) builds again."""
    cache = plan_cache.TensorKeyedCache(keep_contents=False)
    mask = torch.tensor(FIRST, dtype=torch.bool)
    builds = []

    def build() -> int:
        builds.append(int(mask.sum()))
        return len(builds)

    value, snapshot = cache.entry(mask, "plan", build)
    assert snapshot.kept is None and value == 1
    with OpCounter() as counter, HostReadCounter() as reads:
        again, _ = cache.entry(mask, "plan", build)
    assert again == 1 and builds == [sum(map(sum, FIRST))]
    assert sum(counter.ops.values()) == 0 and reads.calls == 0
    mask.copy_(torch.tensor(OTHER, dtype=torch.bool))
    rebuilt, _ = cache.entry(mask, "plan", build)
    assert rebuilt == 2 and builds == [sum(map(sum, FIRST)), sum(map(sum, OTHER))]
