"""`verl-cppack bench` smoke run: it runs verl, verl_cppack and the floor in a real CP group and writes its report.

Only counts and values are asserted (never times): verl_cppack makes one host sync per micro-batch and the same
ATen op count for B=8 and B=32, verl's op count grows with B, and the floors move exactly the bytes verl's own
functions move. The tests that start gloo processes are marked slow; the rest run in the fast lane.
"""

import argparse

import pytest
import torch

from verl_cppack.bench.measure import median_over_runs, run_benchmark
from verl_cppack.bench.report import (
    SECTION_BEGIN,
    SECTION_END,
    SECTIONS,
    performance_section,
    update_generated_section,
    write_outputs,
)
from verl_cppack.bench.settings import BenchSettings


def _needs_verl_and_megatron():
    pytest.importorskip("verl")
    pytest.importorskip("megatron.core")


@pytest.fixture(scope="module")
def rows():
    _needs_verl_and_megatron()
    return run_benchmark(BenchSettings(batch_sizes=(8, 32), seq_lens=(64,), cp_sizes=(2,), repeats=1, runs=2, warmup=1))


@pytest.mark.slow  # gloo processes
def test_counts(rows):
    assert [row["batch_size"] for row in rows] == [8, 32]
    assert all(row["runs"] == 2 for row in rows)
    assert all(row["verl_cppack"]["host_syncs"] == 1 for row in rows)
    assert rows[0]["verl_cppack"]["aten_ops"] == rows[1]["verl_cppack"]["aten_ops"]
    assert rows[0]["verl"]["aten_ops"] < rows[1]["verl"]["aten_ops"]
    for row in rows:
        assert row["floor"]["host_syncs"] == 0
        assert row["floor"]["ops"]["aten.index_select"] == 3  # three packed tensors
        assert row["floor"]["ops"]["aten.scatter_"] == 2  # two outputs
        assert sum(n for op, n in row["floor"]["ops"].items() if op.startswith("c10d.")) == 2  # two all-gathers
        assert row["floor"]["preprocess_ms"] > 0 and row["floor"]["all_gathers_ms"] > 0


@pytest.mark.slow  # gloo processes
def test_report_files_and_readme_section(rows, tmp_path):
    paths = write_outputs(rows, BenchSettings(repeats=1), tmp_path, {"load_before": 0.5, "load_after": 1.5})
    table = paths["table"].read_text()
    assert "| 64 | 2 | 8 |" in table and "| 64 | 2 | 32 |" in table
    readme = tmp_path / "README.md"
    readme.write_text(f"# title\n{SECTION_BEGIN}\nold\n{SECTION_END}\ntail\n")
    section = performance_section(rows, BenchSettings(repeats=1), None, {"load_before": 0.5, "load_after": 1.5})
    update_generated_section(readme, section)
    text = readme.read_text()
    assert "old" not in text and text.endswith(f"{SECTION_END}\ntail\n") and "| 64 | 2 | 8 |" in text
    assert "new batch" in text and "0.5 at the start, 1.5 at the end" in text
    linked = performance_section(rows, BenchSettings(repeats=1), None, None, "benchmarks/table.md")
    assert "[table.md](benchmarks/table.md)" in linked and "| 64 | 2 | 8 |" not in linked  # every row in the file


def _floors_against_verl(rank, world_size):
    """On every rank: the floors' packed ids and gathered outputs against verl's own functions, on one batch."""
    from megatron.core import parallel_state
    from verl.models.mcore import util as verl_util

    from verl_cppack.bench.batches import EngineMicroBatch, micro_batch
    from verl_cppack.bench.floors import (
        engine_floor_index,
        engine_postprocess_floor,
        engine_preprocess_floor,
        floor_index,
        postprocess_floor,
        preprocess_floor,
    )

    parallel_state.initialize_model_parallel(context_parallel_size=world_size)
    try:
        batch = micro_batch(5, 40, seed=3)
        mask = batch.attention_mask
        index = floor_index(verl_util, mask, world_size, rank)
        verl_ids, params = verl_util.preprocess_packed_seqs(batch.input_ids, mask, pre_process=True)
        floor_ids = preprocess_floor(batch, index)
        real_slots = verl_util.preprocess_packed_seqs(mask.long(), mask, pre_process=True)[0].bool()  # [1, T_local]
        output = torch.randn(verl_ids.shape, generator=torch.Generator().manual_seed(rank))
        verl_full = verl_util.postprocess_packed_seqs(output, params, mask, *mask.shape)
        (floor_full,) = postprocess_floor(
            (output,), index, tuple(mask.shape), parallel_state.get_context_parallel_group()
        )
        engine = EngineMicroBatch.of(batch)
        engine_index = engine_floor_index(verl_util, engine, world_size, rank)
        verl_packed, engine_params, _ = verl_util.preprocess_thd_engine(engine.input_ids, pre_process=True)
        verl_labels = verl_util.preprocess_thd_engine(engine.labels, pre_process=True, need_roll=True)[0]
        engine_real = verl_util.preprocess_thd_engine(
            torch.nested.nested_tensor_from_jagged(
                torch.ones_like(engine.input_ids.values()), engine.input_ids.offsets()
            ),
            pre_process=True,
        )[0].bool()  # [1, T_local]
        floor_packed = engine_preprocess_floor(engine, engine_index)
        floor_labels = engine.labels.values().index_select(0, engine_index.pack_rolled).unsqueeze(0)
        offsets = engine.input_ids.offsets()
        numbered = torch.nested.nested_tensor_from_jagged(torch.arange(1, offsets[-1] + 1), offsets=offsets)
        rolled_real = verl_util.preprocess_thd_engine(numbered, pre_process=True, need_roll=True)[0] > 0  # [1, T_local]
        engine_output = torch.randn(verl_packed.shape, generator=torch.Generator().manual_seed(rank))
        verl_values = verl_util.postprocess_thd_engine(engine_output, engine_params, engine.input_ids, 5).values()
        group = parallel_state.get_context_parallel_group()
        (floor_values,) = engine_postprocess_floor((engine_output,), engine_index, group)
        return {
            "shape": floor_ids.shape == verl_ids.shape,
            "packed": torch.equal(floor_ids[real_slots], verl_ids[real_slots]),
            "gathered": torch.equal(floor_full, verl_full),  # zeros off the mask too
            "engine packed": torch.equal(floor_packed[engine_real], verl_packed[engine_real]),
            "engine labels": torch.equal(floor_labels[rolled_real], verl_labels[rolled_real]),
            "engine gathered": torch.equal(floor_values, verl_values),
        }
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.slow  # gloo processes
@pytest.mark.parametrize("cp_size", [1, 2])
def test_the_floors_move_the_bytes_verl_moves(cp_size):
    """The floor's packed ids equal verl's on every real slot (its padding slots read any element), and its
    postprocess output equals verl's ``[B, S]`` on the mask, and at CP=2 exactly (zeros off the mask included); the
    engine path's floors likewise (labels rolled as verl rolls them, jagged outputs exactly)."""
    _needs_verl_and_megatron()
    from verl_cppack.runtime.gloo_world import run_world

    for result in run_world(_floors_against_verl, cp_size):
        assert all(result.values()), result


@pytest.mark.slow  # gloo processes
def test_the_vlm_mask_builders_are_measured_at_cp_1():
    """At CP=1 each point also times verl's VLM mask builders against the drop-ins: verl_cppack's ATen ops do not
    grow with B and it reads the host once per call; verl's reads grow with B. Its table follows the main one."""
    _needs_verl_and_megatron()
    vlm_rows = run_benchmark(
        BenchSettings(batch_sizes=(8, 32), seq_lens=(64,), cp_sizes=(1,), repeats=1, runs=2, warmup=0)
    )
    for builder in ("thd", "bshd"):
        small, large = (row["vlm_masks"][builder] for row in vlm_rows)
        assert small["verl_cppack"]["aten_ops"] == large["verl_cppack"]["aten_ops"]
        assert small["verl_cppack"]["host_syncs"] == large["verl_cppack"]["host_syncs"] == 1
        assert small["verl"]["host_syncs"] < large["verl"]["host_syncs"]
        assert small["verl"]["ms_spread"] == 0.0  # one timed call per run: no spread (the noise --strict allows)
    section = performance_section(vlm_rows, BenchSettings(repeats=1), None)
    assert "VLM mask builders" in section and "| 64 | 32 |" in section


def test_times_of_several_runs_are_their_medians_and_counts_come_from_the_first():
    def run(scale):
        times = {"preprocess_ms": 1.0 * scale, "postprocess_ms": 2.0 * scale, "step_ms": 3.0 * scale, "aten_ops": 51}
        times.update(preprocess_spread=0.1 * scale, postprocess_spread=0.05 * scale)  # verl's own noise, per run
        return {
            "batch_size": 8,
            "verl": dict(times),
            "verl_cppack": dict(times),
            "floor": {**times, "all_gathers_ms": scale},
        }

    slower_verl = run(4.0)
    slower_verl["verl"]["preprocess_ms"] = 12.0
    row = median_over_runs((run(1.0), slower_verl, run(2.0)))
    assert row["runs"] == 3 and row["verl"]["preprocess_ms"] == 2.0 and row["verl_cppack"]["step_ms"] == 6.0
    assert row["ratio_by_run"]["preprocess"] == [1.0, 3.0, 1.0]  # each run's own verl / verl_cppack
    assert row["ratio_by_run"]["postprocess"] == [1.0, 1.0, 1.0]
    assert row["floor"]["all_gathers_ms"] == 2.0 and row["floor"]["preprocess_ms"] == 2.0
    assert row["verl"]["aten_ops"] == 51
    assert row["verl"]["preprocess_spread"] == 0.2 and row["verl"]["postprocess_spread"] == 0.1  # medians too


def test_every_micro_batch_is_a_new_batch_with_new_lengths():
    """No two micro-batches of a point share a tensor or, here, their lengths; a clone shares values, not storage."""
    from verl_cppack.bench.batches import batch_seed, micro_batch

    batches = [micro_batch(4, 64, seed=batch_seed(4, 64, index)) for index in range(3)]
    lengths = [tuple(batch.attention_mask.sum(1).tolist()) for batch in batches]
    assert len(set(lengths)) == 3
    clone = batches[0].clone()
    for original, copied in zip(batches[0].tensors, clone.tensors):
        assert torch.equal(original, copied) and original.data_ptr() != copied.data_ptr()
    assert torch.equal(batches[0].labels[:, :-1], batches[0].input_ids[:, 1:])
    assert not (batches[0].label_mask & ~batches[0].attention_mask).any()


def test_bad_settings_are_refused_before_any_process_starts():
    with pytest.raises(ValueError, match="'cpu' or 'cuda'"):
        BenchSettings(device="tpu").check()
    with pytest.raises(ValueError, match="threads must be an int >= 1, got 0"):
        BenchSettings(threads=0).check()
    if torch.cuda.device_count() < 4:
        with pytest.raises(ValueError, match="one GPU per CP rank"):
            BenchSettings(device="cuda").check()


def test_the_default_grid_is_the_batch_sizes_cp_users_run():
    settings = BenchSettings()
    assert settings.batch_sizes == (1, 4, 16, 64, 256)
    assert settings.seq_lens == (1024, 4096, 8192) and settings.cp_sizes == (1, 2, 4) and settings.runs == 5


def test_the_bench_can_keep_freed_host_memory_on_glibc():
    import platform

    from verl_cppack.bench.host_allocator import keep_freed_memory

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("mallopt is glibc's")
    assert keep_freed_memory() is True


def test_cli_refuses_bad_lists_before_any_process_starts(capsys, monkeypatch):
    from verl_cppack.cli import bench, main

    monkeypatch.setattr(bench, "run_benchmark", lambda settings: pytest.fail("measured before checking its input"))
    assert main(["bench", "--cp-sizes", "1,two"]) == 2
    assert "comma-separated integers" in capsys.readouterr().err
    assert main(["bench", "--seq-lens", "0"]) == 2
    assert "positive ints" in capsys.readouterr().err
    assert main(["bench", "--warmup", "-1"]) == 2
    assert "warmup must be an int >= 0, got -1" in capsys.readouterr().err
    assert main(["bench", "--runs", "0"]) == 2
    assert "runs must be an int >= 1, got 0" in capsys.readouterr().err


@pytest.mark.slow  # gloo processes
def test_cli_runs_the_sizes_it_is_given(tmp_path):
    """`--batch-sizes/--seq-lens/--cp-sizes` pick the grid (one GPU can run `--cp-sizes 1`)."""
    from verl_cppack.cli import main

    _needs_verl_and_megatron()
    argv = ["bench", "--batch-sizes", "8", "--seq-lens", "64", "--cp-sizes", "1", "--repeats", "1", "--warmup", "0"]
    argv += ["--runs", "1", "--output", str(tmp_path)]
    assert main(argv) == 0
    results = __import__("json").loads((tmp_path / "results.json").read_text())
    assert [(row["batch_size"], row["seq_len"], row["cp_size"]) for row in results["rows"]] == [(8, 64, 1)]
    assert results["machine"]["wall_s"] > 0 and "load_before" in results["machine"]


@pytest.mark.slow  # gloo processes
def test_update_docs_writes_the_plot_beside_the_document_it_links_from(tmp_path):
    """With `--update-docs` and no `--output`, results land in `benchmarks/` beside `--doc`, so the link in the
    regenerated section points at a file committed with the document (not at an ignored `bench_out/`)."""
    from verl_cppack.cli import main

    _needs_verl_and_megatron()
    document = tmp_path / "docs" / "performance.md"
    document.parent.mkdir()
    document.write_text(f"# performance\n{SECTION_BEGIN}\nold\n{SECTION_END}\n")
    argv = ["bench", "--batch-sizes", "8", "--seq-lens", "64", "--cp-sizes", "1", "--repeats", "1", "--warmup", "0"]
    argv += ["--runs", "1", "--update-docs", "--doc", str(document)]
    assert main(argv) == 0
    assert (tmp_path / "docs" / "benchmarks" / "results.json").is_file()
    text = document.read_text()
    assert "[table.md](benchmarks/table.md)" in text  # every point's row, in the file the section links
    assert "| 64 | 1 | 8 |" in (tmp_path / "docs" / "benchmarks" / "table.md").read_text()
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
    legacy_only = tmp_path / "legacy.md"
    legacy_only.write_text(f"{SECTION_BEGIN}\nkept\n{SECTION_END}\n")
    assert main(["bench", "--quick", "--functions", "engine", "--update-docs", "--doc", str(legacy_only)]) == 2
    assert "no performance markers for --functions engine" in capsys.readouterr().err
    assert "kept" in legacy_only.read_text()
    (tmp_path / "a_file").write_text("x")
    assert main(["bench", "--quick", "--output", str(tmp_path / "a_file")]) == 2
    assert "cannot be a results folder" in capsys.readouterr().err
    assert (tmp_path / "a_file").read_text() == "x"


def test_each_function_family_has_its_own_generated_section(tmp_path):
    """An engine run rewrites the engine section alone, a legacy run the legacy one; each keeps its results folder."""
    from verl_cppack.cli.bench import output_folder

    engine_begin, engine_end = SECTIONS["engine"]
    document = tmp_path / "performance.md"
    document.write_text(f"{SECTION_BEGIN}\nlegacy\n{SECTION_END}\nprose\n{engine_begin}\nengine\n{engine_end}\n")
    update_generated_section(document, "new engine figures", "engine")
    assert document.read_text() == (
        f"{SECTION_BEGIN}\nlegacy\n{SECTION_END}\nprose\n{engine_begin}\nnew engine figures\n{engine_end}\n"
    )
    update_generated_section(document, "new legacy figures")
    assert "new legacy figures" in document.read_text() and "new engine figures" in document.read_text()
    args = argparse.Namespace(output=None, update_docs=True, doc=str(document), functions="engine")
    assert output_folder(args) == tmp_path / "benchmarks" / "engine"
    assert output_folder(argparse.Namespace(**{**vars(args), "functions": "legacy"})) == tmp_path / "benchmarks"
