"""The main job: GRPO through verl's own trainer, Megatron actor and reference at CP=N (``verl-cppack grpo``)."""

from __future__ import annotations

from verl_cppack.jobs.output import Panel
from verl_cppack.jobs.verl_job import JobKind

GRPO = JobKind(
    name="grpo",
    recipe="gsm8k_grpo_megatron_cp2.sh",
    overlay=lambda run: [],
    panels=(
        Panel("reward_mean", "mean reward (critic/score/mean)", "tab:blue", ylim=(0, 1)),
        Panel("actor/entropy", "actor entropy", "tab:green"),
    ),
    min_group_size=2,
)
