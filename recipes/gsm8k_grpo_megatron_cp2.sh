#!/usr/bin/env bash
# GRPO on GSM8K with a Megatron actor at context parallelism 2 and vLLM rollout, verl_cppack plugin enabled.
#
# Needs a GPU Ray cluster (one node of 8 GPUs by default: TP=2 x PP=2 x CP=2), verl >= 0.9 with its Megatron and
# vLLM extras, and `pip install verl-cppack` on every node. Prepare the data first:
#   python recipes/prepare_gsm8k.py --output-dir "$HOME/data/gsm8k"
# Then, on the Ray head node (or with RAY_ADDRESS set):
#   bash recipes/gsm8k_grpo_megatron_cp2.sh [extra hydra overrides...]
# Set VERL_CPPACK_PRINT_OVERRIDES=1 to print the overrides (one per line) instead of running; the recipe config
# test uses that to compose verl's trainer config with exactly these overrides.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib/megatron_gsm8k.sh"

overrides=(
    "${common_overrides[@]}"
    algorithm.adv_estimator=grpo
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6
    actor_rollout_ref.rollout.n=5
    trainer.experiment_name=grpo_megatron_cp${CP}
)
run_main_ppo "${overrides[@]}" "$@"
