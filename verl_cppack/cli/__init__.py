"""``verl-cppack`` command line: one module per subcommand, each exposing ``register(subparsers)``."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable

DESCRIPTION = """\
verl_cppack: exact, loop-free sequence packing (THD) and context-parallel slicing for verl on Megatron-core.
Turn it on inside verl with actor_rollout_ref.model.external_lib=verl_cppack.verl_plugin."""

# Each module defines ``register(subparsers)``, which adds its parser (``add_command``) with ``func(args) -> int``.
SUBCOMMAND_MODULES = ("trainer_job", "ref_logprobs", "verify_cp", "verify_gpu", "doctor", "bench", "demo")
EXIT_BAD_INPUT, EXIT_FAILED, EXIT_INTERRUPTED = 2, 3, 130  # 2: nothing was started; 3: the trainer, Ray or a worker


def add_command(
    subparsers: argparse._SubParsersAction, name: str, help_text: str, description: str, func: Callable
) -> argparse.ArgumentParser:
    """A subcommand's parser; its module docstring (``description``) is printed as written."""
    parser = subparsers.add_parser(
        name, help=help_text, description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.set_defaults(func=func)
    return parser


def error(message: str, code: int = EXIT_BAD_INPUT) -> int:
    """One ``error:`` line on standard error; returns the exit status ``code``."""
    print(f"error: {message}", file=sys.stderr)
    return code


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
