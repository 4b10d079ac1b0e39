"""Run outputs never destroy earlier results; metrics are one finite JSON object per line."""

from __future__ import annotations

import json

import pytest

from verl_cppack.jobs.output import MetricsWriter, fifth_means, fresh_output_dir, read_metrics


def test_missing_or_empty_directory_is_used_as_is(tmp_path):
    assert fresh_output_dir(tmp_path / "new" / "run") == tmp_path / "new" / "run"
    (tmp_path / "empty").mkdir()
    assert fresh_output_dir(tmp_path / "empty") == tmp_path / "empty"


def test_non_empty_directory_gets_a_fresh_subdirectory_and_keeps_its_files(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("earlier\n")
    first = fresh_output_dir(tmp_path)
    second = fresh_output_dir(tmp_path)  # same second: gets a suffix instead of reusing
    assert first.parent == second.parent == tmp_path
    assert first != second and first.name.startswith("run-") and second.name.startswith("run-")
    assert (tmp_path / "metrics.jsonl").read_text() == "earlier\n"


def test_an_output_path_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        fresh_output_dir(tmp_path / "file")


def test_metrics_writer_appends_lines_and_refuses_non_finite_values(tmp_path):
    writer = MetricsWriter(tmp_path / "metrics.jsonl")
    writer.write({"step": 0, "reward_mean": 0.5})
    with pytest.raises(ValueError, match="reward_mean"):
        writer.write({"step": 1, "reward_mean": float("nan")})
    writer.close()
    assert read_metrics(tmp_path / "metrics.jsonl") == [{"step": 0, "reward_mean": 0.5}]
    assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])["step"] == 0


def test_fifth_means():
    assert fifth_means([0, 0, 1, 1, 1, 1, 1, 1, 2, 4]) == (0.0, 3.0)
    assert fifth_means([1.0, 2.0]) == (1.0, 2.0)  # at least one value per end
    with pytest.raises(ValueError, match="no values"):
        fifth_means([])
