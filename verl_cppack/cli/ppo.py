"""``verl-cppack ppo``: PPO with a critic (GAE) on a local (or joined) Ray cluster with CP worker actors."""

from __future__ import annotations

import argparse
import sys

from verl_cppack.rl.task import CountingTask
from verl_cppack.rl.worker import WorkerSettings

EXIT_WORKER_FAILURE = 3
EXIT_INTERRUPTED = 130


def worker_settings_from_args(args: argparse.Namespace) -> dict:
    """The worker settings every RL subcommand shares."""
    return dict(
        seed=args.seed,
        learning_rate=args.lr,
        kl_coef=args.kl_coef,
        attention=args.attention,
        forward=args.forward,
        device=args.device,
        collective_timeout_s=args.collective_timeout,
    )


def run_settings_from_args(args: argparse.Namespace, worker: WorkerSettings, num_mini_batches: int) -> dict:
    """The run settings every RL subcommand shares."""
    return dict(
        cp=args.cp,
        steps=args.steps,
        prompts_per_step=args.prompts_per_step,
        group_size=args.group_size,
        num_mini_batches=num_mini_batches,
        seed=args.seed,
        output=args.output,
        address=args.address,
        call_timeout_s=args.call_timeout,
        task=CountingTask(vocab_size=worker.vocab_size),
        worker=worker,
    )


def print_summary(summary: dict) -> None:
    print(
        f"{summary['job']}: {summary['steps']} steps at CP={summary['cp']} in {summary['wall_s']}s; mean reward "
        f"first fifth {summary['reward_first_fifth']:.3f} -> last fifth {summary['reward_last_fifth']:.3f} "
        f"(gain {summary['reward_gain']:+.3f}); final kl {summary['final_kl']:.4f}"
    )
    print(f"outputs: {summary['output_dir']} (metrics.jsonl, summary.json, config.json"
          + (", reward_curve.png)" if summary["reward_curve"] else ")"))
    print(f"log-probs: {summary['logprob_path']}")
    for note in summary["notes"]:
        print(f"note: {note}")


def run_with_fault_handling(run, config) -> int:
    from verl_cppack.rl.cluster import WorkerError

    try:
        result = run(config)
    except WorkerError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_WORKER_FAILURE
    except KeyboardInterrupt:
        print("interrupted: workers killed and Ray shut down; finished steps are in metrics.jsonl", file=sys.stderr)
        return EXIT_INTERRUPTED
    print_summary(result.summary)
    return 0


def add_common_arguments(parser: argparse.ArgumentParser, run_defaults) -> None:
    """Arguments every RL subcommand takes; ``run_defaults`` is the subcommand's default config."""
    defaults = WorkerSettings()
    steps, output = run_defaults.steps, run_defaults.output
    parser.add_argument("--cp", type=int, default=2, help="context-parallel size = number of worker actors (default 2)")
    parser.add_argument("--steps", type=int, default=steps, help=f"training steps (default {steps})")
    parser.add_argument(
        "--output", default=output, help=f"output directory (default {output}); a non-empty one gets a fresh run-* subdir"
    )
    parser.add_argument("--address", default=None, help="join this Ray cluster (default: RAY_ADDRESS, else start a local one)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompts-per-step", type=int, default=run_defaults.prompts_per_step)
    parser.add_argument("--group-size", type=int, default=run_defaults.group_size, help="responses per prompt")
    parser.add_argument("--lr", type=float, default=defaults.learning_rate, help="Adam learning rate")
    parser.add_argument("--kl-coef", type=float, default=defaults.kl_coef, help="weight of the k3 KL penalty")
    parser.add_argument("--attention", default=defaults.attention, choices=("allgather", "ring"), help="CP attention")
    parser.add_argument(
        "--forward",
        default=defaults.forward,
        choices=("verl", "cppack"),
        help="log-prob path: verl's gptmodel_forward_model_engine patched by verl_cppack (default), or compute_logprobs",
    )
    parser.add_argument(
        "--device", default="cpu", choices=("cpu", "cuda"), help="cpu: gloo workers; cuda: nccl, one GPU per worker"
    )
    parser.add_argument("--call-timeout", type=float, default=120.0, help="seconds before a worker call is declared hung")
    parser.add_argument(
        "--collective-timeout", type=float, default=defaults.collective_timeout_s, help="gloo process-group timeout (s)"
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
