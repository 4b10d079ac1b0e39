"""Drop-in call counting: off (and free) unless asked for; per process files summed; the critic's calls told apart."""

from __future__ import annotations

import json

from verl_cppack.jobs import call_counts


def dropin(x):
    return x + 1


def test_without_the_variable_the_dropin_is_installed_unwrapped(monkeypatch):
    monkeypatch.delenv(call_counts.COUNT_DIR_ENV, raising=False)
    assert call_counts.counted("preprocess_thd_engine", dropin) is dropin


def test_with_the_variable_every_call_is_counted_by_name_and_role(monkeypatch, tmp_path):
    monkeypatch.setenv(call_counts.COUNT_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(call_counts, "_COUNTS", {})
    monkeypatch.setattr(call_counts, "_ROLES", {})
    counted = call_counts.counted("preprocess_thd_engine", dropin)
    assert counted(1) == 2 and counted(2) == 3  # the drop-in's result is returned unchanged

    class MegatronEngineWithValueHead:  # the name verl 0.9's critic engine has
        def forward_step(self):
            return counted(3)

    assert MegatronEngineWithValueHead().forward_step() == 4
    (written,) = tmp_path.glob("*.json")
    assert json.loads(written.read_text())["counts"] == {"preprocess_thd_engine": 3}
    (tmp_path / "other-worker.json").write_text(json.dumps({"counts": {"preprocess_thd_engine": 5}}))
    assert call_counts.read_call_counts(tmp_path) == {"preprocess_thd_engine": 8}
    assert call_counts.read_call_counts(tmp_path, "roles") == {"policy": 2, "critic": 1}
