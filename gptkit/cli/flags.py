"""Command-line flags generated from an options dataclass, so that each default and help text lives once."""

from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any, TypeVar

Options = TypeVar("Options")


def parse_int(text: str) -> int:
    """An integer, also written like 1e9 or 2_000_000."""
    try:
        value = float(text.replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid integer {text!r}") from None
    if not value.is_integer():
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number")
    return int(value)


def add_dataclass_flags(parser: argparse.ArgumentParser, cls: type) -> None:
    """One --flag per field of cls: the type from its annotation, help, choices and metavar from its metadata."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        kind = next((a for a in typing.get_args(hints[f.name]) if a is not type(None)), hints[f.name])
        help_text = f.metadata["help"]
        if "default" not in help_text:
            help_text += f" (default: {'none' if f.default is None else f.default})"
        parser.add_argument(
            "--" + f.name.replace("_", "-"),
            type=parse_int if kind is int else kind,
            default=f.default,
            choices=f.metadata.get("choices"),
            metavar=f.metadata.get("metavar"),
            help=help_text,
        )


def dataclass_from_args(cls: type[Options], args: argparse.Namespace) -> Options:
    """An instance of cls holding the parsed value of each of its fields' flags."""
    values: dict[str, Any] = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    return cls(**values)
