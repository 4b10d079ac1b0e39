"""``verl-cppack grpo`` and ``verl-cppack ppo``: verl's own trainer on CPU, their flags, the run, the exit codes."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys

from verl_cppack.cli import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_INTERRUPTED, add_command, error
from verl_cppack.jobs.grpo import GRPO
from verl_cppack.jobs.launcher import FIRST_STEP_TIMEOUT_S
from verl_cppack.jobs.ppo import PPO, PPO_DEFAULTS
from verl_cppack.jobs.rollout_choice import ROLLOUTS
from verl_cppack.jobs.verl_job import TRAINERS, JobKind, JobSettings

EXIT_CODES = """Exit codes: 0 done, 2 bad input (nothing started), 3 the trainer or Ray failed, 130 interrupted (the
trainer and the Ray cluster it started are stopped)."""
GRPO_DESCRIPTION = f"""\
``verl-cppack grpo``: GRPO through verl's own trainer (``verl.trainer.main_ppo``) on this machine's CPU.

verl's GSM8K GRPO recipe with a CPU overlay: a tiny Llama and a counting task made locally, the Megatron actor and
reference at context parallelism --cp, verl's vLLM rollout on vLLM's CPU build (``--rollout hf``: Hugging Face
generate), a local Ray cluster (or --address). Extra arguments are Hydra overrides, applied last.
{EXIT_CODES}"""
PPO_DESCRIPTION = f"""\
``verl-cppack ppo``: PPO through verl's own trainer (``verl.trainer.main_ppo``) with a Megatron critic, on CPU.

verl's GSM8K PPO recipe with ``grpo``'s CPU overlay: actor, reference and critic at context parallelism --cp through
verl_cppack's packed CP path. The critic starts from the counting task's reward model (trained once, then cached),
the actor at learning rate 1e-3 with PPO's entropy bonus. Output as ``grpo``'s plus verl's critic metrics and
``critic_curve.png``.
{EXIT_CODES}"""


def add_job_arguments(parser: argparse.ArgumentParser, kind: JobKind, defaults: JobSettings) -> None:
    d = defaults
    flags = (  # flag, the JobSettings field it sets, type, help
        ("--cp", "cp", int, f"context-parallel size of every Megatron model (default {d.cp})"),
        ("--tp", "tp", int, f"tensor-parallel size of every Megatron model (default {d.tp})"),
        ("--dp", "dp", int, f"data-parallel size (default {d.dp}); Ray worker slots = tp x cp x dp"),
        ("--nnodes", "nnodes", int, f"Ray nodes the workers are spread over, the same number on each (default {d.nnodes})"),
        ("--steps", "steps", int, f"training steps (default {d.steps})"),
        ("--seed", "seed", int, f"seed of data order, rollout sampling and Megatron (default {d.seed})"),
        ("--prompts-per-step", "prompts_per_step", int,
         f"prompts per training step, verl's data.train_batch_size (default {d.prompts_per_step})"),
        ("--group-size", "group_size", int, f"responses per prompt, verl's rollout.n (default {d.group_size})"),
        ("--lr", "learning_rate", float, f"actor learning rate (default {d.learning_rate})"),
        ("--step-timeout", "step_timeout_s", float,
         f"stop the run (exit 3) when verl's trainer logs no step for this long (default {d.step_timeout_s:g}); the "
         f"first step, which includes Ray's and vLLM's start-up, may take the larger of this and {FIRST_STEP_TIMEOUT_S:g}"),
    )  # fmt: skip
    for flag, field, value_type, text in flags:
        parser.add_argument(flag, dest=field, type=value_type, default=getattr(d, field), help=text)
    parser.add_argument(
        "--output",
        default=f"runs/{kind.name}",
        help=f"output directory (default runs/{kind.name}); a non-empty one gets a fresh run-* subdirectory",
    )
    parser.add_argument(
        "--address",
        help="join the running Ray cluster at HOST:PORT or 'auto' (default: RAY_ADDRESS if set) instead of "
        "starting a local one; it must offer tp x cp x dp worker slots (Ray GPUs)",
    )
    parser.add_argument(
        "--trainer",
        default=d.trainer,
        choices=sorted(TRAINERS),
        help="verl's trainer: v1 (TransferQueue, verl 0.9.1's default) or v0 (RayPPOTrainer)",
    )
    parser.add_argument(
        "--rollout",
        default=d.rollout,
        choices=list(ROLLOUTS),
        help=f"vllm: verl's vLLM rollout on vLLM's CPU build; hf: Hugging Face generate (default {d.rollout})",
    )
    parser.add_argument(
        "--verbose", action="store_true", help="also print the trainer's output (always in trainer.log)"
    )
    parser.add_argument("overrides", nargs="*", metavar="HYDRA_OVERRIDE", help="verl config overrides, applied last")


def settings_from_args(args: argparse.Namespace) -> JobSettings:
    values = {field.name: getattr(args, field.name) for field in dataclasses.fields(JobSettings)}
    values.update(address=args.address or os.environ.get("RAY_ADDRESS") or None, overrides=tuple(args.overrides))
    return JobSettings(**values)


def print_summary(summary: dict) -> None:
    print(
        "{job} ({trainer}, trainer {trainer_version}, verl {verl_version}, rollout {rollout}): {steps} steps at "
        "TP={tp} CP={cp} DP={dp} on {nodes} node(s) in {wall_s} s; mean reward first fifth {reward_first_fifth:.3f} -> "
        "last fifth {reward_last_fifth:.3f}; rollout_probs_diff_max {rollout_probs_diff_max:.2e}; drop-in calls "
        "{dropin_calls}".format_map(summary)
    )
    if summary.get("explained_variance_last_fifth") is not None:
        print(
            "critic at CP={critic_cp}: explained variance (last fifth) {explained_variance_last_fifth:.3f}, final "
            "vf_loss {vf_loss_final:.4f}".format_map(summary)
        )
    files = ["metrics.jsonl", "summary.json", "config.json", "trainer.log", *map(os.path.basename, summary["plots"])]
    print(f"outputs: {summary['output_dir']} ({', '.join(files)})")


def run_job_command(kind: JobKind, args: argparse.Namespace) -> int:
    from verl_cppack.jobs.launcher import TrainerFailed
    from verl_cppack.jobs.ray_cluster import ClusterTooSmall, ClusterUnavailable
    from verl_cppack.jobs.rollout_choice import rollout_label
    from verl_cppack.jobs.verl_job import check_rollout, prepare_job, progress_line, run_job

    try:
        prepared = prepare_job(kind, settings_from_args(args))
        check_rollout(prepared)  # vLLM can start here (imports, AVX2, memory), before Ray does
    except (TypeError, ValueError) as problem:
        return error(str(problem))
    settings = prepared.settings
    where = f"the Ray cluster at {settings.address}" if settings.address else "a local Ray cluster"
    print(
        f"{kind.name}: verl.trainer.main_ppo at {settings.shape.describe()} with the {rollout_label(settings.rollout)} "
        f"rollout on {where}, {settings.steps} steps -> {prepared.output_dir} (Ray start-up and worker init take one "
        "to two minutes; trainer output in trainer.log)",
        flush=True,
    )
    try:
        summary = run_job(prepared, on_step=lambda record: print(progress_line(record, settings.steps), flush=True))
    except (ClusterTooSmall, TrainerFailed, ClusterUnavailable) as problem:
        return error(str(problem), EXIT_BAD_INPUT if isinstance(problem, ClusterTooSmall) else EXIT_FAILED)
    except KeyboardInterrupt:
        print(
            "interrupted: verl's trainer and its Ray cluster were stopped; finished steps are in metrics.jsonl",
            file=sys.stderr,
        )
        return EXIT_INTERRUPTED
    print_summary(summary)
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    grpo_help = "GRPO through verl's own trainer on CPU, actor and reference at CP=2 (the main job)"
    ppo_help = "PPO through verl's own trainer on CPU: actor, reference and critic at CP=2"
    for kind, help_text, description, defaults in (
        (GRPO, grpo_help, GRPO_DESCRIPTION, JobSettings()),
        (PPO, ppo_help, PPO_DESCRIPTION, PPO_DEFAULTS),
    ):
        parser = add_command(subparsers, kind.name, help_text, description, functools.partial(run_job_command, kind))
        add_job_arguments(parser, kind, defaults)
