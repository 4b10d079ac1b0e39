"""``verl-cppack grpo``: GRPO through verl's own trainer (``verl.trainer.main_ppo``) on this machine's CPU.

verl's GSM8K GRPO recipe (``recipes/gsm8k_grpo_megatron_cp2.sh``) with a CPU overlay: a tiny Llama and a
counting task made locally, the Megatron actor and reference at context parallelism --cp (zigzag THD packing by
verl_cppack), a Hugging Face rollout, a local Ray cluster (or --address). Extra arguments are Hydra overrides
for verl's trainer config and win over both. Exit codes: 0 done, 2 bad input (nothing started), 3 the trainer or
Ray failed, 130 interrupted (the trainer and its Ray cluster stopped).
"""

from __future__ import annotations

import argparse
import os
import sys

from verl_cppack.jobs.grpo import TRAINERS, GrpoSettings

EXIT_BAD_INPUT, EXIT_TRAINER_FAILED, EXIT_INTERRUPTED = 2, 3, 130


def settings_from_args(args: argparse.Namespace) -> GrpoSettings:
    return GrpoSettings(
        cp=args.cp, steps=args.steps, output=args.output, address=args.address or os.environ.get("RAY_ADDRESS") or None,
        trainer=args.trainer,
        seed=args.seed, prompts_per_step=args.prompts_per_step, group_size=args.group_size,
        learning_rate=args.lr, overrides=tuple(args.overrides), verbose=args.verbose,
    )  # fmt: skip


def print_summary(summary: dict) -> None:
    print(
        f"grpo ({summary['trainer']}, trainer {summary['trainer_version']}, verl {summary['verl_version']}): "
        f"{summary['steps']} steps at CP={summary['cp']} in {summary['wall_s']} s; mean reward first fifth "
        f"{summary['reward_first_fifth']:.3f} -> last fifth {summary['reward_last_fifth']:.3f}; "
        f"rollout_probs_diff_max {summary['rollout_probs_diff_max']:.2e}; drop-in calls {summary['dropin_calls']}"
    )
    print(f"outputs: {summary['output_dir']} (metrics.jsonl, summary.json, config.json, trainer.log"
          + (", reward_curve.png)" if summary["reward_curve"] else ")"))  # fmt: skip


def run(args: argparse.Namespace) -> int:
    from verl_cppack.jobs.grpo import prepare_grpo, progress_line, run_grpo
    from verl_cppack.jobs.launcher import TrainerFailed

    try:
        prepared = prepare_grpo(settings_from_args(args))
    except (TypeError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(f"grpo: verl.trainer.main_ppo at CP={args.cp}, {args.steps} steps -> {prepared.output_dir} "
          f"(Ray start-up and worker init take about two minutes; trainer output in trainer.log)", flush=True)  # fmt: skip
    try:
        summary = run_grpo(prepared, on_step=lambda record: print(progress_line(record, args.steps), flush=True))
    except TrainerFailed as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_TRAINER_FAILED
    except KeyboardInterrupt:
        print("interrupted: verl's trainer and its Ray cluster were stopped; finished steps are in metrics.jsonl",
              file=sys.stderr)  # fmt: skip
        return EXIT_INTERRUPTED
    print_summary(summary)
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    defaults = GrpoSettings()
    parser = subparsers.add_parser(
        "grpo", help="GRPO through verl's own trainer on CPU, actor and reference at CP=2 (the main job)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    parser.add_argument("--cp", type=int, default=defaults.cp, help=f"context-parallel size = Ray workers (default {defaults.cp})")
    parser.add_argument("--steps", type=int, default=defaults.steps, help=f"training steps (default {defaults.steps})")
    parser.add_argument("--output", default=defaults.output,
                        help=f"output directory (default {defaults.output}); a non-empty one gets a fresh run-* subdirectory")
    parser.add_argument("--address", default=None, help="join this Ray cluster (HOST:PORT; default: RAY_ADDRESS if set) instead of starting a local one")
    parser.add_argument("--trainer", default=defaults.trainer, choices=sorted(TRAINERS),
                        help="verl's trainer: v1 (TransferQueue, verl 0.9.1's default) or v0 (RayPPOTrainer)")
    parser.add_argument("--seed", type=int, default=defaults.seed, help="seed of data order, rollout sampling and Megatron")
    parser.add_argument("--prompts-per-step", type=int, default=defaults.prompts_per_step,
                        help=f"prompts per training step, verl's data.train_batch_size (default {defaults.prompts_per_step})")
    parser.add_argument("--group-size", type=int, default=defaults.group_size,
                        help=f"responses per prompt, verl's rollout.n (default {defaults.group_size})")
    parser.add_argument("--lr", type=float, default=defaults.learning_rate, help=f"actor learning rate (default {defaults.learning_rate})")
    parser.add_argument("--verbose", action="store_true", help="also print the trainer's own output (always in trainer.log)")
    parser.add_argument("overrides", nargs="*", metavar="HYDRA_OVERRIDE",
                        help="KEY=VALUE overrides of verl's trainer config, applied last")
    parser.set_defaults(func=run)
