"""What ``verl-cppack grpo`` and ``verl-cppack ppo`` share: their flags, the run, the exit codes.

Exit codes: 0 done; 2 bad input (nothing started); 3 verl's trainer or Ray failed; 130 interrupted (the trainer
and the Ray cluster it started are stopped).
"""

from __future__ import annotations

import argparse
import os
import sys

from verl_cppack.jobs.launcher import FIRST_STEP_TIMEOUT_S
from verl_cppack.jobs.rollout_choice import ROLLOUTS
from verl_cppack.jobs.verl_job import TRAINERS, JobKind, JobSettings

EXIT_BAD_INPUT, EXIT_TRAINER_FAILED, EXIT_INTERRUPTED = 2, 3, 130


def add_job_arguments(parser: argparse.ArgumentParser, kind: JobKind, defaults: JobSettings) -> None:
    parser.add_argument(
        "--cp",
        type=int,
        default=defaults.cp,
        help=f"context-parallel size of every Megatron model (default {defaults.cp})",
    )
    parser.add_argument(
        "--tp",
        type=int,
        default=defaults.tp,
        help=f"tensor-parallel size of every Megatron model (default {defaults.tp})",
    )
    parser.add_argument(
        "--dp",
        type=int,
        default=defaults.dp,
        help=f"data-parallel size (default {defaults.dp}); Ray worker slots = tp x cp x dp",
    )
    parser.add_argument(
        "--nnodes",
        type=int,
        default=defaults.nnodes,
        help=f"Ray nodes the workers are spread over, the same number on each (default {defaults.nnodes})",
    )
    parser.add_argument("--steps", type=int, default=defaults.steps, help=f"training steps (default {defaults.steps})")
    parser.add_argument(
        "--output",
        default=f"runs/{kind.name}",
        help=f"output directory (default runs/{kind.name}); a non-empty one gets a fresh run-* subdirectory",
    )
    parser.add_argument(
        "--address",
        default=None,
        help="join the running Ray cluster at HOST:PORT or 'auto' (default: RAY_ADDRESS if set) instead of "
        "starting a local one; it must offer tp x cp x dp worker slots (Ray GPUs)",
    )
    parser.add_argument(
        "--trainer",
        default=defaults.trainer,
        choices=sorted(TRAINERS),
        help="verl's trainer: v1 (TransferQueue, verl 0.9.1's default) or v0 (RayPPOTrainer)",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=defaults.seed,
        help=f"seed of data order, rollout sampling and Megatron (default {defaults.seed})",
    )
    parser.add_argument(
        "--prompts-per-step",
        type=int,
        default=defaults.prompts_per_step,
        help=f"prompts per training step, verl's data.train_batch_size (default {defaults.prompts_per_step})",
    )
    parser.add_argument(
        "--group-size",
        type=int,
        default=defaults.group_size,
        help=f"responses per prompt, verl's rollout.n (default {defaults.group_size})",
    )
    parser.add_argument(
        "--lr",
        type=float,
        default=defaults.learning_rate,
        help=f"actor learning rate (default {defaults.learning_rate})",
    )
    parser.add_argument(
        "--rollout",
        default=defaults.rollout,
        choices=list(ROLLOUTS),
        help=f"vllm: verl's vLLM rollout on vLLM's CPU build; hf: Hugging Face generate (default {defaults.rollout})",
    )
    parser.add_argument(
        "--step-timeout",
        type=float,
        default=defaults.step_timeout_s,
        metavar="SECONDS",
        help="stop the run (exit 3) when verl's trainer logs no step for this long "
        f"(default {defaults.step_timeout_s:g}); the first step, which includes Ray's and vLLM's start-up, may take "
        f"the larger of this and {FIRST_STEP_TIMEOUT_S:g}",
    )
    parser.add_argument(
        "--verbose", action="store_true", help="also print the trainer's own output (always in trainer.log)"
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="HYDRA_OVERRIDE",
        help="KEY=VALUE overrides of verl's trainer config, applied last",
    )


def settings_from_args(args: argparse.Namespace) -> JobSettings:
    return JobSettings(
        cp=args.cp,
        tp=args.tp,
        dp=args.dp,
        nnodes=args.nnodes,
        steps=args.steps,
        output=args.output,
        address=args.address or os.environ.get("RAY_ADDRESS") or None,
        trainer=args.trainer,
        seed=args.seed,
        prompts_per_step=args.prompts_per_step,
        group_size=args.group_size,
        learning_rate=args.lr,
        overrides=tuple(args.overrides),
        verbose=args.verbose,
        rollout=args.rollout,
        step_timeout_s=args.step_timeout,
    )


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
    where = f"the Ray cluster at {prepared.settings.address}" if prepared.settings.address else "a local Ray cluster"
    print(
        f"{kind.name}: verl.trainer.main_ppo at {prepared.settings.shape.describe()} with the "
        f"{rollout_label(prepared.settings.rollout)} rollout on {where}, {args.steps} steps "
        f"-> {prepared.output_dir} (Ray start-up and worker init take one to two minutes; trainer output in "
        "trainer.log)",
        flush=True,
    )
    try:
        summary = run_job(prepared, on_step=lambda record: print(progress_line(record, args.steps), flush=True))
    except ClusterTooSmall as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except (TrainerFailed, ClusterUnavailable) as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_TRAINER_FAILED
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
