"""``verl-cppack`` command line: one module per subcommand, each exposing ``register(subparsers)``."""

from __future__ import annotations

import argparse
import importlib
import sys

DESCRIPTION = """\
verl_cppack: exact, loop-free sequence packing (THD) and context-parallel slicing for verl on Megatron-core.

  grpo          GRPO through verl's own trainer on this CPU, actor and reference at CP=2 (the main job)
  ppo           PPO through verl's own trainer with a Megatron critic, all three at CP=2
  ref-logprobs  reference log-probs through verl's Megatron engine at CP=2
  verify-cp     check that CP=N equals CP=1 (log-probs, entropy, gradients) in gloo processes
  verify-gpu    the GPU acceptance checks (TE's zigzag index, CUDA = CPU, host syncs, bad input, bench, verify-cp)
  doctor        versions, the verl API generation, where the patch and the CPU fixes are applied
  bench         verl's own packing functions against verl_cppack's drop-ins
  demo          the worked example: packing and CP slicing of three sequences

Turn it on inside verl with actor_rollout_ref.model.external_lib=verl_cppack.verl_plugin.
`verl-cppack SUBCOMMAND --help` for the flags."""

# Each module defines ``register(subparsers)`` which adds its parser and sets ``func=callable(args) -> int``.
SUBCOMMAND_MODULES = (
    "verl_cppack.cli.demo",
    "verl_cppack.cli.doctor",
    "verl_cppack.cli.bench",
    "verl_cppack.cli.grpo",
    "verl_cppack.cli.ppo",
    "verl_cppack.cli.ref_logprobs",
    "verl_cppack.cli.verify_cp",
    "verl_cppack.cli.verify_gpu",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="verl-cppack", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    subparsers = parser.add_subparsers(dest="command", required=True)
    for module in SUBCOMMAND_MODULES:
        importlib.import_module(module).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
