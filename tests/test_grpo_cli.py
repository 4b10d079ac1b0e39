"""``verl-cppack grpo``'s contract with its user: the configuration it composes, bad input refused before Ray starts
(one ``error:`` line, exit 2), a Ray cluster that is not there refused in bounded time (exit 3), and Ctrl-C stopping
verl's trainer and the Ray cluster it started (exit 130, nothing left running)."""

from __future__ import annotations

import contextlib
import importlib.util
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("verl")

from verl_cppack.jobs.grpo import GRPO  # noqa: E402
from verl_cppack.jobs.rollout_choice import DEFAULT_ROLLOUT  # noqa: E402
from verl_cppack.jobs.verl_job import JobSettings, prepare_job  # noqa: E402


def grpo(*arguments: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "verl_cppack.cli", "grpo", *arguments], capture_output=True, text=True, timeout=timeout
    )


def test_the_default_configuration_is_the_gpu_recipe_with_the_cpu_overlay(tmp_path):
    """The GSM8K recipe's algorithm settings survive; the overlay sets CP=2 for actor and reference, the plugin,
    verl's vLLM rollout (float32, eager, no sleep mode), float32 and the host; user overrides come last and win."""
    prepared = prepare_job(
        GRPO, JobSettings(overrides=("actor_rollout_ref.actor.kl_loss_coef=0.5",)), output_dir=tmp_path
    )
    config = prepared.config
    assert config.algorithm.adv_estimator == "grpo" and config.actor_rollout_ref.actor.use_kl_loss  # from the recipe
    assert config.actor_rollout_ref.actor.kl_loss_type == "low_var_kl"
    assert config.actor_rollout_ref.actor.megatron.context_parallel_size == 2
    assert config.actor_rollout_ref.ref.megatron.context_parallel_size == 2
    assert config.actor_rollout_ref.model.external_lib == "verl_cppack.verl_plugin"
    rollout = config.actor_rollout_ref.rollout
    assert rollout.name == DEFAULT_ROLLOUT and config.trainer.device == "cpu"
    assert ("vllm" if importlib.util.find_spec("vllm") is not None else "hf") == DEFAULT_ROLLOUT
    if DEFAULT_ROLLOUT == "vllm":  # the pinned stack
        assert rollout.dtype == "float32" and rollout.enforce_eager and not rollout.enable_sleep_mode
        assert rollout.tensor_model_parallel_size == 1 and not rollout.free_cache_engine
        assert not rollout.full_determinism  # it would give every request of a replica one seed: one response per group
    assert config.actor_rollout_ref.actor.megatron.dtype == "float32"
    assert config.actor_rollout_ref.actor.kl_loss_coef == 0.5
    assert config.trainer.use_v1 is True  # verl 0.9.1's default trainer
    assert prepare_job(GRPO, JobSettings(trainer="v0"), output_dir=tmp_path).config.trainer.use_v1 is False


def test_the_hugging_face_rollout_is_one_flag_away(tmp_path):
    """--rollout hf: the Hugging Face rollout, whose requests are named after their rows, routed and seeded by name
    (full determinism: runs repeat)."""
    rollout = prepare_job(GRPO, JobSettings(rollout="hf"), output_dir=tmp_path).config.actor_rollout_ref.rollout
    assert rollout.name == "hf" and rollout.full_determinism


def test_vllm_with_sleep_mode_is_refused_before_anything_starts(tmp_path):
    """vLLM's CPU platform has no sleep mode: an override that turns it on is a ValueError naming the key."""
    with pytest.raises(ValueError, match="enable_sleep_mode=True: vLLM's CPU platform has no sleep mode"):
        settings = JobSettings(rollout="vllm", overrides=("++actor_rollout_ref.rollout.enable_sleep_mode=True",))
        prepare_job(GRPO, settings, output_dir=tmp_path)


def test_a_parallel_shape_reaches_every_megatron_model_and_verls_trainer(tmp_path):
    """--tp 2 --cp 2 --dp 2 over 2 nodes: TP and CP of the actor, reference and (PPO) critic, sequence parallelism
    off, verl's world of 2 nodes x 4 workers, micro-batches per DP rank; the task's files named relative to the task
    directory (every worker's working directory)."""
    from verl_cppack.jobs.ppo import PPO, PPO_DEFAULTS

    settings = JobSettings(tp=2, cp=2, dp=2, nnodes=2, address="10.0.0.1:6379")
    config = prepare_job(GRPO, settings, output_dir=tmp_path / "grpo").config
    for role in ("actor", "ref"):
        megatron = config.actor_rollout_ref[role].megatron
        assert (megatron.tensor_model_parallel_size, megatron.context_parallel_size) == (2, 2)
        assert megatron.sequence_parallel is False
    assert (config.trainer.nnodes, config.trainer.n_gpus_per_node) == (2, 4)
    responses_per_mini_batch = settings.prompts_per_step * settings.group_size // 4
    assert config.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu == responses_per_mini_batch // 2
    assert config.actor_rollout_ref.model.path == "model" and config.data.train_files == "train.parquet"
    assert config.reward.custom_reward_function.path == "counting_reward.py"
    ppo_settings = JobSettings(**{**PPO_DEFAULTS.__dict__, "tp": 2, "cp": 2, "dp": 2})
    critic = prepare_job(PPO, ppo_settings, output_dir=tmp_path / "ppo").config.critic
    assert (critic.megatron.tensor_model_parallel_size, critic.megatron.context_parallel_size) == (2, 2)
    assert critic.ppo_micro_batch_size_per_gpu == ppo_settings.prompts_per_step * ppo_settings.group_size // 4 // 2


@pytest.mark.parametrize("timeout", [0, -5.0, float("nan"), float("inf"), True, "60"])
def test_a_step_timeout_that_is_not_a_positive_finite_number_of_seconds_is_refused(timeout):
    with pytest.raises(ValueError, match="step timeout must be a positive, finite number of seconds"):
        JobSettings(step_timeout_s=timeout)


def test_the_step_timeout_flag_sets_the_jobs_wait_for_a_step():
    from verl_cppack.cli import build_parser
    from verl_cppack.cli.trainer_job import settings_from_args

    assert settings_from_args(build_parser().parse_args(["grpo"])).step_timeout_s == 600.0
    assert settings_from_args(build_parser().parse_args(["grpo", "--step-timeout", "45"])).step_timeout_s == 45.0


@pytest.mark.slow  # each case runs the CLI in a subprocess (several seconds)
@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--cp", "0"], "cp must be >= 1"),
        (["--steps", "0"], "steps must be >= 1"),
        (["--group-size", "1"], "group_size must be >= 2"),
        (["--lr", "5"], "learning rate"),
        (["actor_rollout_ref.actor.no_such_key=1"], "rejects the overrides"),
        (["not-an-override"], "KEY=VALUE"),
        (["actor_rollout_ref.model.path=/no/such/model"], "not a Hugging Face checkpoint directory"),
        (["trainer.device=cuda"], "trainer.device must be cpu"),
        (["--address", "nonsense"], "HOST:PORT"),
        (["--tp", "0"], "tp must be >= 1"),
        (["--dp", "0"], "dp must be >= 1"),
        (["--nnodes", "0"], "nnodes must be >= 1"),
        (["--dp", "2", "--nnodes", "3"], "nnodes=3 does not divide the 4 workers"),
        (["--nnodes", "2"], "needs --address (or RAY_ADDRESS)"),
        (["--tp", "4"], "tp=4 does not divide the model's 2 attention heads and 2 key-value heads"),
        (["--dp", "3"], "dp=3 must divide the 32 responses of a mini-batch"),
        (["--prompts-per-step", "6"], "prompts_per_step (6) must be a multiple of 4"),
        (["--step-timeout", "0"], "step timeout must be a positive, finite number of seconds, got 0.0"),
        (["--step-timeout", "inf"], "step timeout must be a positive, finite number of seconds, got inf"),
    ],
)
def test_bad_input_is_one_error_line_and_exit_2_before_ray_starts(arguments, message, tmp_path):
    result = grpo("--output", str(tmp_path / "out"), *arguments)
    assert result.returncode == 2, result.stdout + result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "out" / "trainer.log").exists()  # the trainer never started


@pytest.mark.slow  # the CLI in subprocesses
def test_an_output_path_that_is_a_file_or_unwritable_is_refused(tmp_path):
    (tmp_path / "file").write_text("x")
    result = grpo("--output", str(tmp_path / "file"))
    assert result.returncode == 2 and "error:" in result.stderr and "not a directory" in result.stderr
    result = grpo("--output", "/proc/verl_cppack_cannot_be_here")  # not writable, even for root
    assert result.returncode == 2 and "error: cannot create or read the output directory" in result.stderr


@pytest.mark.slow  # the CLI in a subprocess
def test_a_ray_address_where_no_cluster_answers_fails_in_bounded_time(tmp_path):
    started = time.monotonic()
    result = grpo("--output", str(tmp_path / "out"), "--address", "127.0.0.1:9", timeout=120)
    assert result.returncode == 3, result.stdout + result.stderr
    assert "no Ray cluster answers at 127.0.0.1:9" in result.stderr
    assert time.monotonic() - started < 60


def _trainer_and_ray(command_pid: int) -> set:
    """verl's trainer and the Ray processes it started: descendants of the command ``command_pid`` (a Ray cluster
    of another run on the same machine is not one of them)."""
    import psutil

    try:
        descendants = psutil.Process(command_pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return set()
    return {
        p for p in descendants if any(name in " ".join(_cmdline(p)) for name in ("raylet", "gcs_server", "main_ppo"))
    }


def _cmdline(process) -> list[str]:
    import psutil

    try:
        return process.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return []


def _alive(process) -> bool:
    import psutil

    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.slow  # starts verl's trainer and its Ray cluster
@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGKILL], ids=["ctrl_c", "killed_outright"])
def test_ctrl_c_or_a_kill_stops_the_trainer_and_its_ray_cluster(tmp_path, stop):
    """Once verl's trainer has started its Ray cluster: Ctrl-C exits 130, and after it — or after the command is
    killed outright (SIGKILL, a closed terminal's SIGHUP: no cleanup of its own) — no trainer or Ray process
    started for it is left."""
    from tests.interrupts import default_sigint

    process = subprocess.Popen(
        [
            *(sys.executable, "-m", "verl_cppack.cli", "grpo", "--steps", "500", "--rollout", "hf"),
            *("--output", str(tmp_path / "out")),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=default_sigint,
    )
    started: set = set()
    try:
        deadline = time.monotonic() + 240
        while not any("raylet" in " ".join(_cmdline(p)) for p in _trainer_and_ray(process.pid)):
            assert process.poll() is None and time.monotonic() < deadline, process.communicate()[1][-3000:]
            time.sleep(1)
        time.sleep(10)  # well inside Ray start-up and worker init
        started = _trainer_and_ray(process.pid)  # psutil.Process objects: a recycled pid is not mistaken for them
        process.send_signal(stop)
        _, stderr = process.communicate(timeout=120)
        if stop == signal.SIGINT:
            assert process.returncode == 130, stderr[-3000:]
            assert "interrupted" in stderr
        deadline = time.monotonic() + 60
        while any(_alive(p) for p in started) and time.monotonic() < deadline:
            time.sleep(1)
        assert not [(p.pid, _cmdline(p)[:2]) for p in started if _alive(p)]
    finally:  # a failed test leaves nothing running (the trainer has its own session, outside the command's group)
        if process.poll() is None:
            started |= _trainer_and_ray(process.pid)
            process.kill()
            process.wait()
        for leftover in started:
            if _alive(leftover):
                with contextlib.suppress(Exception):  # it may end between the look and the kill
                    leftover.kill()
