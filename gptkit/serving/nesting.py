"""Which field of a request body nests deeper than the JSON parser goes (Python's parser recurses once per level,
and gives up near its recursion limit): found by scanning the body's brackets without recursion, then named as
the request's schema declares it, down to where the schema leaves the value free (a tool's `parameters`)."""

from __future__ import annotations

import json
import re
import types
import typing
from typing import Any

from pydantic import BaseModel

_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{},:]')  # strings (skipped whole) and structure; numbers need no look
_KEPT = 32  # path parts kept of the deepest point: a request's fields lie far shallower


def deepest(body: bytes) -> tuple[list[str | int], int]:
    """The path (object keys, list indices) to the first point where body nests deepest, its first parts only,
    and that depth."""
    path: list[str | int] = []  # per open container: its current key (an object) or index (a list)
    kinds: list[str] = []
    best: list[str | int] = []
    depth, last = 0, ""
    for match in _TOKEN.finditer(body.decode("utf-8", errors="replace")):
        token = match.group()
        if token in "{[":
            kinds.append(token)
            path.append(0 if token == "[" else "")
            if len(kinds) > depth:
                depth, best = len(kinds), path[:-1][:_KEPT]
        elif token in "]}" and kinds:
            kinds.pop()
            path.pop()
        elif token == "," and kinds and kinds[-1] == "[":
            path[-1] = int(path[-1]) + 1
        elif token == ":" and kinds:
            path[-1] = last
        elif token.startswith('"'):
            last = _text(token)
    return best, depth


def field_name(path: list[str | int], model: type[BaseModel]) -> str:
    """path as far as model declares it, written as a request field (tools[0].function.parameters): cut where the
    schema leaves the value free (JSON of any shape), or where path leaves the schema."""
    kind: Any = model
    named = ""
    for part in path:
        kind = _inner(kind, part)
        if kind is None:  # the body has a structure the schema does not: the field so far is the one at fault
            break
        named += f"[{part}]" if isinstance(part, int) else f".{part}" if named else str(part)
        if _free(kind):
            break
    return named


def _inner(kind: Any, part: str | int) -> Any:
    """The declared type of kind's member `part` (Any where the schema does not say), None where kind has none."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):
        found = [inner for arg in args if (inner := _inner(arg, part)) is not None]
        return found[0] if found else None
    if isinstance(kind, type) and issubclass(kind, BaseModel) and isinstance(part, str):
        fields = {info.alias or name: info.annotation for name, info in kind.model_fields.items()}
        return fields.get(part, Any)  # an undeclared key: an extra field, kept as given
    if origin is list and isinstance(part, int):
        return args[0] if args else Any
    if origin is dict and isinstance(part, str):
        return args[1] if args else Any
    return None


def _free(kind: Any) -> bool:
    """Whether the schema leaves a value of this type free: Any, or an object of anything."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):
        return all(_free(arg) for arg in args if arg is not type(None))
    return kind is Any or (origin is dict and (not args or args[1] is Any))


def _text(token: str) -> str:
    try:
        return json.loads(token)
    except ValueError:  # a string with a broken escape: the raw text still names the key
        return token[1:-1]
