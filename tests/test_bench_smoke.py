"""`verl-cppack bench` smoke run: it runs verl and verl_cppack in a real CP group and writes its report.

Only counts are asserted (never times): verl_cppack makes one host sync per micro-batch and the same ATen
op count for every B, while verl's op count grows with B.
"""

import pytest
import torch

from verl_cppack.bench.measure import BenchSettings, run_benchmark
from verl_cppack.bench.report import (
    SECTION_BEGIN,
    SECTION_END,
    performance_section,
    update_generated_section,
    write_outputs,
)

pytest.importorskip("verl")
pytest.importorskip("megatron.core")

pytestmark = pytest.mark.slow  # the benchmark in gloo processes


@pytest.fixture(scope="module")
def rows():
    return run_benchmark(BenchSettings(batch_sizes=(8, 32), seq_lens=(64,), cp_sizes=(2,), repeats=1, runs=2, warmup=1))


def test_counts(rows):
    assert [row["batch_size"] for row in rows] == [8, 32]
    assert all(row["runs"] == 2 for row in rows)
    assert all(row["verl_cppack"]["host_syncs"] == 1 for row in rows)
    assert rows[0]["verl_cppack"]["aten_ops"] == rows[1]["verl_cppack"]["aten_ops"]
    assert rows[0]["verl"]["aten_ops"] < rows[1]["verl"]["aten_ops"]
    for row in rows:
        assert row["padding_overhead"]["default"] >= 1.0
        assert row["load_balance"]["zigzag"] >= 1.0


def test_report_files_and_readme_section(rows, tmp_path):
    paths = write_outputs(rows, BenchSettings(repeats=1), tmp_path)
    assert paths["table"].read_text().count("\n") == 2 + len(rows)
    readme = tmp_path / "README.md"
    readme.write_text(f"# title\n{SECTION_BEGIN}\nold\n{SECTION_END}\ntail\n")
    update_generated_section(readme, performance_section(rows, BenchSettings(repeats=1), None))
    text = readme.read_text()
    assert "old" not in text and text.endswith(f"{SECTION_END}\ntail\n") and "| 64 | 2 | 8 |" in text


def test_the_vlm_mask_builders_are_measured_at_cp_1():
    """At CP=1 each point also times verl's VLM mask builders against the drop-ins: verl_cppack's ATen ops do not
    grow with B and it reads the host once per call; verl's reads grow with B. Its table follows the main one."""
    vlm_rows = run_benchmark(
        BenchSettings(batch_sizes=(8, 32), seq_lens=(64,), cp_sizes=(1,), repeats=1, runs=2, warmup=0)
    )
    for builder in ("thd", "bshd"):
        small, large = (row["vlm_masks"][builder] for row in vlm_rows)
        assert small["verl_cppack"]["aten_ops"] == large["verl_cppack"]["aten_ops"]
        assert small["verl_cppack"]["host_syncs"] == large["verl_cppack"]["host_syncs"] == 1
        assert small["verl"]["host_syncs"] < large["verl"]["host_syncs"]
    section = performance_section(vlm_rows, BenchSettings(repeats=1), None)
    assert "VLM mask builders" in section and "| 64 | 32 |" in section


def test_times_of_several_runs_are_their_medians_and_counts_come_from_the_first():
    from verl_cppack.bench.measure import _median_over_runs

    def run(scale):
        times = {"preprocess_ms": 1.0 * scale, "postprocess_ms": 2.0 * scale, "step_ms": 3.0 * scale, "aten_ops": 51}
        return {
            "batch_size": 8,
            "verl": dict(times),
            "verl_cppack": dict(times),
            "preprocess_copies_ms": scale,
            "pack_over_index_select": scale,
        }

    slower_verl = run(4.0)
    slower_verl["verl"]["preprocess_ms"] = 12.0
    row = _median_over_runs((run(1.0), slower_verl, run(2.0)))
    assert row["runs"] == 3 and row["verl"]["preprocess_ms"] == 2.0 and row["verl_cppack"]["step_ms"] == 6.0
    assert row["preprocess_ratio_by_run"] == [1.0, 3.0, 1.0]  # each run's own verl / verl_cppack
    assert row["preprocess_copies_ms"] == 2.0 and row["pack_over_index_select"] == 2.0
    assert row["verl"]["aten_ops"] == 51


def test_bad_device_settings_are_refused_before_any_process_starts():
    with pytest.raises(ValueError, match="'cpu' or 'cuda'"):
        BenchSettings(device="tpu").check()
    if torch.cuda.device_count() < 4:
        with pytest.raises(ValueError, match="one GPU per CP rank"):
            BenchSettings(device="cuda").check()


def test_the_bench_can_keep_freed_host_memory_on_glibc():
    import platform

    from verl_cppack.bench.host_allocator import keep_freed_memory

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("mallopt is glibc's")
    assert keep_freed_memory() is True


def test_cli_runs_the_sizes_it_is_given_and_refuses_bad_lists(tmp_path, capsys):
    """`--batch-sizes/--seq-lens/--cp-sizes` pick the grid (one GPU can run `--cp-sizes 1`); a bad list, a negative
    warm-up or no run is an error before any process starts."""
    from verl_cppack.cli import main

    assert main(["bench", "--cp-sizes", "1,two"]) == 2
    assert "comma-separated integers" in capsys.readouterr().err
    assert main(["bench", "--seq-lens", "0"]) == 2
    assert "positive ints" in capsys.readouterr().err
    assert main(["bench", "--warmup", "-1"]) == 2
    assert "warmup must be >= 0, got -1" in capsys.readouterr().err
    assert main(["bench", "--runs", "0"]) == 2
    assert "runs must be >= 1, got 0" in capsys.readouterr().err
    argv = ["bench", "--batch-sizes", "8", "--seq-lens", "64", "--cp-sizes", "1", "--repeats", "1", "--warmup", "0"]
    argv += ["--runs", "1"]
    argv += ["--output", str(tmp_path)]
    assert main(argv) == 0
    rows = __import__("json").loads((tmp_path / "results.json").read_text())["rows"]
    assert [(row["batch_size"], row["seq_len"], row["cp_size"]) for row in rows] == [(8, 64, 1)]


def test_update_docs_writes_the_plot_beside_the_document_it_links_from(tmp_path):
    """With `--update-docs` and no `--output`, results land in `benchmarks/` beside `--doc`, so the link in the
    regenerated section points at a file committed with the document (not at an ignored `bench_out/`)."""
    from verl_cppack.cli import main

    document = tmp_path / "docs" / "performance.md"
    document.parent.mkdir()
    document.write_text(f"# performance\n{SECTION_BEGIN}\nold\n{SECTION_END}\n")
    argv = ["bench", "--batch-sizes", "8", "--seq-lens", "64", "--cp-sizes", "1", "--repeats", "1", "--warmup", "0"]
    argv += ["--runs", "1", "--update-docs", "--doc", str(document)]
    assert main(argv) == 0
    assert (tmp_path / "docs" / "benchmarks" / "results.json").is_file()
    text = document.read_text()
    assert "| 64 | 1 | 8 |" in text
    if (tmp_path / "docs" / "benchmarks" / "speedup.png").is_file():
        assert "![speed-up](benchmarks/speedup.png)" in text
    assert not (tmp_path / "bench_out").exists()


def test_a_missing_document_or_an_output_that_is_a_file_is_refused_before_measuring(tmp_path, capsys, monkeypatch):
    """`--update-docs` with a `--doc` that is missing or has no markers, or an `--output` that is a file: one
    error line and exit 2 before any process starts (not a traceback after minutes of measuring)."""
    from verl_cppack.cli import bench, main

    monkeypatch.setattr(bench, "run_benchmark", lambda settings: pytest.fail("measured before checking its input"))
    assert main(["bench", "--quick", "--update-docs", "--doc", str(tmp_path / "missing.md")]) == 2
    assert "cannot read" in capsys.readouterr().err
    (tmp_path / "plain.md").write_text("# no markers\n")
    assert main(["bench", "--quick", "--update-docs", "--doc", str(tmp_path / "plain.md")]) == 2
    assert "has no performance markers" in capsys.readouterr().err
    (tmp_path / "a_file").write_text("x")
    assert main(["bench", "--quick", "--output", str(tmp_path / "a_file")]) == 2
    assert "cannot be a results folder" in capsys.readouterr().err
    assert (tmp_path / "a_file").read_text() == "x"
