"""Tool calls over the chat API: the reply shapes a request's tools and tool_choice ask for, each a small object
that knows its grammar, how to stream itself and how to read the finished reply.

A call is written in the form gptkit's default chat template shows past calls in, `{"name": ..., "arguments":
{...}}`, several calls on lines of their own, after whatever whitespace the template's replies begin with (its
"lead": the default template's replies begin with a space). The grammar holds the reply to that form:

- "required": one or more calls to any of the tools;
- a named function: one call to it;
- "auto" (OpenAI's default when tools are given): either calls or plain text. The model decides by its first
  token: a model trained to call tools in this form calls them where it learnt to, one that was not answers in
  text. (gptkit does not guess another model's own tool-call syntax: a model with its own template is held to
  this form too.)
- "none": free text (the tools are still rendered into the prompt).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from gptkit.decoding.grammar import Grammar, json_rule, lark_literal
from gptkit.errors import InputError
from gptkit.serving.schemas import ChatMessage, Tool
from gptkit.tokenizer import Tokenizer

NO_ARGUMENTS = {"type": "object", "properties": {}}  # a function declared without parameters
CALL_SEPARATOR = "\n"  # between parallel calls, as the default template writes an assistant turn's calls
# The start of a call as the constraint writes it: the name (complete), then the arguments' key.
_CALL_HEAD = re.compile(r'\s*\{"name": ("(?:[^"\\]|\\.)*")(, "arguments": )?')


class ToolChoiceError(InputError):
    """A tools / tool_choice combination gptkit cannot honour; param names the request field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def new_call_id() -> str:
    """An id for a tool call, in OpenAI's form."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ParsedCall:
    """One call read from a reply: its name once whole, its arguments' text as far as written, and where in the
    reply's text it begins."""

    name: str | None
    arguments: str | None
    complete: bool
    start: int = 0


def parse_calls(text: str) -> list[ParsedCall] | None:
    """The calls a reply holds so far: None when it is plain text (it does not begin with `{` past whitespace),
    [] while nothing but whitespace has come."""
    pos = len(text) - len(text.lstrip())
    if pos == len(text):
        return []
    if text[pos] != "{":
        return None
    calls, decoder = [], json.JSONDecoder()
    while pos < len(text):
        head = _CALL_HEAD.match(text, pos)
        try:
            value, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:  # the last call, still being written
            name = json.loads(head.group(1)) if head else None
            calls.append(ParsedCall(name, text[head.end() :] if head and head.group(2) else None, False, pos))
            return calls
        if not (head and head.group(2) and isinstance(value, dict) and isinstance(value.get("name"), str)):
            return None  # JSON, but not a call (a model free to write text wrote an object)
        calls.append(ParsedCall(value["name"], text[head.end() : end - 1], True, pos))  # the arguments as written
        pos = end + len(text[end:]) - len(text[end:].lstrip(CALL_SEPARATOR))
    return calls


@dataclass
class ToolCalls:
    """A reply held to tool calls (tool_choice "required", or one named function when `names` has one name), or
    to calls or text ("auto"). Each streamed reply gets its own Stream."""

    tools: dict[str, dict[str, Any]]  # name -> parameters schema, of the functions the reply may call
    parallel: bool = True  # several calls, one per line
    text_allowed: bool = False  # "auto": plain text instead of calls

    def grammar(self, tokenizer: Tokenizer, vocab_size: int, lead: str) -> Grammar:
        """The reply's grammar in llguidance's Lark dialect, lead allowed first."""
        defs = {f"tool{i}": _rebased(schema, f"#/$defs/tool{i}") for i, schema in enumerate(self.tools.values())}
        one = [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "arguments": {"$ref": f"#/$defs/tool{i}"}},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for i, name in enumerate(self.tools)
        ]
        schema = {**(one[0] if len(one) == 1 else {"anyOf": one}), "$defs": defs}
        calls = f"call ({lark_literal(CALL_SEPARATOR)} call)*" if self.parallel else "call"
        lines = [f"calls: {lark_literal(lead)}? {calls}" if lead else f"calls: {calls}", f"call: {json_rule(schema)}"]
        if self.text_allowed:
            # Text is anything whose first character past the lead is not the `{` that begins a call.
            skip = re.escape(lead) if lead else ""
            first = f"[^{{{skip}]" if lead else "[^{]"
            spaces = f"[{skip}]*" if lead else ""
            lines += ["start: calls | text", "text: TEXT", f"TEXT: /{spaces}({first}[\\s\\S]*)?/"]
        else:
            lines.append("start: calls")
        return Grammar.from_lark(tokenizer, "\n".join(lines) + "\n", vocab_size)

    def message(self, text: str, reason: str | None) -> tuple[dict[str, Any], str | None]:
        """A finished reply as OpenAI's message and finish reason: the calls written whole as tool_calls
        ("tool_calls" when nothing was cut short), a call cut short (max_tokens) as text with "length", or text.
        Every message this returns is one the server accepts back in a conversation: no call is partial."""
        calls = parse_calls(text)
        if not calls and (self.text_allowed or calls is None):
            return {"role": "assistant", "content": text}, reason
        whole = [call for call in calls if call.complete]
        cut = cut_text(text, calls)
        if not whole:  # a client would read an unfinished call as one to a tool named '' (LangChain does)
            return {"role": "assistant", "content": text}, "length"
        tool_calls = [_call(new_call_id(), call) for call in whole]
        finished = "tool_calls" if reason == "stop" and cut is None else "length"
        return {"role": "assistant", "content": cut, "tool_calls": tool_calls}, finished

    def stream(self) -> CallStream:
        """A reader that turns this reply's text, as it comes, into OpenAI's chat deltas."""
        return CallStream(self)


def cut_text(text: str, calls: list[ParsedCall]) -> str | None:
    """The text of a reply's last call when it was cut short (None when every call is whole), from where it
    begins, or the whole reply when no call before it is whole (the lead with it)."""
    if calls and calls[-1].complete:
        return None
    return text[calls[-1].start :] if len(calls) > 1 else text  # only the last call can be unfinished


@dataclass
class CallStream:
    """Turns one streamed reply into deltas: each call once it is written whole (its id, name and arguments in one
    delta: a call cut short by max_tokens is never half-announced), a call cut short as content, as the whole
    reply gives it; plain text ("auto") as content."""

    shape: ToolCalls
    text: str = ""
    ids: list[str] = field(default_factory=list)  # the announced calls' ids
    content_sent: int = 0

    def delta(self, piece: str, reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The delta for the next piece of the reply, and the finish reason when reason (the engine's) ends it."""
        self.text += piece
        calls = parse_calls(self.text)
        if calls is None or (reason is not None and not calls and self.shape.text_allowed):
            new, self.content_sent = self.text[self.content_sent :], len(self.text)
            return ({"content": new} if new else {}), reason
        out: dict[str, Any] = {}
        entries = []
        for index, call in enumerate(calls):
            if index == len(self.ids) and call.complete:
                self.ids.append(new_call_id())
                entries.append({"index": index, **_call(self.ids[index], call)})
        if entries:
            out["tool_calls"] = entries
        if reason is not None:
            message, reason = self.shape.message(self.text, reason)
            if message["content"]:
                out["content"] = message["content"]
        return out, reason


def _call(call_id: str, call: ParsedCall) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": call.name or "", "arguments": call.arguments or ""}}


def tool_shape(
    tools: list[Tool] | None, choice: Any, parallel: bool | None, response_format_given: bool
) -> ToolCalls | None:
    """The reply shape that tools and tool_choice ask for (None: free text)."""
    tools = tools or []
    if not tools:
        if choice not in (None, "none"):
            raise ToolChoiceError("tool_choice needs tools: offer the functions in `tools`", "tool_choice")
        return None
    names = [tool.function.name for tool in tools]
    if len(set(names)) != len(names):
        raise ToolChoiceError("each function in tools needs a name of its own", "tools")
    if choice == "none":
        return None
    if response_format_given:
        raise ToolChoiceError(
            "tools with tool_choice other than 'none' fix the reply's form; drop response_format, "
            "or send tool_choice 'none'",
            "response_format",
        )
    parameters = {tool.function.name: tool.function.parameters or NO_ARGUMENTS for tool in tools}
    parallel = parallel is not False  # OpenAI's default: true
    if choice in (None, "auto"):
        return ToolCalls(parameters, parallel, text_allowed=True)
    if choice == "required":
        return ToolCalls(parameters, parallel)
    name = choice.function.name
    if name not in parameters:
        raise ToolChoiceError(
            f"tool_choice names function {name!r}, which is not among the tools ({', '.join(names)})", "tool_choice"
        )
    return ToolCalls({name: parameters[name]}, parallel=False)


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
            out[key] = {name: _rebased(sub, base) for name, sub in value.items()} if isinstance(value, dict) else value
        else:
            out[key] = _rebased(value, base)
    return out


def template_tools(tools: list[Tool] | None) -> list[dict[str, Any]] | None:
    """The request's tools as a chat template's `tools` variable takes them (OpenAI's form)."""
    return [tool.model_dump(exclude_none=True) for tool in tools] if tools else None


def template_message(message: ChatMessage, index: int) -> dict[str, Any]:
    """A request message as a chat template reads it (Hugging Face's form: a call's arguments as a dict)."""
    out: dict[str, Any] = {"role": message.role, "content": message.text()}
    if message.tool_calls:
        if message.content is None:
            out["content"] = None
        out["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.function.name, "arguments": _arguments(call.function.arguments, index)},
            }
            for call in message.tool_calls
        ]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.name is not None:
        out["name"] = message.name
    return out


def _arguments(text: str, index: int) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise ToolChoiceError(
            f"messages[{index}]: a tool call's arguments must be JSON text, got {text[:40]!r}", "messages"
        ) from None
