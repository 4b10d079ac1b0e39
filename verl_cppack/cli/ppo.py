"""``verl-cppack ppo``: PPO through verl's own trainer (``verl.trainer.main_ppo``) with a Megatron critic, on CPU.

verl's GSM8K PPO recipe (``recipes/gsm8k_ppo_megatron_cp2.sh``: GAE, a Megatron critic) with the CPU overlay of
``grpo``: the actor, the reference and the critic at context parallelism --cp, all three through verl_cppack's
packed CP path (the critic's values with ``value_model=True``). The critic starts from the counting task's reward
model (trained once, about half a minute, then cached), the actor from the policy's checkpoint at learning rate 1e-3
(a third of grpo's, which made PPO's actor collapse) with PPO's entropy bonus (0.01). Output as ``grpo``'s plus
verl's critic metrics (``critic/vf_loss``, ``critic/vf_explained_var``, ``critic/values/mean``) and
``critic_curve.png``. Exit codes: 0 done, 2 bad input (nothing started), 3 the trainer or Ray failed, 130
interrupted.
"""

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
