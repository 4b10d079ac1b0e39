# Shared by the GSM8K Megatron recipes (sourced, not run): cluster/parallel defaults, the verl overrides every
# recipe uses (data, actor + reference at TP x PP x CP with the verl_cppack plugin, vLLM rollout, k3 KL loss,
# trainer), and `run_main_ppo`, which prints or runs verl's trainer with a recipe's overrides.
DATA_DIR=${DATA_DIR:-$HOME/data/gsm8k}
MODEL_PATH=${MODEL_PATH:-Qwen/Qwen2.5-3B-Instruct}
NNODES=${NNODES:-1}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
TP=${TP:-2}
PP=${PP:-2}
CP=${CP:-2}
ROLLOUT_TP=${ROLLOUT_TP:-2}

common_overrides=(
    algorithm.use_kl_in_reward=False
    data.train_files="$DATA_DIR/train.parquet"
    data.val_files="$DATA_DIR/test.parquet"
    data.train_batch_size=256
    data.max_prompt_length=512
    data.max_response_length=1024
    data.filter_overlong_prompts=True
    data.truncation=error
    actor_rollout_ref.model.path="$MODEL_PATH"
    actor_rollout_ref.model.external_lib=verl_cppack.verl_plugin
    actor_rollout_ref.actor.optim.lr=1e-6
    actor_rollout_ref.actor.ppo_mini_batch_size=64
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4
    actor_rollout_ref.actor.megatron.tensor_model_parallel_size="$TP"
    actor_rollout_ref.actor.megatron.pipeline_model_parallel_size="$PP"
    actor_rollout_ref.actor.megatron.context_parallel_size="$CP"
    actor_rollout_ref.actor.use_kl_loss=True
    actor_rollout_ref.actor.kl_loss_coef=0.001
    actor_rollout_ref.actor.kl_loss_type=low_var_kl
    actor_rollout_ref.actor.entropy_coeff=0
    actor_rollout_ref.rollout.name=vllm
    actor_rollout_ref.rollout.tensor_model_parallel_size="$ROLLOUT_TP"
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8
    actor_rollout_ref.ref.megatron.tensor_model_parallel_size="$TP"
    actor_rollout_ref.ref.megatron.pipeline_model_parallel_size="$PP"
    actor_rollout_ref.ref.megatron.context_parallel_size="$CP"
    trainer.critic_warmup=0
    trainer.logger='["console"]'
    trainer.project_name=verl_cppack_gsm8k
    trainer.nnodes="$NNODES"
    trainer.n_gpus_per_node="$GPUS_PER_NODE"
    trainer.save_freq=20
    trainer.test_freq=5
    trainer.total_epochs=15
)

# run_main_ppo OVERRIDE... : with VERL_CPPACK_PRINT_OVERRIDES=1 print the overrides (one per line, what the recipe
# config test composes) and stop; otherwise exec verl's Megatron trainer with them.
run_main_ppo() {
    if [[ "${VERL_CPPACK_PRINT_OVERRIDES:-0}" == "1" ]]; then
        printf '%s\n' "$@"
        exit 0
    fi
    # VERL_USE_EXTERNAL_MODULES also loads the plugin in processes that never read a model config.
    export VERL_USE_EXTERNAL_MODULES=${VERL_USE_EXTERNAL_MODULES:-verl_cppack.verl_plugin}
    export CUDA_DEVICE_MAX_CONNECTIONS=1  # Megatron communication/computation overlap
    exec python3 -m verl.trainer.main_ppo --config-path=config --config-name=ppo_megatron_trainer.yaml "$@"
}
