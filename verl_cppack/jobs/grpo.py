"""The main job: GRPO through verl's own trainer on the counting task, Megatron actor and reference at CP=N.

``prepare_grpo(settings)`` checks every input and composes the full trainer configuration before anything
starts (a bad value or an unknown Hydra key is a ``ValueError``); ``run_grpo(prepared)`` runs
``verl.trainer.main_ppo`` and writes ``metrics.jsonl``, ``summary.json``, ``config.json`` and
``reward_curve.png`` into a fresh output directory.
"""

from __future__ import annotations

import contextlib
import io
import json
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from verl_cppack.core.checks import require_int
from verl_cppack.jobs.counting_task import ensure_counting_assets
from verl_cppack.jobs.launcher import TrainerRun, ray_host_port, run_trainer, summarize
from verl_cppack.jobs.output import Panel, fresh_output_dir, plot_panels
from verl_cppack.jobs.trainer_config import (
    CpuRun,
    compose_trainer_config,
    cpu_overlay,
    merge_overrides,
    recipe_overrides,
)

GRPO_RECIPE = "gsm8k_grpo_megatron_cp2.sh"
TRAINERS = {"v1": "True", "v0": "False"}  # --trainer -> trainer.use_v1; verl 0.9.1's default is v1


@dataclass(frozen=True)
class GrpoSettings:
    cp: int = 2
    steps: int = 30
    output: str = "runs/grpo"
    address: str | None = None
    trainer: str = "v1"
    seed: int = 0
    prompts_per_step: int = 16
    group_size: int = 8
    learning_rate: float = 3e-3
    overrides: tuple[str, ...] = ()
    verbose: bool = False

    def __post_init__(self) -> None:
        for name in ("cp", "steps", "prompts_per_step", "group_size"):
            require_int(name, getattr(self, name), minimum=1)
        require_int("seed", self.seed, minimum=0)
        if self.group_size < 2:
            raise ValueError(f"group_size must be >= 2 (GRPO normalises rewards within a group), got {self.group_size}")
        if self.trainer not in TRAINERS:
            raise ValueError(f"trainer must be one of {sorted(TRAINERS)}, got {self.trainer!r}")
        if not (isinstance(self.learning_rate, float) and 0 < self.learning_rate < 1):
            raise ValueError(f"learning rate must be a float in (0, 1), got {self.learning_rate!r}")
        if self.address is not None:
            ray_host_port(self.address)
        bad = [o for o in self.overrides if "=" not in o or o.startswith("-")]
        if bad:
            raise ValueError(f"Hydra overrides must be KEY=VALUE, got {bad}")


@dataclass
class PreparedGrpo:
    settings: GrpoSettings
    overrides: list[str]
    output_dir: Path
    config: Any = field(repr=False)


def prepare_grpo(settings: GrpoSettings, output_dir: Path | None = None) -> PreparedGrpo:
    """Check everything that can be checked without Ray; compose verl's config (``ValueError`` on any problem)."""
    output_dir = output_dir or fresh_output_dir(settings.output)
    assets = ensure_counting_assets()
    run = CpuRun(
        assets=assets, cp=settings.cp, steps=settings.steps, prompts_per_step=settings.prompts_per_step,
        group_size=settings.group_size, seed=settings.seed, learning_rate=settings.learning_rate,
        output_dir=output_dir,
    )  # fmt: skip
    overrides = merge_overrides(
        recipe_overrides(GRPO_RECIPE), cpu_overlay(run), [f"trainer.use_v1={TRAINERS[settings.trainer]}"],
        settings.overrides,
    )  # fmt: skip
    config = compose_trainer_config(overrides)
    check_composed(config)
    return PreparedGrpo(settings, overrides, output_dir, config)


def check_composed(config: Any) -> None:
    """What verl would only find out inside Ray: a model directory that is not there, an inconsistent config."""
    from hydra.errors import InstantiationException

    from verl_cppack.integrations.verl import cpu

    cpu.activate()  # this process validates a CPU run: verl's config classes must see what the workers will
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    model_path = Path(str(config.actor_rollout_ref.model.path)).expanduser()
    if not (model_path / "config.json").is_file():
        raise ValueError(
            f"actor_rollout_ref.model.path={model_path} is not a Hugging Face checkpoint directory (no config.json); "
            "nothing can be downloaded on this machine, so pass a local directory"
        )
    if str(config.trainer.device) != "cpu":
        raise ValueError(f"this job runs verl on the host: trainer.device must be cpu, got {config.trainer.device}")
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):  # verl's notes go to trainer.log
            warnings.simplefilter("ignore")
            validate_config(config=config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
    except (AssertionError, ValueError, TypeError, InstantiationException) as error:
        raise ValueError(f"verl's validate_config rejects the configuration: {error}") from error


def progress_line(record: dict[str, Any], total_steps: int) -> str:
    return (
        f"step {record['step']}/{total_steps}  reward {record['reward_mean']:.3f}  "
        f"pg_loss {record.get('actor/pg_loss', float('nan')):+.4f}  "
        f"probs_diff_max {record.get('training/rollout_probs_diff_max', float('nan')):.1e}  "
        f"{record.get('timing_s/step', float('nan')):.1f}s"
    )


def run_grpo(prepared: PreparedGrpo, on_step: Callable[[dict[str, Any]], None] = lambda record: None) -> dict[str, Any]:
    """Run verl's trainer; write the outputs; return the summary."""
    import verl

    settings, output_dir = prepared.settings, prepared.output_dir
    (output_dir / "config.json").write_text(
        json.dumps({"settings": asdict(settings), "overrides": prepared.overrides}, indent=2, default=str)
    )
    run = TrainerRun(overrides=prepared.overrides, output_dir=output_dir, cp=settings.cp, address=settings.address,
                     verbose=settings.verbose)  # fmt: skip
    started = time.monotonic()
    records = run_trainer(run, on_step)
    summary = summarize(records, run, time.monotonic() - started, verl.__version__)
    summary["trainer_version"] = settings.trainer
    summary["reward_curve"] = write_reward_curve(records, output_dir)
    (output_dir / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True))
    return summary


def write_reward_curve(records: Sequence[dict[str, Any]], output_dir: Path) -> str | None:
    panels = [
        Panel("reward_mean", "mean reward (critic/score/mean)", "tab:blue", ylim=(0, 1)),
        Panel("actor/entropy", "actor entropy", "tab:green"),
    ]
    path = output_dir / "reward_curve.png"
    note = plot_panels(records, path, "verl GRPO, counting task", panels)
    return str(path) if note is None else None
