"""PPO with a critic on Ray CP workers: the GRPO runner with GAE advantages from the critic's values.

Each step (verl's ``RayPPOTrainer`` order):

1. sample responses and score them with the rule reward (the reward sits on each response's last token);
2. reference and old log-probs through the policy's forward path, the critic's values through
   ``gptmodel_forward_model_engine(value_model=True)`` patched by verl_cppack (packed THD, zigzag CP);
3. GAE advantages and returns (``gamma``, ``lam``) on the response tokens; advantages whitened;
4. update the critic (clipped value loss), then the actor (clipped PPO objective + k3 KL penalty).

The loop, output directory, progress bar, metrics, reward curve, summary and fault handling are
``grpo.run_training``'s; this module adds the step, the critic worker class and a critic plot.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from verl_cppack.rl.cluster import WorkerGroup
from verl_cppack.rl.critic import explained_variance
from verl_cppack.rl.gae import gae_advantages, whiten
from verl_cppack.rl.grpo import GRPOConfig, RunResult, StepFunction, rollout_batch, run_training
from verl_cppack.jobs.output import Panel, plot_panels
from verl_cppack.rl.ppo_worker import PPOWorker, PPOWorkerSettings


@dataclass(frozen=True)
class PPOConfig(GRPOConfig):
    """``GRPOConfig`` (rollout, optimisation, Ray) plus GAE's ``gamma`` / ``lam`` and the critic's settings.

    ``group_size`` is the number of responses per prompt (verl's ``rollout.n``); 1 is allowed: the critic,
    not the group, is the baseline. ``critic_warmup`` steps update only the critic (verl's ``trainer.critic_warmup``).
    """

    prompts_per_step: int = 32
    group_size: int = 4
    output: str = "runs/ppo"
    worker: PPOWorkerSettings = field(default_factory=PPOWorkerSettings)
    gamma: float = 1.0
    lam: float = 0.95
    critic_warmup: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.worker, PPOWorkerSettings):
            raise TypeError(f"PPOConfig.worker must be PPOWorkerSettings, got {type(self.worker).__name__}")
        for name in ("gamma", "lam"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must lie in [0, 1], got {getattr(self, name)}")
        if not 0 <= self.critic_warmup < self.steps:
            raise ValueError(f"critic_warmup must be in [0, steps={self.steps}), got {self.critic_warmup}")

    def _check_group_size(self) -> None:
        if self.group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {self.group_size}")


def outcome_token_rewards(rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Sequence rewards ``[B]`` placed on each row's last response position: ``[B, S]`` float32, zero elsewhere.

    Every row needs at least one response position (a row without one has nowhere to put its reward).
    """
    if rewards.dim() != 1 or response_mask.dim() != 2 or rewards.shape[0] != response_mask.shape[0]:
        raise ValueError(
            f"rewards must be [B] and response_mask [B, S] with the same B, got {tuple(rewards.shape)} and "
            f"{tuple(response_mask.shape)}"
        )
    mask = response_mask.bool()
    if not bool(mask.any(dim=1).all()):
        raise ValueError("every row of response_mask needs at least one response position")
    # the running count reaches its maximum first at the row's last response position
    last = mask.long().cumsum(dim=1).argmax(dim=1, keepdim=True)  # [B, 1]
    token_rewards = torch.zeros(mask.shape, dtype=torch.float32, device=rewards.device)  # [B, S]
    return token_rewards.scatter_(1, last, rewards.float().unsqueeze(1))


def make_ppo_step(workers: WorkerGroup, config: PPOConfig) -> StepFunction:
    def ppo_step(step: int) -> dict[str, Any]:
        timings = {}
        started = time.perf_counter()
        batch = rollout_batch(workers, config, step)
        timings["time_rollout_s"] = time.perf_counter() - started

        ids, mask, loss_mask = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
        mark = time.perf_counter()
        ref_log_probs, _ = workers.call("log_probs", ids, mask, "reference", False)[0]
        timings["time_ref_s"] = time.perf_counter() - mark

        mark = time.perf_counter()
        old_log_probs, entropy = workers.call("log_probs", ids, mask, "policy", True)[0]
        timings["time_old_s"] = time.perf_counter() - mark

        mark = time.perf_counter()
        values = workers.call("values", ids, mask)[0]  # [B, S]
        timings["time_values_s"] = time.perf_counter() - mark

        token_rewards = outcome_token_rewards(batch["rewards"], loss_mask)  # [B, S]
        advantages, returns = gae_advantages(token_rewards, values, loss_mask, gamma=config.gamma, lam=config.lam)
        mark = time.perf_counter()
        critic_metrics = workers.call(
            "update_critic",
            dict(input_ids=ids, attention_mask=mask, loss_mask=loss_mask, old_values=values, returns=returns),
            config.num_mini_batches,
        )[0]
        timings["time_update_critic_s"] = time.perf_counter() - mark

        mark = time.perf_counter()
        actor_update = step >= config.critic_warmup
        if actor_update:
            actor_metrics = workers.call(
                "update",
                dict(
                    input_ids=ids,
                    attention_mask=mask,
                    loss_mask=loss_mask,
                    old_log_probs=old_log_probs,
                    ref_log_probs=ref_log_probs,
                    advantages=whiten(advantages, loss_mask),
                ),
                config.num_mini_batches,
            )[0]
        else:
            actor_metrics = dict(pg_loss=0.0, kl=0.0, clip_fraction=0.0, grad_norm=0.0)
        timings["time_update_actor_s"] = time.perf_counter() - mark
        timings["time_step_s"] = time.perf_counter() - started

        response = loss_mask.bool()
        token_count = loss_mask.sum()
        return dict(
            step=step,
            reward_mean=float(batch["rewards"].mean()),
            reward_max=float(batch["rewards"].max()),
            kl=actor_metrics["kl"],
            pg_loss=actor_metrics["pg_loss"],
            clip_fraction=actor_metrics["clip_fraction"],
            grad_norm=float(actor_metrics["grad_norm"]),
            actor_updated=actor_update,
            value_loss=critic_metrics["value_loss"],
            value_clip_fraction=critic_metrics["value_clip_fraction"],
            critic_grad_norm=critic_metrics["critic_grad_norm"],
            explained_variance=explained_variance(values, returns, response),
            value_mean=float((values * loss_mask).sum() / token_count),
            return_mean=float((returns * loss_mask).sum() / token_count),
            advantage_abs_mean=float((advantages.abs() * loss_mask).sum() / token_count),
            entropy=float((entropy * loss_mask).sum() / token_count),
            tokens=int(mask.sum()),
            response_tokens=int(token_count),
            cp=config.cp,
            forward=config.worker.forward,
            **{name: round(value, 4) for name, value in timings.items()},
        )

    return ppo_step


def plot_critic_curve(records: list[dict[str, Any]], path: Path) -> str | None:
    """Value loss and explained variance per step (a fresh critic starts far below -1; [-1, 1] is shown)."""
    panels = [
        Panel("value_loss", "clipped value loss", "tab:green", log_scale=True),
        Panel("explained_variance", "explained variance", "tab:purple", ylim=(-1.0, 1.0)),
    ]
    return plot_panels(records, path, "PPO critic", panels)


def run_ppo(config: PPOConfig) -> RunResult:
    """Run PPO with a critic on a fresh CP worker group; outputs as ``run_grpo`` plus ``critic_curve.png``."""
    critic_paths: list[str] = []

    def make_step(workers: WorkerGroup, run_config: PPOConfig) -> StepFunction:
        critic_paths.append(workers.infos[0]["critic_forward"] if workers.infos else "unknown")
        return make_ppo_step(workers, run_config)

    result = run_training(config, make_step, job="ppo", worker_class=PPOWorker)
    summary, records = result.summary, result.records
    width = max(1, len(records) // 5)
    summary.update(
        final_value_loss=records[-1]["value_loss"],
        explained_variance_last_fifth=round(sum(r["explained_variance"] for r in records[-width:]) / width, 4),
        gamma=config.gamma,
        lam=config.lam,
        value_path=critic_paths[0] if critic_paths else "unknown",
    )
    note = plot_critic_curve(records, result.output_dir / "critic_curve.png")
    summary["critic_curve"] = None if note else str(result.output_dir / "critic_curve.png")
    if note:
        summary["notes"].append(note)
    (result.output_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return result


__all__ = ["PPOConfig", "make_ppo_step", "outcome_token_rewards", "plot_critic_curve", "run_ppo"]
