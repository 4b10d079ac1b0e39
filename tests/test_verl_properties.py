"""Property tests of the drop-ins at CP=1 against the pure-Python oracle, in this process.

The parallel context verl would read from megatron is replaced by an explicit TP=1, CP=1 context, so these
run without megatron or verl. (Multi-rank behaviour is covered in real gloo processes by test_verl_equality
and test_verl_fixes.)
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests import oracle
from verl_cppack import ParallelContext
from verl_cppack.integrations.verl import dropins

masks = st.integers(1, 5).flatmap(
    lambda rows: st.integers(1, 7).flatmap(
        lambda columns: st.lists(
            st.lists(st.integers(0, 1), min_size=columns, max_size=columns), min_size=rows, max_size=rows
        ).filter(lambda mask: any(map(any, mask)))
    )
)


@pytest.fixture(autouse=True)
def single_rank(monkeypatch):
    monkeypatch.setattr(dropins, "megatron_context", lambda local_cp_size=None: ParallelContext())
    dropins.clear_plan_caches()


def _values(mask: list[list[int]], trailing: int = 2) -> torch.Tensor:
    rows, columns = len(mask), len(mask[0])
    return torch.arange(1, rows * columns * trailing + 1).view(rows, columns, trailing)


@settings(max_examples=40, deadline=None)
@given(mask=masks, as_int=st.booleans())
def test_packed_round_trip_matches_the_oracle(mask, as_int):
    attention_mask = torch.tensor(mask) if as_int else torch.tensor(mask, dtype=torch.bool)
    x = _values(mask)
    packed, params = dropins.preprocess_packed_seqs(x, attention_mask)
    stream = oracle.stream_of_rows(mask, [sum(row) for row in mask])
    expected = torch.stack([x[row, column] for row, column in stream]).unsqueeze(0)
    assert torch.equal(packed, expected)
    assert params.cu_seqlens_q_padded.tolist() == oracle.offsets([sum(row) for row in mask])
    back = dropins.postprocess_packed_seqs(packed, params, attention_mask, *attention_mask.shape)
    assert torch.equal(back, x * torch.tensor(mask)[..., None])


@settings(max_examples=40, deadline=None)
@given(mask=masks)
def test_bshd_compaction_left_aligns_every_row(mask):
    attention_mask = torch.tensor(mask, dtype=torch.bool)
    x = _values(mask)
    positions = torch.arange(attention_mask.numel()).view(attention_mask.shape)
    new_x, new_mask, new_positions = dropins.preprocess_bshd(x, attention_mask, positions)
    longest = max(sum(row) for row in mask)
    assert new_x.shape == (len(mask), longest, 2) and new_mask.dtype == torch.bool
    for row, keep in enumerate(mask):
        columns = [c for c, value in enumerate(keep) if value]
        assert new_mask[row].tolist() == [True] * len(columns) + [False] * (longest - len(columns))
        assert new_x[row, : len(columns)].tolist() == x[row, columns].tolist()
        assert new_positions[row, : len(columns)].tolist() == positions[row, columns].tolist()
    back = dropins.postprocess_bshd(new_x, new_mask, attention_mask, len(mask[0]))
    assert torch.equal(back, x * attention_mask[..., None])


@settings(max_examples=40, deadline=None)
@given(mask=masks.filter(lambda mask: all(map(any, mask))))
def test_need_roll_gives_each_tokens_successor_in_its_own_sequence(mask):
    x = _values(mask, trailing=1)[..., 0]
    nested = torch.nested.nested_tensor(
        [row[torch.tensor(keep, dtype=torch.bool)] for row, keep in zip(x, mask)], layout=torch.jagged
    )
    rolled, _, positions = dropins.preprocess_thd_engine(nested, need_roll=True)
    expected, expected_positions = [], []
    for row, keep in enumerate(mask):
        tokens = [x[row, c].item() for c, value in enumerate(keep) if value]
        expected += tokens[1:] + tokens[:1]
        expected_positions += list(range(len(tokens)))
    assert rolled[0].tolist() == expected
    assert positions[0].tolist() == expected_positions
    back = dropins.postprocess_thd_engine(rolled, dropins.preprocess_thd_engine(nested)[1], nested, len(mask))
    assert back.values().tolist() == expected


def test_plan_cache_reuses_a_plan_until_the_mask_changes_or_dies():
    from verl_cppack.integrations.verl.plan_cache import TensorKeyedCache

    cache, built = TensorKeyedCache(capacity=2), []
    mask = torch.ones(2, 3, dtype=torch.bool)

    def build():
        built.append(1)
        return len(built)

    assert cache.entry(mask, "k", build)[0] == 1
    assert cache.entry(mask, "k", build)[0] == 1  # same tensor, same version: reused
    assert cache.entry(mask.clone(), "k", build)[0] == 2  # equal values, another tensor: rebuilt
    mask[0, 0] = False  # in-place edit bumps the version
    assert cache.entry(mask, "k", build)[0] == 3
    del mask  # its weak reference's callback runs now: it only notes the death ...
    assert len(cache._entries) == 2
    assert cache.lookup(torch.ones(1, 1, dtype=torch.bool), "k") is None  # ... and the next call drops the entries
    assert len(cache._entries) == 0 and not cache._snapshots


def test_a_dead_sources_values_are_released_when_it_dies():
    """A plan lives as long as its mask, not until the cache's next call (its index tables can be megabytes)."""
    import weakref

    from verl_cppack.integrations.verl.plan_cache import TensorKeyedCache

    class Plan:
        pass

    cache, mask, plan = TensorKeyedCache(), torch.ones(2, 3, dtype=torch.bool), Plan()
    plan_alive = weakref.ref(plan)
    cache.entry(mask, "k", lambda made=plan: made)
    del plan
    assert plan_alive() is not None  # kept while the mask lives
    del mask
    assert plan_alive() is None  # released with the mask, before any further call


def test_a_source_dying_never_changes_the_cache_under_its_own_loops():
    """A source's last reference can go anywhere, a garbage collection in the middle of the cache's loop over its
    entries included (verl 0.7.1's release comparison once raised "OrderedDict mutated during iteration" there):
    its callback leaves the entries as they are, and they cannot be found until the next call drops them."""
    from verl_cppack.integrations.verl.plan_cache import TensorKeyedCache

    cache = TensorKeyedCache(capacity=4)
    sources = [torch.ones(2, 3, dtype=torch.bool) for _ in range(3)]
    for index in range(len(sources)):
        cache.entry(sources[index], "k", lambda index=index: index)
    entries, snapshots = list(cache._entries.items()), dict(cache._snapshots)
    for _ in cache._entries:  # a loop of the cache's, during which every source dies
        sources.clear()
    assert list(cache._entries.items()) == entries and cache._snapshots == snapshots
    assert cache.find(torch.ones(2, 3, dtype=torch.bool), lambda value: True) is None
    assert len(cache._entries) == 0 and not cache._snapshots


@settings(max_examples=60, deadline=None)
@given(steps=st.lists(st.tuples(st.integers(0, 4), st.sampled_from(["a", "b", "c"]), st.booleans()), max_size=40))
def test_plan_cache_bookkeeping_stays_consistent_through_hits_evictions_and_deaths(steps):
    """After any sequence of lookups (a source, an extra key) and deaths: at most ``capacity`` entries, each on the
    snapshot its live source has registered; no snapshot registered without an entry; a hit is the value built for
    that very source and key."""
    from verl_cppack.integrations.verl.plan_cache import TensorKeyedCache

    cache = TensorKeyedCache(capacity=3)
    sources: dict[int, torch.Tensor] = {}
    for source_id, key, dies in steps:
        source = sources.setdefault(source_id, torch.ones(2, 3, dtype=torch.bool))
        made = (id(source), key)
        assert cache.entry(source, key, lambda made=made: made)[0] == made
        if dies:
            del sources[source_id], source
        cache.lookup(torch.ones(1, 1, dtype=torch.bool), "other")  # a call: the dead sources' entries go
        assert len(cache._entries) <= 3
        for (address, version, entry_key), snapshot in cache._entries.items():
            assert cache._snapshots[address, version] is snapshot and entry_key in snapshot.values
        assert {entry[:2] for entry in cache._entries} == set(cache._snapshots)
