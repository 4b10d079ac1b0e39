#!/usr/bin/env bash
# PPO (GAE, with a critic) on GSM8K: Megatron actor, reference and critic at context parallelism 2, vLLM rollout,
# verl_cppack plugin enabled for the actor/reference and for the critic.
#
# Needs a GPU Ray cluster (one node of 8 GPUs by default: TP=2 x PP=2 x CP=2 for actor and critic), verl >= 0.9
# with its Megatron and vLLM extras, and `pip install verl-cppack` on every node. Prepare the data first:
#   python recipes/prepare_gsm8k.py --output-dir "$HOME/data/gsm8k"
# Then, on the Ray head node (or with RAY_ADDRESS set):
#   bash recipes/gsm8k_ppo_megatron_cp2.sh [extra hydra overrides...]
# Set VERL_CPPACK_PRINT_OVERRIDES=1 to print the overrides (one per line) instead of running; the recipe config
# test composes verl's trainer config with exactly these overrides.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib/megatron_gsm8k.sh"
CRITIC_MODEL_PATH=${CRITIC_MODEL_PATH:-$MODEL_PATH}
CRITIC_TP=${CRITIC_TP:-$TP}
CRITIC_PP=${CRITIC_PP:-$PP}
CRITIC_CP=${CRITIC_CP:-$CP}

overrides=(
    "${common_overrides[@]}"
    algorithm.adv_estimator=gae
    algorithm.gamma=1.0
    algorithm.lam=1.0
    actor_rollout_ref.rollout.gpu_memory_utilization=0.5
    actor_rollout_ref.rollout.n=1
    critic.model.path="$CRITIC_MODEL_PATH"
    critic.model.external_lib=verl_cppack.verl_plugin
    critic.optim.lr=1e-5
    critic.ppo_micro_batch_size_per_gpu=4
    critic.cliprange_value=0.5
    critic.megatron.tensor_model_parallel_size="$CRITIC_TP"
    critic.megatron.pipeline_model_parallel_size="$CRITIC_PP"
    critic.megatron.context_parallel_size="$CRITIC_CP"
    trainer.experiment_name=ppo_megatron_cp${CP}
)
run_main_ppo "${overrides[@]}" "$@"
