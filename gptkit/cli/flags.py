"""Command-line flags generated from an options dataclass, so that each default and help text lives once.

A field's metadata holds its "help" and optionally: "metavar"; "choices"; "flag" (the flag's name when it is not
--field-name); "repeatable" (the flag may be given several times, each with one or more values, all collected into
one list); "parse" (a function from the flag's text to the field's value, for types argparse cannot build). A bool
field is a switch pair: --name and --no-name.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from collections.abc import Callable
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


def _with_clear_errors(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """parse, with its ValueError's message shown as the flag's error (argparse otherwise hides it)."""

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    return convert


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default  # type: ignore[misc]


def _shown(value: Any) -> str:
    """A default as the help text shows it: none, true/false, or the value."""
    if value is None or value in ((), []):
        return "none"
    return str(value).lower() if isinstance(value, bool) else str(value)


def add_dataclass_flags(parser: argparse.ArgumentParser, cls: type, keep_unset: bool = False) -> None:
    """One flag per field of cls (see the module docstring); a field without a default gives a required flag.

    keep_unset leaves flags that were not given out of the parsed namespace, for a caller that must tell an
    explicit value from the default (dataclass_from_args then uses the field's default).
    """
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        meta = f.metadata
        kind = next((a for a in typing.get_args(hints[f.name]) if a is not type(None)), hints[f.name])
        options: dict[str, Any] = {"dest": f.name, "metavar": meta.get("metavar"), "choices": meta.get("choices")}
        if kind is bool:  # a switch: --name sets it, --no-name clears it
            options = {"dest": f.name, "action": argparse.BooleanOptionalAction}
        elif "parse" in meta:
            options["type"] = _with_clear_errors(meta["parse"])
            if meta.get("repeatable"):
                options.update(action="extend", nargs="+")
        elif meta.get("repeatable"):
            options.update(action="extend", nargs="+", type=str)
        else:
            options["type"] = parse_int if kind is int else kind
        help_text = meta["help"]
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if required:
            options["required"] = True
        else:
            if "default" not in help_text:
                help_text += f" (default: {_shown(_default(f))})"
            # A repeatable flag collects from None: the field's default list must not be appended to.
            options["default"] = argparse.SUPPRESS if keep_unset else (None if meta.get("repeatable") else _default(f))
        parser.add_argument(meta.get("flag", "--" + f.name.replace("_", "-")), help=help_text, **options)


def dataclass_from_args(cls: type[Options], args: argparse.Namespace) -> Options:
    """An instance of cls holding the parsed value of each of its fields' flags (the default where none was given)."""
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if not hasattr(args, f.name):  # not given, under keep_unset
            continue
        value = getattr(args, f.name)
        if value is None and f.metadata.get("repeatable"):  # never given
            continue
        values[f.name] = value
    return cls(**values)
