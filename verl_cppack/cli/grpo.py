"""``verl-cppack grpo``: GRPO through verl's own trainer (``verl.trainer.main_ppo``) on this machine's CPU.

verl's GSM8K GRPO recipe with a CPU overlay: a tiny Llama and a counting task made locally, the Megatron actor and
reference at context parallelism --cp, verl's vLLM rollout on vLLM's CPU build (``--rollout hf``: Hugging Face
generate), a local Ray cluster (or --address). Extra arguments are Hydra overrides, applied last. Exit codes: 0 done,
2 bad input (nothing started), 3 the trainer or Ray failed, 130 interrupted."""

from __future__ import annotations

import argparse

from verl_cppack.cli.trainer_job import register_job
from verl_cppack.jobs.grpo import GRPO


def register(subparsers: argparse._SubParsersAction) -> None:
    register_job(
        subparsers, GRPO, "GRPO through verl's own trainer on CPU, actor and reference at CP=2 (the main job)", __doc__
    )
