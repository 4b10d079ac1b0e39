"""The benchmarks written for a GPU session, everything but the GPU run here.

``benchmarks/cuda_syncs.py`` (CUDA's own sync counts, verl against the drop-ins) refuses to count without CUDA, finds
every kind of difference from verl's results, and on the CPU finds the drop-ins' results equal to verl's at CP 1 and 2
(syncs left uncounted). ``benchmarks/profile_unit.py`` (torch.profiler over the bench's unit) refuses CUDA where there
is none and profiles both implementations on the CPU, legacy and engine units."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.benchmark_scripts import BENCHMARKS, load_script

SCRIPT = BENCHMARKS / "cuda_syncs.py"
PROFILE = BENCHMARKS / "profile_unit.py"


def _script():
    return load_script("cuda_syncs")


def _result(packed=None, outputs=None, **fields):
    params = {name: torch.tensor([0, 4, 8], dtype=torch.int32) for name in _script().PARAMS_FIELDS}
    params["max_seqlen_q"] = 4
    params.update(fields)
    packed = torch.arange(8).view(1, 8) if packed is None else packed
    outputs = [torch.ones(2, 4), torch.zeros(2, 4)] if outputs is None else outputs
    return packed, SimpleNamespace(**params), outputs


def test_every_kind_of_difference_from_verl_is_found():
    differences = _script()._differences
    assert differences(_result(), _result()) == []
    assert differences(_result(), _result(packed=torch.arange(8).view(1, 8).int())) == ["packed input_ids"]
    assert differences(_result(), _result(cu_seqlens_q_padded=torch.tensor([0, 4, 12]))) == [
        "PackedSeqParams.cu_seqlens_q_padded"
    ]
    assert differences(_result(), _result(max_seqlen_q=5)) == ["PackedSeqParams.max_seqlen_q"]
    changed = [torch.ones(2, 4), torch.zeros(2, 4, dtype=torch.float64)]
    assert differences(_result(), _result(outputs=changed)) == ["gathered output 1"]

    def jagged(values, offsets):
        return torch.nested.nested_tensor_from_jagged(torch.tensor(values), offsets=torch.tensor(offsets))

    engine = [jagged([1.0, 2.0, 3.0], [0, 1, 3]), jagged([4.0, 5.0, 6.0], [0, 1, 3])]
    assert differences(_result(outputs=engine), _result(outputs=list(engine))) == []
    other_values = [engine[0], jagged([4.0, 5.0, 7.0], [0, 1, 3])]
    other_offsets = [jagged([1.0, 2.0, 3.0], [0, 2, 3]), engine[1]]
    assert differences(_result(outputs=engine), _result(outputs=other_values)) == ["gathered output 1"]
    assert differences(_result(outputs=engine), _result(outputs=other_offsets)) == ["gathered output 0"]
    assert differences(_result(outputs=engine), _result(outputs=[torch.ones(3), engine[1]])) == ["gathered output 0"]


@pytest.mark.parametrize(
    "script, argv, message",
    [
        ("cuda_syncs", ["--batch-sizes", "1,x"], "--batch-sizes takes comma-separated integers like 1,2,4; got '1,x'"),
        ("cuda_syncs", ["--seq-lens", "1"], "seq_lens must be >= 2 (a prompt half and a response half), got [1]"),
        ("cuda_syncs", ["--cp-sizes", "0"], "cp_sizes must be a non-empty tuple of positive ints, got (0,)"),
        ("cuda_syncs", ["--output", "/no/such/folder/x.json"], "--output /no/such/folder/x.json must name a file in"),
        ("profile_unit", ["--seq-len", "1"], "--seq-len must be >= 2, got 1"),
        ("profile_unit", ["--rows", "0"], "--rows must be >= 1, got 0"),
        ("profile_unit", ["--sort", "device_time_total"], "--sort device_time_total needs --device cuda"),
    ],
)
def test_bad_arguments_get_one_error_line_and_exit_2_before_any_process(script, argv, message, monkeypatch, capsys):
    module = load_script(script)
    monkeypatch.setattr(module, "run_world", lambda *args, **kwargs: pytest.fail("a process was started"))
    monkeypatch.setattr(sys, "argv", [f"{script}.py", "--device", "cpu", *argv])
    assert module.main() == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"error: {message}")


def test_a_trace_path_that_is_a_file_is_refused(monkeypatch, capsys, tmp_path):
    module = load_script("profile_unit")
    monkeypatch.setattr(module, "run_world", lambda *args, **kwargs: pytest.fail("a process was started"))
    (tmp_path / "a_file").write_text("")
    monkeypatch.setattr(sys, "argv", ["profile_unit.py", "--device", "cpu", "--trace", str(tmp_path / "a_file")])
    assert module.main() == 2
    assert capsys.readouterr().err == f"error: --trace {tmp_path / 'a_file'} is a file; give a folder for the traces\n"


@pytest.mark.slow
def test_without_cuda_it_exits_2_with_one_error_line():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    result = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith("error: cuda_syncs.py counts CUDA's own syncs") and result.stderr.count("\n") == 1


@pytest.mark.slow
@pytest.mark.parametrize("functions", ["legacy", "engine"])
def test_on_the_cpu_the_drop_ins_equal_verl_at_cp_1_and_2(functions, tmp_path):
    output = tmp_path / "syncs.json"
    command = [sys.executable, str(SCRIPT), "--device", "cpu", "--functions", functions, "--batch-sizes", "1,3"]
    command += ["--seq-lens", "64"]
    result = subprocess.run([*command, "--output", str(output)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(output.read_text())
    assert report["all_equal_to_verl"] is True and report["functions"] == functions
    assert [(r["cp_size"], r["batch_size"]) for r in report["rows"]] == [(1, 1), (1, 3), (2, 1), (2, 3)]
    assert all(r["verl_cppack"]["preprocess_syncs"] is None for r in report["rows"])  # not countable on a CPU


@pytest.mark.slow
def test_the_profile_refuses_cuda_where_there_is_none():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    result = subprocess.run([sys.executable, str(PROFILE)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and result.stderr.startswith("error: --device cuda needs a CUDA GPU")


@pytest.mark.slow
@pytest.mark.parametrize("functions", ["legacy", "engine"])
def test_the_profile_tables_both_implementations_on_the_cpu(functions, tmp_path):
    command = [sys.executable, str(PROFILE), "--device", "cpu", "--functions", functions, "--batch-size", "2"]
    command += ["--seq-len", "64", "--repeats", "2", "--trace", str(tmp_path)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    for name in ("verl", "verl_cppack"):
        assert f"== {name}, {functions} unit, B=2 S=64, 2 micro-batches" in result.stdout
        assert (tmp_path / f"{name}_{functions}.json").is_file()
    assert result.stdout.count("preprocess") >= 2 and result.stdout.count("postprocess") >= 2


@pytest.mark.slow
def test_verl_util_alone_loads_verls_own_file_without_ray(tmp_path):
    """``benchmarks/verl_util_alone`` (how the GPU figures loaded verl's util where Ray is absent): verl's file, from
    the folder given, with Ray, tensordict and verl's package ``__init__`` left out; nothing without VERL_SITE."""
    site = Path(importlib.util.find_spec("verl").submodule_search_locations[0]).parent
    shim = Path(__file__).resolve().parents[1] / "benchmarks" / "verl_util_alone"
    code = (
        "import sys, verl.models.mcore.util as u; "
        "print(u.__file__); print(sorted(m for m in ('ray', 'tensordict') if m in sys.modules)); "
        "print(hasattr(sys.modules['verl'], 'DataProto'), callable(u.preprocess_packed_seqs))"
    )
    environment = {"PYTHONPATH": f"{shim}:{Path(__file__).resolve().parents[1]}", "VERL_SITE": str(site)}
    result = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **environment},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.splitlines()[-3:] == [str(site / "verl" / "models" / "mcore" / "util.py"), "[]", "False True"]
