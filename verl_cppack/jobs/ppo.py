"""PPO through verl's own trainer with a Megatron critic: actor, reference and critic at CP=N (``verl-cppack ppo``).

verl's GSM8K PPO recipe (``recipes/gsm8k_ppo_megatron_cp2.sh``: GAE, a Megatron critic with
``critic.model.external_lib=verl_cppack.verl_plugin``) with the common CPU overlay, plus the critic's own Megatron
engine on the host at the same CP size, started from the counting task's reward model. The critic's values go
through verl_cppack's packed CP path (``value_model=True``): packed, zigzag-sliced and gathered back to
``[batch, response]``.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from verl_cppack.jobs.counting_reward_model import ensure_counting_reward_model, reward_model_dir
from verl_cppack.jobs.output import Panel, fifth_means
from verl_cppack.jobs.trainer_config import PLUGIN, CpuRun, megatron_overlay
from verl_cppack.jobs.verl_job import JobKind, JobSettings

# Measured on the counting task (30 steps, CP=2; README, Results, and scripts/critic_replay.py over the rollouts of
# eight real runs): the critic starts from the task's reward model (counting_reward_model.py), not from the policy's
# random checkpoint, whose trunk would first have to learn which earlier tokens were right (replayed, 0.04-0.30 of
# the returns' variance explained over the last fifth from the random trunk at lr 1e-3 x 2 epochs, 0.10-0.36 from
# the reward model's at lr 5e-4 x 1 epoch, better on every one of the eight). Its value head is new (mean values
# -0.4 to 0.6 against returns ~0.05 at step 1), so the critic trains alone for the first CRITIC_ONLY_STEPS steps.
CRITIC_LEARNING_RATE = 5e-4
CRITIC_EPOCHS = 1
CRITIC_ONLY_STEPS = 2
# verl 0.9.1 counts steps from 1 and skips the actor's update while trainer.critic_warmup > step.
CRITIC_WARMUP = CRITIC_ONLY_STEPS + 1
# PPO's entropy bonus, the PPO paper's c2 = 0.01 (verl's default is 0). With the actor at 3e-3 it kept the final
# entropy at ~0.1 instead of 0.03 but did not stop the collapse onto periodic answers; the actor's learning rate did
# (PPO_DEFAULTS). Kept at the paper's value; not measured without it at 1e-3.
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

# 128 responses per step, as grpo's 16 x 8. The actor's learning rate is a third of grpo's 3e-3: at 3e-3 each of the
# ten PPO runs whose rollouts were dumped ended on a handful of periodic answers (4-37 distinct among the last step's
# 128, such as "456745" for most prompts; none fully right in seven of them), whose returns hardly vary, so the critic
# has little to explain (0.02-0.10 over the last fifth in the worst). With the actor at 1e-3 and the critic from the
# reward model, each of seven runs learnt to count on from the prompt (64-103 distinct answers at step 30, 9-48 of
# them fully right, reward 0.70-0.80) and the critic explained 0.17-0.23 (README, Results).
PPO_DEFAULTS = JobSettings(prompts_per_step=32, group_size=4, learning_rate=1e-3)
