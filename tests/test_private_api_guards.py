"""The guards of the private APIs the plugin uses (docs/design.md, "Private APIs and their guards"): each private
name is checked before it is used, and its absence ends in an error that names it and the way around it."""

from __future__ import annotations

import sys

import pytest

from verl_cppack.jobs import call_counts


def test_a_ray_without_its_private_key_value_functions_is_named_with_the_way_around(monkeypatch):
    internal_kv = pytest.importorskip("ray.experimental.internal_kv")
    assert call_counts.ray_key_value() is internal_kv  # today's Ray has all four
    monkeypatch.delattr(internal_kv, "_internal_kv_list")
    with pytest.raises(
        RuntimeError, match=r"internal_kv\._internal_kv_list, which Ray .* lacks.*VERL_CPPACK_CALL_COUNT_DIR"
    ):
        call_counts.ray_key_value()
    with pytest.raises(RuntimeError, match="_internal_kv_list"):
        call_counts.read_ray_call_records("any-key")


def test_counting_by_role_without_frames_says_so(monkeypatch):
    assert call_counts.caller_role() == "policy"
    monkeypatch.delattr(sys, "_getframe")
    with pytest.raises(RuntimeError, match=r"reads the caller's frames \(sys\._getframe\)"):
        call_counts.caller_role()
