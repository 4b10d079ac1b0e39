#!/usr/bin/env bash
# Submit a GSM8K recipe to a running multi-node GPU Ray cluster with `ray job submit`, at TP x PP x CP x DP.
#
# Start the cluster first (every node: verl with its Megatron and vLLM extras; verl_cppack is NOT needed there):
#   head:        ray start --head --port=6379 --num-gpus=8
#   other nodes: ray start --address=<head-ip>:6379 --num-gpus=8
# Then, from a checkout of verl_cppack (or any machine with it installed) that reaches the head's dashboard:
#   RAY_ADDRESS=http://<head-ip>:8265 NNODES=2 GPUS_PER_NODE=8 TP=2 PP=1 CP=2 DP=4 \
#   DATA_DIR=/nfs/data/gsm8k MODEL_PATH=Qwen/Qwen2.5-3B-Instruct \
#       bash recipes/submit_multinode.sh gsm8k_grpo_megatron_cp2.sh [extra hydra overrides...]
#
# The job's runtime environment carries verl_cppack (`py_modules`: the package is uploaded and put on every worker's
# path), the recipes (`working_dir`) and VERL_USE_EXTERNAL_MODULES=verl_cppack.verl_plugin; verl passes the job's
# runtime environment on to every worker it starts. DP defaults to NNODES*GPUS_PER_NODE / (TP*PP*CP) and, when
# given, must equal it. DATA_DIR and MODEL_PATH name paths on the cluster (shared storage, or a hub id).
# VERL_CPPACK_PRINT_OVERRIDES=1 prints the recipe's overrides (as every recipe does);
# VERL_CPPACK_PRINT_SUBMIT=1 prints the `ray job submit` command instead of running it.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
recipe=${1:-gsm8k_grpo_megatron_cp2.sh}
shift $(( $# > 0 ? 1 : 0 ))
if [[ ! -f "$here/$recipe" || "$recipe" == "$(basename "${BASH_SOURCE[0]}")" ]]; then
    echo "error: $recipe is not a recipe in $here (gsm8k_grpo_megatron_cp2.sh, gsm8k_ppo_megatron_cp2.sh)" >&2
    exit 2
fi
source "$here/lib/megatron_gsm8k.sh"  # NNODES, GPUS_PER_NODE, TP, PP, CP defaults
world=$(( NNODES * GPUS_PER_NODE ))
model_parallel=$(( TP * PP * CP ))
if (( model_parallel < 1 || world % model_parallel )); then
    echo "error: TP*PP*CP = $TP*$PP*$CP = $model_parallel must divide NNODES*GPUS_PER_NODE = $world" >&2
    exit 2
fi
DP=${DP:-$(( world / model_parallel ))}
if (( TP * PP * CP * DP != world )); then
    echo "error: TP*PP*CP*DP = $TP*$PP*$CP*$DP = $(( TP * PP * CP * DP )) GPUs, but NNODES*GPUS_PER_NODE = $world" >&2
    exit 2
fi

if [[ "${VERL_CPPACK_PRINT_OVERRIDES:-0}" == "1" ]]; then
    exec bash "$here/$recipe" "$@"
fi

package=$(python3 -c 'import os, verl_cppack; print(os.path.dirname(os.path.abspath(verl_cppack.__file__)))' 2>/dev/null \
          || echo "$here/../verl_cppack")
runtime_env=$(python3 -c 'import json, sys; print(json.dumps({"working_dir": sys.argv[1], "py_modules": [sys.argv[2]],
    "env_vars": {"VERL_USE_EXTERNAL_MODULES": "verl_cppack.verl_plugin"}}))' "$here" "$(cd "$package" && pwd)")
settings=(NNODES="$NNODES" GPUS_PER_NODE="$GPUS_PER_NODE" TP="$TP" PP="$PP" CP="$CP" DATA_DIR="$DATA_DIR"
          MODEL_PATH="$MODEL_PATH" ROLLOUT_TP="$ROLLOUT_TP")
# Ray joins the entrypoint's words with spaces and a shell on the head parses them again: quote each word once here.
entrypoint=$(printf '%q ' env "${settings[@]}" bash "$recipe" "$@")
command=(ray job submit --address "${RAY_ADDRESS:?set RAY_ADDRESS=http://<head-ip>:8265}" --runtime-env-json "$runtime_env"
         -- "$entrypoint")
if [[ "${VERL_CPPACK_PRINT_SUBMIT:-0}" == "1" ]]; then  # the command as a shell would take it, one word per line
    printf '%s\n' "${command[@]}"
    exit 0
fi
exec "${command[@]}"
