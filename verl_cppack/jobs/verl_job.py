"""A job that runs verl's own trainer (``verl.trainer.main_ppo``) on the counting task, on this machine's CPU.

A ``JobKind`` (``grpo.py``, ``ppo.py``) names a GPU recipe and what its CPU run adds."""

from __future__ import annotations

import contextlib
import io
import json
import math
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from verl_cppack.core.checks import require_int
from verl_cppack.jobs.call_counts import read_call_records, read_ray_call_records
from verl_cppack.jobs.counting_task import ensure_counting_assets
from verl_cppack.jobs.launcher import FIRST_STEP_TIMEOUT_S, STEP_TIMEOUT_S, TrainerRun, run_trainer, summarize
from verl_cppack.jobs.output import Panel, fresh_output_dir, plot_panels
from verl_cppack.jobs.parallel_shape import ParallelShape
from verl_cppack.jobs.ray_cluster import ClusterSession, ray_host_port
from verl_cppack.jobs.rollout_choice import DEFAULT_ROLLOUT, ROLLOUTS, rollout_label, vllm_start_problem
from verl_cppack.jobs.trainer_config import (
    CpuRun,
    compose_trainer_config,
    cpu_overlay,
    merge_overrides,
    recipe_overrides,
)
from verl_cppack.jobs.worker_env import VLLM_CPU_KVCACHE_GIB as VLLM_KV_GIB

TRAINERS = {"v1": "True", "v0": "False"}  # --trainer -> trainer.use_v1; verl 0.9.1's default is v1


@dataclass(frozen=True)
class JobKind:
    name: str  # "grpo" / "ppo": the subcommand and the default output directory
    recipe: str  # the GPU recipe in recipes/ whose overrides come first
    overlay: Callable[[CpuRun], list[str]]  # what this kind adds to the common CPU overlay
    panels: tuple[Panel, ...]  # curves drawn from metrics.jsonl (reward_curve.png, ...)
    summary: Callable[[Sequence[dict[str, Any]]], dict[str, Any]] = lambda records: {}
    min_group_size: int = 1  # GRPO normalises rewards within a group: 2
    # what the composed config needs that this kind makes itself (ppo: the critic's checkpoint), before it is checked
    make_assets: Callable[[CpuRun, Any], None] = lambda run, config: None


@dataclass(frozen=True)
class JobSettings(ParallelShape):  # tp, cp, dp, nnodes, then:
    steps: int = 30
    output: str | None = None  # default: runs/<kind>
    address: str | None = None
    trainer: str = "v1"
    seed: int = 0
    prompts_per_step: int = 16
    group_size: int = 8
    learning_rate: float = 3e-3
    overrides: tuple[str, ...] = ()
    verbose: bool = False
    rollout: str = DEFAULT_ROLLOUT  # vllm (verl's vLLM rollout on vLLM's CPU build) | hf (Hugging Face generate)
    step_timeout_s: float = STEP_TIMEOUT_S  # the longest wait for a step; the first's at least FIRST_STEP_TIMEOUT_S

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("steps", "prompts_per_step", "group_size"):
            require_int(name, getattr(self, name), minimum=1)
        require_int("seed", self.seed, minimum=0)
        if self.rollout not in ROLLOUTS:
            raise ValueError(f"rollout must be one of {list(ROLLOUTS)}, got {self.rollout!r}")
        if self.trainer not in TRAINERS:
            raise ValueError(f"trainer must be one of {sorted(TRAINERS)}, got {self.trainer!r}")
        if not (isinstance(self.learning_rate, float) and 0 < self.learning_rate < 1):
            raise ValueError(f"learning rate must be a float in (0, 1), got {self.learning_rate!r}")
        timeout = self.step_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < math.inf:
            raise ValueError(f"step timeout must be a positive, finite number of seconds, got {timeout!r}")
        if self.address is not None:
            ray_host_port(self.address)
        elif self.nnodes > 1:
            raise ValueError(
                f"nnodes={self.nnodes} needs --address (or RAY_ADDRESS) of a running Ray cluster with that many nodes; "
                "the local cluster this job starts is one node"
            )
        bad = [o for o in self.overrides if "=" not in o or o.startswith("-")]
        if bad:
            raise ValueError(f"Hydra overrides must be KEY=VALUE, got {bad}")

    @property
    def shape(self) -> ParallelShape:
        return ParallelShape(tp=self.tp, cp=self.cp, dp=self.dp, nnodes=self.nnodes)


@dataclass
class PreparedJob:
    kind: JobKind
    settings: JobSettings
    overrides: list[str]
    output_dir: Path
    task_dir: Path  # shipped to every Ray worker as its working directory
    config: Any = field(repr=False)


def prepare_job(kind: JobKind, settings: JobSettings, output_dir: Path | None = None) -> PreparedJob:
    """Check everything that can be checked without Ray; compose verl's config (``ValueError`` on any problem)."""
    if settings.group_size < kind.min_group_size:
        raise ValueError(f"group_size must be >= {kind.min_group_size} for {kind.name}, got {settings.group_size}")
    # absolute: verl's processes run in the task directory
    output_dir = (output_dir or fresh_output_dir(settings.output or f"runs/{kind.name}")).resolve()
    run = _from_settings(CpuRun, settings, assets=ensure_counting_assets(), output_dir=output_dir)
    overrides = merge_overrides(
        recipe_overrides(kind.recipe),
        cpu_overlay(run),
        kind.overlay(run),
        [f"trainer.use_v1={TRAINERS[settings.trainer]}", f"trainer.experiment_name={kind.name}_cpu"],
        settings.overrides,
    )
    config = compose_trainer_config(overrides)
    kind.make_assets(run, config)
    check_composed(config, run.assets.root)
    return PreparedJob(kind, settings, overrides, output_dir, run.assets.root, config)


def _from_settings(target: type, settings: JobSettings, **values: Any) -> Any:
    """``target(**values)`` with its other fields taken from the settings' fields (and ``shape``) of the same name."""
    names = {field.name for field in fields(target)} - values.keys()
    return target(**{name: getattr(settings, name) for name in names if hasattr(settings, name)}, **values)


def check_composed(config: Any, task_dir: Path) -> None:
    """What verl would only find out inside Ray: a missing model directory (relative to ``task_dir``), a model TP
    cannot split, an inconsistent config."""
    from hydra.errors import InstantiationException

    from verl_cppack import runtime

    runtime.activate()  # this process validates a CPU run: verl's config classes must see what the workers will
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    with warnings.catch_warnings():  # need_critic warns that GRPO has no critic: verl's note, not the user's problem
        warnings.simplefilter("ignore")
        use_critic, use_reference = need_critic(config), need_reference_policy(config)
    for key in ("actor_rollout_ref.model.path", *(("critic.model.path",) if use_critic else ())):
        path = task_dir / Path(str(_select(config, key))).expanduser()  # an absolute path stays itself
        if not (path / "config.json").is_file():
            raise ValueError(
                f"{key}={path} is not a Hugging Face checkpoint directory (no config.json); nothing can be "
                "downloaded on this machine, so pass a local directory"
            )
        check_tensor_parallel_split(key, json.loads((path / "config.json").read_text()), config)
    rollout = config.actor_rollout_ref.rollout
    if str(rollout.name) == "vllm" and bool(rollout.enable_sleep_mode):
        raise ValueError(
            "actor_rollout_ref.rollout.enable_sleep_mode=True: vLLM's CPU platform has no sleep mode; leave it False"
        )
    if str(config.trainer.device) != "cpu":
        raise ValueError(f"this job runs verl on the host: trainer.device must be cpu, got {config.trainer.device}")
    try:
        # in the task directory, as every worker runs: verl's config classes open the model files the config names
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), contextlib.chdir(task_dir):
            warnings.simplefilter("ignore")  # verl's notes go to trainer.log
            validate_config(config=config, use_reference_policy=use_reference, use_critic=use_critic)
    except (AssertionError, ValueError, TypeError, InstantiationException) as error:
        raise ValueError(f"verl's validate_config rejects the configuration: {error}") from error


def check_tensor_parallel_split(key: str, model_config: dict[str, Any], config: Any) -> None:
    """Megatron splits attention heads and key-value groups over TP ranks: TP must divide both."""
    prefix = "critic.megatron" if key.startswith("critic") else "actor_rollout_ref.actor.megatron"
    tp = int(_select(config, f"{prefix}.tensor_model_parallel_size"))
    heads = int(model_config.get("num_attention_heads", 1))
    groups = int(model_config.get("num_key_value_heads") or heads)
    if heads % tp or groups % tp:
        raise ValueError(
            f"tp={tp} does not divide the model's {heads} attention heads and {groups} key-value heads ({key}); "
            f"pick --tp among {[t for t in range(1, heads + 1) if heads % t == 0 and groups % t == 0]}"
        )


def _select(config: Any, dotted: str) -> Any:
    from omegaconf import OmegaConf

    return OmegaConf.select(config, dotted)


PROGRESS_FIELDS = (  # metric, label, format; a metric the step did not log is left out (e.g. pg_loss in critic warm-up)
    ("actor/pg_loss", "pg_loss", "{:+.4f}"),
    ("critic/vf_loss", "vf_loss", "{:.4f}"),
    ("critic/vf_explained_var", "vf_ev", "{:+.3f}"),
    ("training/rollout_probs_diff_max", "probs_diff_max", "{:.1e}"),
)


def progress_line(record: dict[str, Any], total_steps: int) -> str:
    parts = [f"step {record['step']}/{total_steps}", f"reward {record['reward_mean']:.3f}"]
    parts += [f"{label} {form.format(record[key])}" for key, label, form in PROGRESS_FIELDS if key in record]
    if "timing_s/step" in record:
        parts.append(f"{record['timing_s/step']:.1f}s")
    return "  ".join(parts)


class RolloutUnavailable(ValueError):
    """``--rollout vllm`` cannot start on this machine (exit 2: nothing was started)."""


def check_rollout(prepared: PreparedJob) -> None:
    """``RolloutUnavailable`` naming why vLLM cannot start here and ``--rollout hf``; nothing for ``hf``."""
    settings = prepared.settings
    if settings.rollout != "vllm":
        return
    problem = vllm_start_problem(settings.shape.workers, local=settings.address is None, kv_cache_gib=VLLM_KV_GIB)
    if problem is not None:
        raise RolloutUnavailable(f"--rollout vllm cannot start: {problem}; pass --rollout hf (Hugging Face generate)")


def run_job(prepared: PreparedJob, on_step: Callable[[dict[str, Any]], None] = lambda record: None) -> dict[str, Any]:
    """Start or join the Ray cluster, check it can hold the job, run verl's trainer on it, write the outputs;
    return the summary. ``ClusterTooSmall`` before anything starts; ``TrainerFailed`` / ``ClusterUnavailable``."""
    import verl

    kind, settings, output_dir = prepared.kind, prepared.settings, prepared.output_dir
    check_rollout(prepared)
    (output_dir / "config.json").write_text(
        json.dumps({"job": kind.name, "settings": asdict(settings), "overrides": prepared.overrides}, indent=2)
    )
    started = time.monotonic()
    session = ClusterSession.open(settings.address, settings.shape)
    try:
        run = _from_settings(
            TrainerRun,
            settings,
            overrides=prepared.overrides,
            output_dir=output_dir,
            address=session.address,
            task_dir=prepared.task_dir,
            first_step_timeout_s=max(settings.step_timeout_s, FIRST_STEP_TIMEOUT_S),
        )
        records = run_trainer(run, on_step, watch=session.watch)
        call_records = read_ray_call_records(run.call_count_key, delete=True) + read_call_records(run.call_count_dir)
    finally:
        session.close()
    summary = {"job": kind.name, **summarize(records, call_records, run, time.monotonic() - started, verl.__version__)}
    summary.update(trainer_version=settings.trainer, rollout=rollout_label(settings.rollout), **kind.summary(records))
    summary["plots"] = write_plots(kind, records, output_dir)
    (output_dir / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True))
    return summary


def write_plots(kind: JobKind, records: Sequence[dict[str, Any]], output_dir: Path) -> list[str]:
    """``reward_curve.png`` (reward and actor panels) and, for a job with a critic, ``critic_curve.png``."""
    written = []
    for name, critic in (("reward_curve.png", False), ("critic_curve.png", True)):
        present = [
            panel
            for panel in kind.panels
            if panel.key.startswith("critic/vf") == critic and all(panel.key in record for record in records)
        ]
        title = f"verl {kind.name.upper()}, counting task"
        if present and plot_panels(records, output_dir / name, title, present) is None:
            written.append(str(output_dir / name))
    return written
