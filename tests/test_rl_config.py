"""The own-loop run configuration (``verl-cppack ppo``) and its command line: defaults, and bad settings refused
before any work. (``grpo`` runs verl's own trainer: tests/test_grpo_cli.py.)"""

from __future__ import annotations

import dataclasses

import pytest

from verl_cppack.cli import build_parser
from verl_cppack.cli.ppo import config_from_args
from verl_cppack.rl.ppo import PPOConfig
from verl_cppack.rl.task import CountingTask
from verl_cppack.rl.worker import WorkerSettings


def test_ppo_with_no_arguments_runs_at_cp2_on_a_local_cluster():
    config = config_from_args(build_parser().parse_args(["ppo"]))
    assert config == PPOConfig()
    assert config.cp == 2 and config.address is None and config.output == PPOConfig().output
    assert config.worker.forward == "verl" and config.worker.device == "cpu"


def test_command_line_flags_reach_the_config():
    args = build_parser().parse_args(
        ["ppo", "--cp", "1", "--steps", "3", "--output", "out", "--address", "auto", "--kl-coef", "0.5",
         "--forward", "cppack", "--group-size", "4", "--prompts-per-step", "2", "--collective-timeout", "7"]
    )
    config = config_from_args(args)
    assert (config.cp, config.steps, config.output, config.address) == (1, 3, "out", "auto")
    assert (config.group_size, config.prompts_per_step) == (4, 2)
    assert config.worker.kl_coef == 0.5 and config.worker.forward == "cppack"
    assert config.worker.collective_timeout_s == 7


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(group_size=1), "group_size must be >= 2"),
        (dict(steps=0), "steps must be >= 1"),
        (dict(prompts_per_step=3, group_size=3, num_mini_batches=2), "divisible by num_mini_batches"),
        (dict(task=CountingTask(vocab_size=8)), "vocab_size"),
        (dict(task=CountingTask(max_prompt_length=60, response_length=10)), "max_sequence_length"),
    ],
)
def test_inconsistent_settings_are_refused(change, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(PPOConfig(), **change)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(device="tpu"), "device must be 'cpu' or 'cuda'"),
        (dict(forward="hf"), "forward must be one of"),
        (dict(attention="flash"), "attention must be"),
        (dict(collective_timeout_s=0), "collective_timeout_s"),
    ],
)
def test_worker_settings_refuse_unknown_choices(change, message):
    with pytest.raises(ValueError, match=message):
        WorkerSettings(**change)


def test_the_cli_reports_a_bad_setting_without_starting_anything(capsys):
    from verl_cppack.cli import main

    assert main(["ppo", "--group-size", "1"]) == 2
    assert "group_size must be >= 2" in capsys.readouterr().err
