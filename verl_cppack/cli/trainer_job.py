"""What ``verl-cppack grpo`` and ``verl-cppack ppo`` share: their flags, the run, the exit codes.

Exit codes: 0 done; 2 bad input (nothing started); 3 verl's trainer or Ray failed; 130 interrupted (the trainer
and the Ray cluster it started are stopped).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from verl_cppack.jobs.launcher import FIRST_STEP_TIMEOUT_S
from verl_cppack.jobs.rollout_choice import ROLLOUTS
from verl_cppack.jobs.verl_job import TRAINERS, JobKind, JobSettings

EXIT_BAD_INPUT, EXIT_TRAINER_FAILED, EXIT_INTERRUPTED = 2, 3, 130


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
        f"{summary['job']} ({summary['trainer']}, trainer {summary['trainer_version']}, verl {summary['verl_version']}, "
        f"rollout {summary['rollout']}): "
        f"{summary['steps']} steps at TP={summary['tp']} CP={summary['cp']} DP={summary['dp']} on {summary['nodes']} "
        f"node(s) in {summary['wall_s']} s; mean reward first fifth "
        f"{summary['reward_first_fifth']:.3f} -> last fifth {summary['reward_last_fifth']:.3f}; "
        f"rollout_probs_diff_max {summary['rollout_probs_diff_max']:.2e}; drop-in calls {summary['dropin_calls']}"
    )
    if summary.get("explained_variance_last_fifth") is not None:
        print(
            f"critic at CP={summary['critic_cp']}: explained variance (last fifth) "
            f"{summary['explained_variance_last_fifth']:.3f}, final vf_loss {summary['vf_loss_final']:.4f}"
        )
    plots = ", ".join(os.path.basename(path) for path in summary["plots"])
    print(
        f"outputs: {summary['output_dir']} (metrics.jsonl, summary.json, config.json, trainer.log"
        + (f", {plots})" if plots else ")")
    )


def run_job_command(kind: JobKind, args: argparse.Namespace) -> int:
    from verl_cppack.jobs.launcher import TrainerFailed
    from verl_cppack.jobs.ray_cluster import ClusterTooSmall, ClusterUnavailable
    from verl_cppack.jobs.rollout_choice import rollout_label
    from verl_cppack.jobs.verl_job import check_rollout, prepare_job, progress_line, run_job

    try:
        prepared = prepare_job(kind, settings_from_args(args))
        check_rollout(prepared)  # vLLM can start here (imports, AVX2, memory), before Ray does
    except (TypeError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
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
    except (ClusterTooSmall, TrainerFailed, ClusterUnavailable) as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT if isinstance(error, ClusterTooSmall) else EXIT_TRAINER_FAILED
    except KeyboardInterrupt:
        print(
            "interrupted: verl's trainer and its Ray cluster were stopped; finished steps are in metrics.jsonl",
            file=sys.stderr,
        )
        return EXIT_INTERRUPTED
    print_summary(summary)
    return 0


def register_job(
    subparsers: argparse._SubParsersAction,
    kind: JobKind,
    help_text: str,
    description: str,
    defaults: JobSettings | None = None,
) -> None:
    parser = subparsers.add_parser(
        kind.name, help=help_text, description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_job_arguments(parser, kind, defaults or JobSettings())
    parser.set_defaults(func=lambda args: run_job_command(kind, args))
