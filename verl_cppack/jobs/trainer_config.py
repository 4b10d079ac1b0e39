"""The Hydra overrides verl's trainer runs with: a GPU recipe's own overrides, the CPU overlay, the user's last.

One recipe, not two that drift: the recipe in ``recipes/`` prints its overrides."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from verl_cppack.jobs.counting_task import RESPONSE_LENGTH, CountingPaths
from verl_cppack.jobs.parallel_shape import ParallelShape
from verl_cppack.jobs.rollout_choice import rollout_overlay
from verl_cppack.runtime.megatron_engine import HOST_TRANSFORMER_CONFIG, uses_megatron_bridge

CONFIG_NAME = "ppo_megatron_trainer"
RECIPES = Path(__file__).resolve().parents[2] / "recipes"
PLUGIN = "verl_cppack.verl_plugin"


@dataclass(frozen=True)
class CpuRun:
    """What the CPU overlay needs to know about one run."""

    assets: CountingPaths
    shape: ParallelShape = ParallelShape()
    steps: int = 30
    prompts_per_step: int = 16
    group_size: int = 8
    seed: int = 0
    learning_rate: float = 3e-3
    mini_batches: int = 4  # optimizer steps per training step (verl's ppo_mini_batch_size = prompts / this)
    output_dir: Path = Path("runs/grpo")
    rollout: str = "vllm"  # vllm | hf (rollout_choice.py)

    @property
    def responses_per_mini_batch(self) -> int:
        """Responses in one optimizer step across all data-parallel ranks (verl's ppo_mini_batch_size x n)."""
        return self.prompts_per_step * self.group_size // self.mini_batches


def recipe_overrides(script: str) -> list[str]:
    """The overrides a recipe in ``recipes/`` passes to verl (after shell expansion)."""
    path = RECIPES / script
    if not path.is_file():
        raise ValueError(f"recipe {path} not found: run from a checkout of verl_cppack (pip install -e .)")
    result = subprocess.run(
        ["bash", str(path)], env={**os.environ, "VERL_CPPACK_PRINT_OVERRIDES": "1"}, capture_output=True, text=True
    )
    if result.returncode != 0:
        raise ValueError(f"recipe {path} failed: {result.stderr.strip()}")
    return result.stdout.splitlines()


def check_batch_sizes(run: CpuRun) -> None:
    """``ValueError`` unless verl can split the batch: prompts into mini-batches, each mini-batch over DP ranks."""
    dp = run.shape.dp
    if run.prompts_per_step % run.mini_batches:
        raise ValueError(
            f"prompts_per_step ({run.prompts_per_step}) must be a multiple of {run.mini_batches} "
            "(verl makes that many optimizer steps per training step)"
        )
    if run.responses_per_mini_batch % dp or (run.prompts_per_step * run.group_size // 2) % dp:
        raise ValueError(
            f"dp={dp} must divide the {run.responses_per_mini_batch} responses of a mini-batch and half of the "
            f"{run.prompts_per_step * run.group_size} of a step; change --dp, --prompts-per-step or --group-size"
        )


def megatron_overlay(prefix: str, run: CpuRun) -> list[str]:
    """A Megatron engine config at ``prefix`` (``actor_rollout_ref.actor.megatron``, ...) on the host at TP x CP."""
    return [
        f"{prefix}.tensor_model_parallel_size={run.shape.tp}",
        f"{prefix}.pipeline_model_parallel_size=1",
        f"{prefix}.context_parallel_size={run.shape.cp}",
        f"{prefix}.sequence_parallel=False",  # HOST_TRANSFORMER_CONFIG
        f"{prefix}.vanilla_mbridge={not uses_megatron_bridge()}",  # Megatron-Bridge where installed, as verl's default
        f"{prefix}.dtype=float32",
        f"{prefix}.use_distributed_optimizer=False",
        f"{prefix}.seed={run.seed}",
        *(f"++{prefix}.override_transformer_config.{key}={value}" for key, value in HOST_TRANSFORMER_CONFIG.items()),
    ]


def cpu_overlay(run: CpuRun) -> list[str]:
    """The overrides that make the GPU recipe a CPU run of the counting task (files relative to the task dir)."""
    check_batch_sizes(run)
    batch, dp, task = run.prompts_per_step, run.shape.dp, run.assets
    return [
        f"data.train_files={task.relative(task.train)}",
        f"data.val_files={task.relative(task.test)}",
        f"data.train_batch_size={batch}",
        "data.max_prompt_length=8",
        f"data.max_response_length={RESPONSE_LENGTH}",
        "data.filter_overlong_prompts=False",
        f"data.seed={run.seed}",
        "data.dataloader_num_workers=0",
        f"actor_rollout_ref.model.path={task.relative(task.model)}",
        f"actor_rollout_ref.model.external_lib={PLUGIN}",
        f"actor_rollout_ref.actor.optim.lr={run.learning_rate}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={batch // run.mini_batches}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={run.responses_per_mini_batch // dp}",
        "actor_rollout_ref.actor.kl_loss_coef=0.001",
        *megatron_overlay("actor_rollout_ref.actor.megatron", run),
        *megatron_overlay("actor_rollout_ref.ref.megatron", run),
        *rollout_overlay(run.rollout),
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",  # one replica per worker slot
        f"actor_rollout_ref.rollout.n={run.group_size}",
        "actor_rollout_ref.rollout.temperature=1.0",
        f"actor_rollout_ref.rollout.seed={run.seed}",
        "actor_rollout_ref.rollout.checkpoint_engine.backend=naive",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={batch * run.group_size // 2 // dp}",
        f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={batch * run.group_size // 2 // dp}",
        f"reward.custom_reward_function.path={task.relative(task.reward)}",
        "reward.custom_reward_function.name=compute_score",
        "reward.num_workers=1",  # 8 reward and 8 agent-loop processes by default: too many for 2 cores
        "actor_rollout_ref.rollout.agent.num_workers=1",
        "actor_rollout_ref.rollout.calculate_log_probs=True",  # verl's rollout_probs_diff metrics need them
        "trainer.device=cpu",
        f"trainer.nnodes={run.shape.nnodes}",
        f"trainer.n_gpus_per_node={run.shape.workers_per_node}",
        f"trainer.total_training_steps={run.steps}",
        "trainer.total_epochs=1000",
        "trainer.save_freq=-1",
        "trainer.test_freq=-1",
        "trainer.val_before_train=False",
        "trainer.logger=[console,file]",
        f"trainer.default_local_dir={run.output_dir / 'checkpoints'}",
        "trainer.project_name=verl_cppack",
        "trainer.experiment_name=grpo_cpu",
        # the v1 trainer's TransferQueue: 8 storage units on 2 cores stalled for minutes (docs/design.md)
        "transfer_queue.backend.SimpleStorage.num_data_storage_units=2",
    ]


def merge_overrides(*groups: Sequence[str]) -> list[str]:
    """Concatenate override lists; a key given again replaces the earlier value in place of the first."""
    merged: dict[str, str] = {}
    for group in groups:
        for override in group:
            if "=" not in override:
                raise ValueError(f"override {override!r} is not KEY=VALUE")
            key = override.split("=", 1)[0]
            bare = key.lstrip("+~")
            for existing in [k for k in merged if k.lstrip("+~") == bare]:
                del merged[existing]
            merged[key] = override
    return list(merged.values())


def verl_config_dir() -> str:
    import verl

    return str(Path(verl.__file__).parent / "trainer" / "config")


def compose_trainer_config(overrides: Sequence[str]):
    """verl's trainer config with ``overrides`` applied (strict: an unknown key raises ``ValueError``)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=verl_config_dir(), version_base=None):
            return compose(config_name=CONFIG_NAME, overrides=list(overrides))
    except (HydraException, OmegaConfBaseException) as error:
        raise ValueError(f"verl's trainer config rejects the overrides: {error}") from error
