"""The project's own RL driver, kept for ``verl-cppack ppo`` until it moves to verl's trainer: Ray CP workers, the
step loop, metrics, plot and summary. (GRPO runs through verl's own trainer: ``verl_cppack.jobs.grpo``.)

``run_training(config, make_step)`` is the reusable loop (Ray session, worker group, output directory,
progress bar, metrics.jsonl, reward curve, summary, fault and Ctrl-C handling); ``grpo_step`` is one GRPO
step. A PPO runner passes a ``worker_class`` that also holds a critic and its own step function.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from verl_cppack.rl.advantages import group_normalized_advantages
from verl_cppack.rl.cluster import WorkerError, WorkerGroup, ray_session
from verl_cppack.jobs.output import MetricsWriter, fifth_means, fresh_output_dir, plot_reward_curve
from verl_cppack.rl.task import CountingTask
from verl_cppack.rl.worker import CPWorker, WorkerSettings


@dataclass(frozen=True)
class GRPOConfig:
    cp: int = 2
    steps: int = 30
    prompts_per_step: int = 16
    group_size: int = 8
    num_mini_batches: int = 2
    temperature: float = 1.0
    seed: int = 0
    output: str = "runs/grpo"
    address: str | None = None
    call_timeout_s: float = 120.0
    task: CountingTask = field(default_factory=CountingTask)
    worker: WorkerSettings = field(default_factory=WorkerSettings)

    def __post_init__(self) -> None:
        for name in ("cp", "steps", "prompts_per_step", "num_mini_batches"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        self._check_group_size()
        if (self.prompts_per_step * self.group_size) % self.num_mini_batches != 0:
            raise ValueError(
                f"prompts_per_step*group_size={self.prompts_per_step * self.group_size} must be divisible by "
                f"num_mini_batches={self.num_mini_batches}"
            )
        if self.worker.vocab_size != self.task.vocab_size:
            raise ValueError(f"worker.vocab_size={self.worker.vocab_size} != task.vocab_size={self.task.vocab_size}")
        if self.task.sequence_length > self.worker.max_sequence_length:
            raise ValueError(
                f"task sequences ({self.task.sequence_length} tokens) exceed the model's max_sequence_length "
                f"({self.worker.max_sequence_length})"
            )

    def _check_group_size(self) -> None:
        """GRPO needs >= 2 responses per prompt; a subclass (PPO with a critic) may allow fewer."""
        if self.group_size < 2:
            raise ValueError(f"group_size must be >= 2 (GRPO's baseline is the group mean), got {self.group_size}")


@dataclass
class RunResult:
    output_dir: Path
    records: list[dict[str, Any]]
    summary: dict[str, Any]


StepFunction = Callable[[int], dict[str, Any]]


def rollout_batch(workers: WorkerGroup, config: GRPOConfig, step: int) -> dict[str, torch.Tensor]:
    """Sample prompts, ``group_size`` responses each, and score them; returns the padded [B, S] batch."""
    task = config.task
    generator = torch.Generator().manual_seed(config.seed * 1_000_003 + step)
    prompt_ids, prompt_mask = task.sample_prompts(config.prompts_per_step, generator)  # [N, P]
    prompt_ids = prompt_ids.repeat_interleave(config.group_size, dim=0)  # [N*G, P], groups consecutive
    prompt_mask = prompt_mask.repeat_interleave(config.group_size, dim=0)
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=generator))
    responses = workers.call("generate", prompt_ids, prompt_mask, task.response_length, config.temperature, seed)[0]
    input_ids = torch.cat([prompt_ids, responses], dim=1)  # [B, S]
    attention_mask = torch.cat([prompt_mask, torch.ones_like(responses, dtype=torch.bool)], dim=1)  # [B, S]
    # Next-token alignment (verl's): position t scores token t+1, so response token j is scored at P-1+j.
    loss_mask = torch.zeros_like(attention_mask)
    loss_mask[:, prompt_ids.shape[1] - 1 : -1] = True
    return dict(
        prompt_ids=prompt_ids,
        responses=responses,
        input_ids=input_ids,
        attention_mask=attention_mask,
        loss_mask=loss_mask,
        rewards=task.reward(prompt_ids, responses),  # [B]
    )


def make_grpo_step(workers: WorkerGroup, config: GRPOConfig) -> StepFunction:
    def grpo_step(step: int) -> dict[str, Any]:
        timings = {}
        started = time.perf_counter()
        batch = rollout_batch(workers, config, step)
        timings["time_rollout_s"] = time.perf_counter() - started

        mark = time.perf_counter()
        ids, mask, loss_mask = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
        ref_log_probs, _ = workers.call("log_probs", ids, mask, "reference", False)[0]
        timings["time_ref_s"] = time.perf_counter() - mark

        mark = time.perf_counter()
        old_log_probs, entropy = workers.call("log_probs", ids, mask, "policy", True)[0]
        timings["time_old_s"] = time.perf_counter() - mark

        advantages = group_normalized_advantages(batch["rewards"], loss_mask, config.group_size)  # [B, S]
        update_batch = dict(
            input_ids=ids,
            attention_mask=mask,
            loss_mask=loss_mask,
            old_log_probs=old_log_probs,
            ref_log_probs=ref_log_probs,
            advantages=advantages,
        )
        mark = time.perf_counter()
        update_metrics = workers.call("update", update_batch, config.num_mini_batches)[0]
        timings["time_update_s"] = time.perf_counter() - mark
        timings["time_step_s"] = time.perf_counter() - started

        token_count = loss_mask.sum()
        return dict(
            step=step,
            reward_mean=float(batch["rewards"].mean()),
            reward_max=float(batch["rewards"].max()),
            kl=update_metrics["kl"],
            pg_loss=update_metrics["pg_loss"],
            clip_fraction=update_metrics["clip_fraction"],
            grad_norm=float(update_metrics["grad_norm"]),
            entropy=float((entropy * loss_mask).sum() / token_count),
            tokens=int(mask.sum()),
            response_tokens=int(token_count),
            cp=config.cp,
            forward=config.worker.forward,
            **{name: round(value, 4) for name, value in timings.items()},
        )

    return grpo_step


class _LineProgress:
    """Fallback progress display (one line per step) when tqdm is not installed."""

    def __init__(self, total: int, desc: str) -> None:
        self.total, self.desc, self.count, self.postfix = total, desc, 0, {}

    def set_postfix(self, **values: str) -> None:
        self.postfix = values

    def update(self, count: int) -> None:
        self.count += count
        details = " ".join(f"{name}={value}" for name, value in self.postfix.items())
        print(f"{self.desc}: step {self.count}/{self.total} {details}", file=sys.stderr, flush=True)

    def close(self) -> None:
        pass


def _progress(total: int, desc: str):
    try:
        from tqdm import tqdm
    except ImportError:
        return _LineProgress(total, desc)
    return tqdm(total=total, desc=desc, unit="step", file=sys.stderr, dynamic_ncols=True)


def run_training(
    config: GRPOConfig,
    make_step: Callable[[WorkerGroup, GRPOConfig], StepFunction] = make_grpo_step,
    *,
    job: str = "grpo",
    worker_class: type = CPWorker,
) -> RunResult:
    """Run ``config.steps`` steps of ``make_step`` on a fresh CP worker group; write outputs; return them.

    Worker faults raise ``WorkerError``; Ctrl-C raises ``KeyboardInterrupt``. Either way the actors are
    killed and a Ray cluster started here is shut down before the exception leaves this function.
    """
    output_dir = fresh_output_dir(config.output)
    (output_dir / "config.json").write_text(json.dumps(asdict(config), indent=2, default=str) + "\n")
    records: list[dict[str, Any]] = []
    started = time.perf_counter()
    with ray_session(config.address, num_cpus=max(2, config.cp)) as _started_here:
        workers = WorkerGroup(config.cp, config.worker, call_timeout_s=config.call_timeout_s, worker_class=worker_class)
        writer = MetricsWriter(output_dir / "metrics.jsonl")
        bar = _progress(config.steps, job)
        try:
            forward_path = workers.start(with_policy=True)[0]["forward"]
            step_fn = make_step(workers, config)
            for step in range(config.steps):
                record = step_fn(step)
                writer.write(record)
                records.append(record)
                bar.set_postfix(reward=f"{record['reward_mean']:.3f}", kl=f"{record['kl']:.4f}")
                bar.update(1)
        finally:
            bar.close()
            writer.close()
            workers.shutdown()
    summary = summarize(records, output_dir, time.perf_counter() - started, config, job, forward_path)
    return RunResult(output_dir=output_dir, records=records, summary=summary)


def summarize(
    records: list[dict[str, Any]], output_dir: Path, wall_s: float, config: GRPOConfig, job: str, forward_path: str
) -> dict[str, Any]:
    first, last = fifth_means([record["reward_mean"] for record in records])
    plot_note = plot_reward_curve(records, output_dir / "reward_curve.png", title=job.upper())
    summary = dict(
        job=job,
        steps=len(records),
        cp=config.cp,
        reward_first_fifth=round(first, 4),
        reward_last_fifth=round(last, 4),
        reward_gain=round(last - first, 4),
        final_kl=records[-1]["kl"],
        wall_s=round(wall_s, 1),
        output_dir=str(output_dir),
        reward_curve=None if plot_note else str(output_dir / "reward_curve.png"),
        notes=[plot_note] if plot_note else [],
        logprob_path=forward_path,
    )
    (output_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


__all__ = ["GRPOConfig", "RunResult", "WorkerError", "make_grpo_step", "rollout_batch", "run_training"]
