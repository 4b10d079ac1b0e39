"""``verl-cppack verify-gpu``, everything around the GPU: refusal without CUDA, and each check on the CPU with
stand-ins for what needs a GPU (Transformer Engine's index function, the sync counter, the bench and verify-cp
subprocesses)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.oracle import te_partitioned_indices
from verl_cppack.cli import verify_gpu

CPU = torch.device("cpu")


def te_stand_in(cu_seqlens_padded: torch.Tensor, total: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Transformer Engine's kernel, token by token (``tests.oracle``), with TE's signature."""
    return torch.tensor(te_partitioned_indices(cu_seqlens_padded.tolist(), total, cp_size, cp_rank), dtype=torch.int32)


def test_without_cuda_it_exits_2_with_one_error_line(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code = verify_gpu.run(argparse.Namespace(output=str(tmp_path / "report.json")))
    captured = capsys.readouterr()
    assert code == 2 and captured.out == ""
    [line] = captured.err.splitlines()
    assert line.startswith("error: verify-gpu needs a CUDA GPU") and not (tmp_path / "report.json").exists()


def test_an_output_that_is_a_directory_is_refused_first(tmp_path, capsys):
    assert verify_gpu.run(argparse.Namespace(output=str(tmp_path))) == 2
    assert capsys.readouterr().err.startswith("error: --output")


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the command would run every GPU check")
def test_the_command_without_cuda_exits_2():
    result = subprocess.run(
        [sys.executable, "-m", "verl_cppack.cli", "verify-gpu"], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 2 and result.stdout == ""
    assert [line for line in result.stderr.splitlines() if line.startswith("error:")] == [
        result.stderr.strip().splitlines()[-1]
    ]


def test_an_unknown_argument_is_refused_before_anything_runs(capsys):
    from verl_cppack.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["verify-gpu", "--cp", "2"])
    assert exit_info.value.code == 2 and "unrecognized arguments: --cp 2" in capsys.readouterr().err


def test_the_checked_masks_hold_a_1_token_row_and_rows_with_gaps():
    mask = verify_gpu._random_mask(torch.Generator().manual_seed(0), batch=32, seq_len=24)
    lengths = mask.sum(1)
    assert lengths[0] == 1 and (lengths >= 1).all() and (lengths > 3).any()
    assert ((mask.int().diff(dim=1) == 1).sum(1) >= 2).any()  # some row starts a run of tokens twice: a gap


def test_the_zigzag_check_passes_against_a_port_of_transformer_engines_kernel():
    """The check itself, on the CPU: ``tests.oracle``'s token-by-token port of TE's partitioner stands in for TE."""
    report = verify_gpu.check_zigzag(CPU, te_stand_in)
    assert report["ok"] is True and report["compared"] > 300


def test_the_zigzag_index_agrees_with_transformer_engines_kernel():
    """Transformer Engine's own ``thd_get_partitioned_indices`` (a CUDA kernel): skipped where it is not installed."""
    te_indices = verify_gpu.transformer_engine_indices()
    if te_indices is None or not torch.cuda.is_available():
        pytest.skip("needs transformer_engine_torch and CUDA")
    report = verify_gpu.check_zigzag(torch.device("cuda"), te_indices)
    assert report["ok"] is True and report["compared"] > 300


def test_a_zigzag_difference_is_reported_with_its_case():
    def off_by_one(cu, total, cp_size, cp_rank):
        indices = te_stand_in(cu, total, cp_size, cp_rank)
        return indices + (cp_size == 3)

    report = verify_gpu.check_zigzag(CPU, off_by_one)
    assert report["ok"] is False and report["first_difference"]["cp_size"] == 3


def test_without_transformer_engine_the_zigzag_check_is_skipped():
    assert verify_gpu.check_zigzag(CPU, None) == {"ok": None, "skipped": "transformer_engine_torch is not installed"}


def test_plans_and_packing_on_a_device_are_compared_with_the_cpu():
    report = verify_gpu.check_cuda_equals_cpu(CPU)  # the CPU against itself: the comparison runs, finds nothing
    assert report["ok"] is True and report["compared"] > 500 and report["differences"] == []


def test_host_syncs_are_held_to_one_for_the_plan_and_none_for_its_reuse():
    calls = []

    def counter(step, device):
        step()
        calls.append(step.__name__)
        return {"plan": 1, "reuse": 0}[step.__name__]

    report = verify_gpu.check_host_syncs(CPU, counter)
    assert report == {
        "ok": True,
        "counts": {"plan": 1, "pack_and_unpack": 0},
        "limits": {"plan": 1, "pack_and_unpack": 0},
    }
    assert calls == ["plan", "reuse"]
    too_many = verify_gpu.check_host_syncs(CPU, lambda step, device: (step(), 2)[1])
    assert too_many["ok"] is False
    assert verify_gpu.check_host_syncs(CPU)["ok"] is None  # not countable on a CPU


def test_the_sync_counter_counts_torchs_sync_warnings(monkeypatch):
    """``count_host_syncs`` counts the warnings ``set_sync_debug_mode("warn")`` raises for synchronizing operations
    (a CUDA stand-in here), not torch's notice about the mode itself (an H200 run counted it as a second sync)."""
    modes = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)

    def two_syncs():
        import warnings

        notice = "Synchronization debug mode is a prototype feature and does not yet detect all synchronizing ops"
        warnings.warn(notice, UserWarning, stacklevel=1)  # torch's once-per-process notice: not a sync
        warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=1)
        warnings.warn("something else", UserWarning, stacklevel=1)
        warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=1)

    assert verify_gpu.count_host_syncs(two_syncs, torch.device("cuda", 0)) == 2
    assert modes == ["warn", 0]


def test_bad_input_on_the_device_is_a_python_error_and_leaves_the_device_sound():
    report = verify_gpu.check_bad_input_errors(CPU)
    assert report["ok"] is True and report["device_sound_afterwards"] is True
    assert len(report["raised"]) == 7 and set(report["raised"].values()) == {"ValueError", "TypeError"}


def test_a_bad_input_that_is_accepted_or_fails_otherwise_fails_the_check():
    def assertion():
        raise RuntimeError("CUDA error: device-side assert triggered")

    report = verify_gpu.check_bad_input_errors(CPU, {"accepted": lambda: None, "asserted": assertion})
    assert report["ok"] is False
    assert report["raised"] == {
        "accepted": "nothing",
        "asserted": "RuntimeError: CUDA error: device-side assert triggered",
    }


def _fake_run(returncode: int, write: dict[str, object] | None = None):
    commands = []

    def run_command(command, timeout_s):
        commands.append(list(command))
        if write is not None:
            for flag in ("--output", "--json"):
                if flag in command:
                    target = Path(command[command.index(flag) + 1])
                    path = target / "results.json" if flag == "--output" else target
                    path.parent.mkdir(parents=True, exist_ok=True)
                    path.write_text(json.dumps(write))
        return subprocess.CompletedProcess(command, returncode, "", "a failure's last lines")

    return run_command, commands


def test_the_bench_runs_on_cuda_over_the_cp_sizes_the_gpus_allow(tmp_path):
    run_command, commands = _fake_run(0, {"points": 3})
    report = verify_gpu.run_bench(tmp_path / "bench", 2, run_command)
    [command] = commands
    assert command[1:4] == ["-m", "verl_cppack.cli", "bench"]
    assert command[4:] == ["--device", "cuda", "--quick", "--cp-sizes", "1,2", "--output", str(tmp_path / "bench")]
    assert report["ok"] is True and report["results"] == {"points": 3}
    run_command, commands = _fake_run(1)
    failed = verify_gpu.run_bench(tmp_path / "other", 1, run_command)
    assert "--cp-sizes" in commands[0] and commands[0][commands[0].index("--cp-sizes") + 1] == "1"
    assert failed["ok"] is False and failed["stderr_tail"] == "a failure's last lines"


def test_verify_cp_runs_at_cp_2_and_its_report_is_kept(tmp_path):
    run_command, commands = _fake_run(0, {"logprob_max_abs_diff": 0.0})
    report = verify_gpu.run_verify_cp(tmp_path, run_command)
    assert commands[0][3:6] == ["verify-cp", "--cp", "2"]
    assert report["ok"] is True and report["report"] == {"logprob_max_abs_diff": 0.0}


def test_one_json_holds_every_check_and_a_check_that_raises_fails_alone(tmp_path):
    run_command, _ = _fake_run(0, {})

    def broken_te(*args):
        raise RuntimeError("TE kernel launch failed")

    report = verify_gpu.collect(CPU, tmp_path, broken_te, 1, run_command)
    assert list(report["checks"]) == [
        "zigzag_vs_transformer_engine",
        "cuda_equals_cpu",
        "host_syncs",
        "bad_input_errors",
        "bench",
        "verify_cp",
    ]
    assert report["checks"]["zigzag_vs_transformer_engine"] == {
        "ok": False,
        "error": "RuntimeError: TE kernel launch failed",
    }
    assert report["checks"]["cuda_equals_cpu"]["ok"] is True and report["checks"]["host_syncs"]["ok"] is None
    assert report["ok"] is False
    json.dumps(report)  # one JSON document
