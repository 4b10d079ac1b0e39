"""``verl-cppack ppo``: PPO through verl's own trainer (``verl.trainer.main_ppo``) with a Megatron critic, on CPU.

verl's GSM8K PPO recipe with ``grpo``'s CPU overlay: actor, reference and critic at context parallelism --cp through
verl_cppack's packed CP path. The critic starts from the counting task's reward model (trained once, then cached),
the actor at learning rate 1e-3 with PPO's entropy bonus. Output as ``grpo``'s plus verl's critic metrics and
``critic_curve.png``. Exit codes: 0 done, 2 bad input (nothing started), 3 the trainer or Ray failed, 130
interrupted."""

from __future__ import annotations

import argparse

from verl_cppack.cli.trainer_job import register_job
from verl_cppack.jobs.ppo import PPO, PPO_DEFAULTS


def register(subparsers: argparse._SubParsersAction) -> None:
    register_job(
        subparsers,
        PPO,
        "PPO through verl's own trainer on CPU: actor, reference and critic at CP=2",
        __doc__,
        PPO_DEFAULTS,
    )
