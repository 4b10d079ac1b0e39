"""PPO through verl's own trainer with a Megatron critic: actor, reference and critic at CP=N (``verl-cppack ppo``).

verl's GSM8K PPO recipe (``recipes/gsm8k_ppo_megatron_cp2.sh``: GAE, a critic built from the policy's checkpoint
with ``critic.model.external_lib=verl_cppack.verl_plugin``) with the common CPU overlay, plus the critic's own
Megatron engine on the host at the same CP size. The critic's values go through verl_cppack's packed CP path
(``value_model=True``): packed, zigzag-sliced and gathered back to ``[batch, response]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from verl_cppack.jobs.output import Panel, fifth_means
from verl_cppack.jobs.trainer_config import PLUGIN, CpuRun, megatron_overlay
from verl_cppack.jobs.verl_job import JobKind, JobSettings

# Measured on the counting task (30 steps, CP=2; see the README's PPO notes): the value head starts random
# (values ~0.74 against returns ~0.05, vf_explained_var -41 at step 1), so the critic trains alone for the
# first CRITIC_ONLY_STEPS steps; lr 5e-4 with one epoch left it lagging the actor (explained variance 0.13 over the
# last fifth), lr 1e-3 with two epochs per batch gave 0.19 on one VM and -0.03 on another (same seed; more updates,
# lr 2e-3 x 4 epochs or 3e-3 x 8, gave 0.12 and -0.07): 30 steps are too few updates for a random trunk to learn
# which earlier tokens were right (README, Results).
CRITIC_LEARNING_RATE = 1e-3
CRITIC_EPOCHS = 2
CRITIC_ONLY_STEPS = 2
# verl 0.9.1 counts steps from 1 and skips the actor's update while trainer.critic_warmup > step.
CRITIC_WARMUP = CRITIC_ONLY_STEPS + 1


def critic_overlay(run: CpuRun) -> list[str]:
    batch = run.prompts_per_step * run.group_size
    return [
        *megatron_overlay("critic.megatron", run),
        f"critic.model.path={run.assets.model}",
        f"critic.model.external_lib={PLUGIN}",
        f"critic.optim.lr={CRITIC_LEARNING_RATE}",
        f"critic.ppo_epochs={CRITIC_EPOCHS}",
        f"critic.ppo_mini_batch_size={run.prompts_per_step // run.mini_batches}",
        f"critic.ppo_micro_batch_size_per_gpu={batch // run.mini_batches}",
        f"trainer.critic_warmup={CRITIC_WARMUP}",
    ]


def critic_summary(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    explained = [record["critic/vf_explained_var"] for record in records if "critic/vf_explained_var" in record]
    return {
        "critic_cp": records[0]["cp"],
        "explained_variance_last_fifth": fifth_means(explained)[1] if explained else None,
        "vf_loss_final": records[-1].get("critic/vf_loss"),
    }


PPO = JobKind(
    name="ppo",
    recipe="gsm8k_ppo_megatron_cp2.sh",
    overlay=critic_overlay,
    panels=(
        Panel("reward_mean", "mean reward (critic/score/mean)", "tab:blue", ylim=(0, 1)),
        Panel("actor/entropy", "actor entropy", "tab:green"),
        Panel("critic/vf_loss", "critic/vf_loss", "tab:red", log_scale=True),
        Panel("critic/vf_explained_var", "critic/vf_explained_var", "tab:purple"),
        Panel("critic/values/mean", "critic/values/mean", "tab:orange"),
    ),
    summary=critic_summary,
)

PPO_DEFAULTS = JobSettings(prompts_per_step=32, group_size=4)  # 128 responses per step, as grpo's 16 x 8
