"""Tool calls over the chat API: what a request's tool_choice asks for, and the reply turned into tool_calls.

gptkit does not guess a model's own tool-call format. A call is made by constraining the reply to JSON: with a
named function (tool_choice {"type": "function", ...}) the reply is that function's arguments, valid against its
parameters schema; with tool_choice "required" it is {"name": <one of the tools>, "arguments": {...}}, the form
gptkit's default chat template shows past calls in. "none" leaves the reply free text (the tools are still
rendered into the prompt); "auto", which would need the model's own format, is refused.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from gptkit.errors import InputError
from gptkit.serving.schemas import ChatMessage, ChatRequest

NO_ARGUMENTS = {"type": "object", "properties": {}}  # a function declared without parameters


class ToolChoiceError(InputError):
    """A tools / tool_choice combination gptkit cannot honour; param names the request field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolPlan:
    """A reply constrained to one tool call: the JSON schema it follows, and the function when tool_choice named
    one (then the whole reply is that function's arguments)."""

    schema: str
    name: str | None = None

    def call(self, text: str) -> dict[str, Any] | None:
        """The reply as an OpenAI tool call, or None when it is not a complete call (cut short)."""
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return None
        if self.name is not None:
            name, arguments = self.name, text
        elif isinstance(value, dict) and isinstance(value.get("name"), str) and "arguments" in value:
            name, arguments = value["name"], json.dumps(value["arguments"], ensure_ascii=False)
        else:
            return None
        return {"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


    def cut_short(self, text: str) -> dict[str, Any]:
        """A call whose reply was cut short (max_tokens): its name as far as known and its arguments' text as far
        as written, as OpenAI returns a call that ran out of tokens (with finish_reason "length")."""
        if self.name is not None:
            name, arguments = self.name, text
        else:  # the reply so far: {"name": "<name>", "arguments": <partial JSON>
            head = _CALL_HEAD.match(text)
            name = json.loads(head.group(1)) if head else ""
            arguments = text[head.end():] if head and head.group(2) else ""
        return {"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


# The start of a required call as the constraint writes it: the name (complete), then the arguments' key.
_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")(\s*,\s*"arguments"\s*:\s*)?')


def new_call_id() -> str:
    """An id for a tool call, in OpenAI's form."""
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_plan(body: ChatRequest) -> ToolPlan | None:
    """What the request's tools and tool_choice ask of the reply: a constrained call, or None for free text."""
    choice, tools = body.tool_choice, body.tools or []
    if not tools:
        if choice not in (None, "none"):
            raise ToolChoiceError("tool_choice needs tools: offer the functions in `tools`", "tool_choice")
        return None
    names = [tool.function.name for tool in tools]
    if len(set(names)) != len(names):
        raise ToolChoiceError("each function in tools needs a name of its own", "tools")
    if choice == "none":
        return None
    if choice in (None, "auto"):
        raise ToolChoiceError(
            "tool_choice 'auto' (the default when tools are given) would need this model's own tool-call format, "
            "which gptkit does not guess; send tool_choice 'required' or {'type': 'function', 'function': "
            "{'name': ...}} to get a call, or 'none' to get text", "tool_choice")  # fmt: skip
    if body.response_format is not None and body.response_format.type != "text":
        raise ToolChoiceError("a required tool call already fixes the reply's form; drop response_format",
                              "response_format")  # fmt: skip
    parameters = {tool.function.name: tool.function.parameters or NO_ARGUMENTS for tool in tools}
    if choice == "required":
        # Each function's parameters go under $defs of the one schema, and the references inside them ("#/$defs/X",
        # as pydantic writes nested models) are moved along, so that they still point where they pointed.
        defs = {f"tool{i}": _rebased(schema, f"#/$defs/tool{i}") for i, schema in enumerate(parameters.values())}
        calls = [{"type": "object", "properties": {"name": {"const": name}, "arguments": {"$ref": f"#/$defs/tool{i}"}},
                  "required": ["name", "arguments"], "additionalProperties": False}
                 for i, name in enumerate(parameters)]  # fmt: skip
        return ToolPlan(json.dumps({**(calls[0] if len(calls) == 1 else {"anyOf": calls}), "$defs": defs}))
    name = choice.function.name
    if name not in parameters:
        raise ToolChoiceError(f"tool_choice names function {name!r}, which is not among the tools "
                              f"({', '.join(names)})", "tool_choice")  # fmt: skip
    return ToolPlan(json.dumps(parameters[name]), name)


def _rebased(schema: Any, base: str) -> Any:
    """schema with each local reference ("#", "#/...") made relative to base, where the schema will sit."""
    if isinstance(schema, list):
        return [_rebased(item, base) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")):
            out[key] = base + value[1:]
        elif key in ("const", "enum", "default", "examples"):  # JSON data, not schemas: kept as written
            out[key] = value
        elif key in ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas"):
            # maps of names to schemas: a property may itself be called "$ref"
            out[key] = {name: _rebased(sub, base) for name, sub in value.items()} if isinstance(value, dict) \
                else value  # fmt: skip
        else:
            out[key] = _rebased(value, base)
    return out


def template_tools(body: ChatRequest) -> list[dict[str, Any]] | None:
    """The request's tools as a chat template's `tools` variable takes them (OpenAI's form)."""
    return [tool.model_dump(exclude_none=True) for tool in body.tools] if body.tools else None


def template_message(message: ChatMessage, index: int) -> dict[str, Any]:
    """A request message as a chat template reads it (Hugging Face's form: a call's arguments as a dict)."""
    out: dict[str, Any] = {"role": message.role, "content": message.text()}
    if message.tool_calls:
        if message.content is None:
            out["content"] = None
        out["tool_calls"] = [{"id": call.id, "type": "function",
                              "function": {"name": call.function.name,
                                           "arguments": _arguments(call.function.arguments, index)}}
                             for call in message.tool_calls]  # fmt: skip
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.name is not None:
        out["name"] = message.name
    return out


def _arguments(text: str, index: int) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise ToolChoiceError(f"messages[{index}]: a tool call's arguments must be JSON text, got {text[:40]!r}",
                              "messages") from None  # fmt: skip
