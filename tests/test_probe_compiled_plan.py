"""``benchmarks/probe_compiled_plan.py``, the measurement behind the compiled-plan decision in docs/performance.md:
it refuses bad sizes before any process starts, and its compiled build packs exactly what the drop-in packs (the
probe checks that itself before it times anything; a build that differed would end the run with an error)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.benchmark_scripts import BENCHMARKS, load_script

PROBE = BENCHMARKS / "probe_compiled_plan.py"


def _probe():
    return load_script("probe_compiled_plan")


@pytest.mark.parametrize("flag", ["--batch-size", "--seq-len", "--cp", "--repeats"])
def test_bad_sizes_are_refused_before_any_process_starts(flag, monkeypatch, capsys):
    probe = _probe()
    monkeypatch.setattr(probe, "run_world", lambda *args, **kwargs: pytest.fail("a process was started"))
    monkeypatch.setattr(sys, "argv", ["probe_compiled_plan.py", flag, "0"])
    with pytest.raises(SystemExit) as exited:
        probe.main()
    assert exited.value.code == 2
    minimum = 2 if flag == "--seq-len" else 1  # a rollout batch has a prompt half and a response half
    assert capsys.readouterr().err.strip() == f"error: {flag} must be >= {minimum}, got 0"


def test_a_sequence_too_short_for_a_rollout_batch_is_refused(monkeypatch, capsys):
    probe = _probe()
    monkeypatch.setattr(probe, "run_world", lambda *args, **kwargs: pytest.fail("a process was started"))
    monkeypatch.setattr(sys, "argv", ["probe_compiled_plan.py", "--seq-len", "1"])
    with pytest.raises(SystemExit) as exited:
        probe.main()
    assert exited.value.code == 2
    assert capsys.readouterr().err.strip() == "error: --seq-len must be >= 2, got 1"


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
    rows = ["verl", "drop-in", "straight-line", "compiled", "compiled", "copy"]
    assert [line.split()[0] for line in lines[1:]] == rows
