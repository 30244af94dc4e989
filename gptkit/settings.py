"""Typed settings: the checks and descriptions every settings dataclass shares, and a training part's own settings.

A part of a training run (a method or an objective in gptkit/finetune) declares its settings as a PartSettings
dataclass in its own file: each field a flat key of the finetune section (finetune.lora_rank), described by its
comment (`gptkit train --help` shows it), with its ranges in validate() and, as class attributes, the rules a run
using the part must follow (needs model.init_from, not under FSDP). gptkit.finetune.catalogue collects them.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import math
import textwrap
import types
import typing
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, get_args, get_origin

from gptkit.errors import ConfigError


@dataclass
class PartSettings:
    """A part's own settings (none here): flat keys of the finetune section, their ranges and the part's run rules."""

    # Settings a resumed run may change (the others shaped the weights it continues).
    may_change_on_resume: ClassVar[tuple[str, ...]] = ()
    # The part needs a model to start from (model.init_from), for this reason; None: it does not.
    needs_base: ClassVar[str | None] = None
    # The part trains under train.parallel ddp only (each rank holds the whole model), never sharded by fsdp.
    data_parallel_only: ClassVar[bool] = False

    def validate(self) -> None:
        """Raise ConfigError naming the first setting out of its range (whether or not the run uses the part)."""


def check_range(
    name: str,
    value: float,
    low: float,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
    why: str | None = None,
) -> None:
    """A ConfigError unless value is finite and within [low, high] (an open end excludes that bound)."""
    inside = math.isfinite(value) and (value > low if low_open else value >= low)
    if high is not None:
        inside = inside and (value < high if high_open else value <= high)
    if not inside:
        if why is None:
            why = (
                (f"> {low}" if low_open else f">= {low}")
                if high is None
                else f"in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
            )
        raise ConfigError(f"{name} must be {why}, got {value}")


def describe(kind: Any) -> str:
    """A type as a user reads it: 'an integer', 'one of cosine, constant', ..."""
    args = get_args(kind)
    if type(None) in args:
        inner = [a for a in args if a is not type(None)]
        return describe(inner[0]) + " or null"
    if get_origin(kind) is Literal:
        return "one of " + ", ".join(map(str, args))
    if get_origin(kind) is list:
        inner = get_args(kind)[0]
        plural = {str: "strings", float: "numbers", int: "integers", bool: "true or false values"}
        return "a list of " + plural.get(inner, f"values, each {describe(inner)}")
    if dataclasses.is_dataclass(kind):
        return f"a mapping of {kind.__name__}'s fields"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(kind, str(kind))


def coerce(key: str, value: Any, kind: Any) -> Any:
    """Check value against kind (int, float, bool, str, Literal, Optional), returning it normalised."""
    args = get_args(kind)
    if get_origin(kind) in (typing.Union, types.UnionType) and type(None) in args:
        if value is None:
            return None
        inner = [a for a in args if a is not type(None)][0]
        try:
            return coerce(key, value, inner)
        except ConfigError:
            raise ConfigError(f"{key} must be {describe(kind)}, got {value!r}") from None
    ok = False
    if kind is bool:
        ok = isinstance(value, bool)
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind is float:
        if isinstance(value, str):  # YAML 1.1 reads 3e-4 (no dot) as a string; it is meant as a number
            try:
                value = float(value)
            except ValueError:
                pass
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif kind is str:
        ok = isinstance(value, str)
    elif get_origin(kind) is Literal:
        ok = value in args
    elif dataclasses.is_dataclass(kind):  # a nested setting (a model's rope_scaling): its class checks each field
        ok = isinstance(value, dict)
    elif get_origin(kind) is list:  # one item alone stands for a list of it (a recipe written before it was a list)
        items = value if isinstance(value, list) else [value]
        return [coerce(f"{key}[{i}]", item, args[0]) for i, item in enumerate(items)]
    if not ok:
        raise ConfigError(f"{key} must be {describe(kind)}, got {value!r}")
    return value


def field_comments(cls: type) -> dict[str, str]:
    """Each field's comment in cls's source (after `name: type = value  # `, with its indented continuation lines
    `#   ...`), joined into one line: the description `gptkit train --help` shows, kept in one place."""
    return dict(_field_comments(cls))  # a copy: callers extend it


@functools.cache  # finding a class's source parses its whole module: once per class per process, not per flag
def _field_comments(cls: type) -> dict[str, str]:
    lines, _ = inspect.getsourcelines(cls)
    comments = {}
    for node in ast.parse(textwrap.dedent("".join(lines))).body[0].body:  # type: ignore[attr-defined]
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        end = node.end_lineno or node.lineno
        parts = [lines[end - 1].partition("  # ")[2].strip()]
        while parts[0] and end < len(lines) and lines[end].strip().startswith("#  "):
            parts.append(lines[end].strip()[1:].strip())
            end += 1
        if parts[0]:
            comments[node.target.id] = " ".join(parts)
    return comments
