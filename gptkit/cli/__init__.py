"""The `gptkit` command: one sub-command per module in this package, each with register() and run()."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Collection
from typing import NoReturn

from gptkit import __version__
from gptkit.atomic import STORAGE_ERRNOS
from gptkit.errors import GptkitError

# Sub-command modules in the order `gptkit --help` lists them.
COMMANDS = ["prepare", "train", "generate", "classify", "eval", "inspect", "plan", "info", "convert", "serve", "watch"]


class OneLineErrorParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line (what was wrong and where to look), exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class StderrHandler(logging.Handler):
    """Writes "gptkit: message" to whatever sys.stderr is at the time (tests and tools swap it)."""

    def emit(self, record: logging.LogRecord) -> None:
        sys.stderr.write(f"gptkit: {self.format(record)}\n")


def show_library_messages() -> None:
    """Let the command's user see gptkit's info messages (a one-off kernel build, say); the library sets none up."""
    logger = logging.getLogger("gptkit")
    if not any(isinstance(h, StderrHandler) for h in logger.handlers):
        logger.addHandler(StderrHandler())
        logger.setLevel(logging.INFO)


def build_parser(full: Collection[str] = tuple(COMMANDS)) -> argparse.ArgumentParser:
    """The argument parser, with the arguments of the commands in `full` (the others are listed by name)."""
    parser = OneLineErrorParser(
        prog="gptkit",
        description="Train, evaluate, inspect, sample from and serve GPT-style language models.",
    )
    parser.add_argument("--version", action="version", version=f"gptkit {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineErrorParser)
    for name in COMMANDS:
        module = importlib.import_module(f"gptkit.cli.{name}")
        if name in full:
            module.register(subparsers)
        else:  # building the others' flags would import their heavy dependencies for nothing
            subparsers.add_parser(name, help=module.HELP)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one gptkit command; user errors print one line and return 2."""
    argv = sys.argv[1:] if argv is None else argv
    command = next((arg for arg in argv if not arg.startswith("-")), None)  # the top level takes no values
    parser = build_parser(full=[command] if command in COMMANDS else [])
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # report it against the sub-command, whose --help lists what it takes
        subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        culprit = subparsers.choices[args.command] if args.command else parser
        culprit.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command is None:
        parser.print_help()
        return 2
    show_library_messages()
    code = _run(args)
    if args.command == "train":
        from gptkit.distributed import leave_if_distributed

        leave_if_distributed(code)
    return code


def _run(args: argparse.Namespace) -> int:
    """The command's exit code; a user error, an interrupt, a closed pipe or a storage error ends it in one line."""
    try:
        return args.run(args) or 0
    except GptkitError as err:
        print(f"gptkit {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"gptkit {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`gptkit ... | head`): stop quietly, as Unix tools do
        # Point stdout at /dev/null so that the interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except OSError as err:  # a full disk, a read-only directory, a failing device: one line, as for a user error
        if err.errno not in STORAGE_ERRNOS:
            raise
        where = f"{err.filename}: " if err.filename else ""
        print(f"gptkit {args.command}: error: {where}{err.strerror}", file=sys.stderr)
        return 2
