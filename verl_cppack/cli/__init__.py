"""``verl-cppack`` command line: one module per subcommand, each exposing ``register(subparsers)``."""

from __future__ import annotations

import argparse
import importlib
import sys

DESCRIPTION = """\
verl_cppack: exact, loop-free sequence packing (THD) and context-parallel slicing for verl on Megatron-core.
Turn it on inside verl with actor_rollout_ref.model.external_lib=verl_cppack.verl_plugin."""

# Each module defines ``register(subparsers)`` which adds its parser and sets ``func=callable(args) -> int``.
SUBCOMMAND_MODULES = ("grpo", "ppo", "ref_logprobs", "verify_cp", "verify_gpu", "doctor", "bench", "demo")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="verl-cppack", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="SUBCOMMAND")
    for module in SUBCOMMAND_MODULES:
        importlib.import_module(f"verl_cppack.cli.{module}").register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
