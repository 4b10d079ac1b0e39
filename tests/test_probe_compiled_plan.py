"""``benchmarks/probe_compiled_plan.py``, the measurement behind the compiled-plan decision in docs/performance.md:
it refuses bad sizes before any process starts, and its compiled build packs exactly what the drop-in packs (the
probe checks that itself before it times anything; a build that differed would end the run with an error)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

PROBE = Path(__file__).resolve().parents[1] / "benchmarks" / "probe_compiled_plan.py"


def _probe():
    spec = importlib.util.spec_from_file_location("probe_compiled_plan", PROBE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("flag", ["--batch-size", "--seq-len", "--cp", "--repeats"])
def test_bad_sizes_are_refused_before_any_process_starts(flag, monkeypatch, capsys):
    probe = _probe()
    monkeypatch.setattr(probe, "run_world", lambda *args, **kwargs: pytest.fail("a process was started"))
    monkeypatch.setattr(sys, "argv", ["probe_compiled_plan.py", flag, "0"])
    with pytest.raises(SystemExit) as exited:
        probe.main()
    assert exited.value.code == 2
    assert capsys.readouterr().err.strip() == f"error: {flag} must be >= 1, got 0"


@pytest.mark.slow  # a subprocess with gloo processes and a numba compilation
@pytest.mark.parametrize("cp_size, batch_size", [(1, 3), (2, 1), (2, 4)])
def test_the_compiled_build_packs_what_the_drop_in_packs(cp_size, batch_size):
    pytest.importorskip("numba")
    sizes = ["--batch-size", str(batch_size), "--seq-len", "256", "--cp", str(cp_size), "--repeats", "2"]
    done = subprocess.run(
        [sys.executable, str(PROBE), *sizes], capture_output=True, text=True, timeout=600, cwd=PROBE.parents[1]
    )
    # a build that packed another stream than the drop-in in any of the 20 checked micro-batches fails the run
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0].startswith(f"B={batch_size} S=256 CP={cp_size}: first preprocess call")
    assert [line.split()[0] for line in lines[1:]] == ["verl", "drop-in", "compiled", "compiled"]
