"""The `gptkit` command: one sub-command per module in this package, each with register() and run()."""

from __future__ import annotations

import argparse
import importlib
import sys

from gptkit import __version__
from gptkit.errors import GptkitError

# Sub-command modules in the order `gptkit --help` lists them.
COMMANDS = ["info"]


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser, with every sub-command registered."""
    parser = argparse.ArgumentParser(
        prog="gptkit",
        description="Train, evaluate, inspect, sample from and serve GPT-style language models.",
    )
    parser.add_argument("--version", action="version", version=f"gptkit {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"gptkit.cli.{name}").register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one gptkit command; user errors print one line and return 2."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return args.run(args) or 0
    except GptkitError as err:
        print(f"gptkit {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"gptkit {args.command}: interrupted", file=sys.stderr)
        return 130
