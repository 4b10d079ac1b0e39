"""``verl-cppack ppo``: PPO with a critic (GAE) on a local (or joined) Ray cluster with CP worker actors."""

from __future__ import annotations

import argparse
import sys

from verl_cppack.cli.grpo import (
    add_common_arguments,
    run_settings_from_args,
    run_with_fault_handling,
    worker_settings_from_args,
)


def config_from_args(args: argparse.Namespace):
    from verl_cppack.rl.ppo import PPOConfig
    from verl_cppack.rl.ppo_worker import PPOWorkerSettings

    worker = PPOWorkerSettings(
        **worker_settings_from_args(args), critic_learning_rate=args.critic_lr, value_clip=args.value_clip
    )
    return PPOConfig(
        **run_settings_from_args(args, worker, PPOConfig().num_mini_batches),
        gamma=args.gamma,
        lam=args.lam,
        critic_warmup=args.critic_warmup,
    )


def print_critic_summary(summary: dict) -> None:
    print(
        f"critic: final value loss {summary['final_value_loss']:.4f}, explained variance (last fifth) "
        f"{summary['explained_variance_last_fifth']:.3f}; gamma={summary['gamma']} lam={summary['lam']}"
    )
    print(f"values: {summary['value_path']}")
    if summary["critic_curve"]:
        print(f"critic curve: {summary['critic_curve']}")


def run(args: argparse.Namespace) -> int:
    from verl_cppack.rl.ppo import run_ppo

    try:
        config = config_from_args(args)
    except (TypeError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    results = []

    def run_and_keep(run_config):
        results.append(run_ppo(run_config))
        return results[-1]

    code = run_with_fault_handling(run_and_keep, config)  # prints the common summary, maps faults to exit codes
    if code == 0:
        print_critic_summary(results[-1].summary)
    return code


def register(subparsers: argparse._SubParsersAction) -> None:
    from verl_cppack.rl.ppo import PPOConfig

    defaults = PPOConfig()
    parser = subparsers.add_parser("ppo", help="PPO with a critic (GAE) on Ray with CP workers", description=__doc__)
    add_common_arguments(parser, defaults)
    parser.add_argument("--gamma", type=float, default=defaults.gamma, help="GAE discount")
    parser.add_argument("--lam", type=float, default=defaults.lam, help="GAE lambda")
    parser.add_argument("--critic-lr", type=float, default=defaults.worker.critic_learning_rate, help="critic Adam lr")
    parser.add_argument(
        "--value-clip", type=float, default=defaults.worker.value_clip, help="value clipping range (cliprange_value)"
    )
    parser.add_argument(
        "--critic-warmup", type=int, default=defaults.critic_warmup, help="first steps update only the critic"
    )
    parser.set_defaults(func=run)
