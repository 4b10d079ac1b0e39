"""``verl-cppack`` command line: one module per subcommand, each exposing ``register(subparsers)``."""

from __future__ import annotations

import argparse
import importlib
import sys

# Each module defines ``register(subparsers)`` which adds its parser and sets ``func=callable(args) -> int``.
SUBCOMMAND_MODULES = (
    "verl_cppack.cli.demo",
    "verl_cppack.cli.doctor",
    "verl_cppack.cli.bench",
    "verl_cppack.cli.grpo",
    "verl_cppack.cli.ppo",
    "verl_cppack.cli.ref_logprobs",
    "verl_cppack.cli.verify_cp",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="verl-cppack", description=__doc__)
    subparsers = parser.add_subparsers(dest="command", required=True)
    for module in SUBCOMMAND_MODULES:
        importlib.import_module(module).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
