"""PPO through verl's own trainer with a Megatron critic: actor, reference and critic at CP=N (``verl-cppack ppo``).

The critic starts from the counting task's reward model; the settings below are tuned on the counting task."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from verl_cppack.jobs.counting_reward_model import ensure_counting_reward_model, reward_model_dir
from verl_cppack.jobs.output import Panel, fifth_means
from verl_cppack.jobs.trainer_config import PLUGIN, CpuRun, megatron_overlay
from verl_cppack.jobs.verl_job import JobKind, JobSettings

# The critic starts from the reward model with a new value head, so it trains alone for CRITIC_ONLY_STEPS steps.
CRITIC_LEARNING_RATE = 5e-4
CRITIC_EPOCHS = 1
CRITIC_ONLY_STEPS = 2
# verl 0.9.1 counts steps from 1 and skips the actor's update while trainer.critic_warmup > step.
CRITIC_WARMUP = CRITIC_ONLY_STEPS + 1
# PPO's entropy bonus, the PPO paper's c2 = 0.01 (verl's default is 0)
ENTROPY_COEFFICIENT = 0.01


def ppo_overlay(run: CpuRun) -> list[str]:
    """What PPO adds to the CPU overlay: the critic (Megatron at ``run.shape``, from the reward model), the bonus."""
    return [
        f"actor_rollout_ref.actor.entropy_coeff={ENTROPY_COEFFICIENT}",
        *megatron_overlay("critic.megatron", run),
        f"critic.model.path={run.assets.relative(reward_model_dir(run.assets))}",
        f"critic.model.external_lib={PLUGIN}",
        f"critic.optim.lr={CRITIC_LEARNING_RATE}",
        f"critic.ppo_epochs={CRITIC_EPOCHS}",
        f"critic.ppo_mini_batch_size={run.prompts_per_step // run.mini_batches}",
        f"critic.ppo_micro_batch_size_per_gpu={run.responses_per_mini_batch // run.shape.dp}",
        f"trainer.critic_warmup={CRITIC_WARMUP}",
    ]


def make_reward_model(run: CpuRun, config: Any) -> None:
    """Train the critic's reward model when the config still points the critic at it (once; it is cached)."""
    directory = reward_model_dir(run.assets)
    if str(config.critic.model.path) == run.assets.relative(directory) and not (directory / "training.json").is_file():
        print(
            "ppo: training the critic's starting checkpoint, the counting task's reward model "
            "(once, about half a minute)",
            file=sys.stderr,
            flush=True,
        )
        ensure_counting_reward_model(run.assets)


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
    overlay=ppo_overlay,
    panels=(
        Panel("reward_mean", "mean reward (critic/score/mean)", "tab:blue", ylim=(0, 1)),
        Panel("actor/entropy", "actor entropy", "tab:green"),
        Panel("critic/vf_loss", "critic/vf_loss", "tab:red", log_scale=True),
        Panel("critic/vf_explained_var", "critic/vf_explained_var", "tab:purple"),
        Panel("critic/values/mean", "critic/values/mean", "tab:orange"),
    ),
    summary=critic_summary,
    make_assets=make_reward_model,
)

# 128 responses per step, as grpo's; the actor at 1e-3: at grpo's 3e-3 PPO collapsed onto periodic answers
PPO_DEFAULTS = JobSettings(prompts_per_step=32, group_size=4, learning_rate=1e-3)
