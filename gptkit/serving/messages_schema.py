"""Anthropic's Messages API as requests to the chat pipeline: the request bodies, their content blocks, tools and
tool_choice read into the chat endpoint's ChatRequest, and Anthropic's error object.

What gptkit cannot do is refused by field (a 400 in Anthropic's error shape): image and document blocks (its models
read text only), extended thinking, server tools, and an assistant turn last (a prefilled reply to continue).
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gptkit.serving.schemas import ChatRequest, LookupField, NullableFlag
from gptkit.serving.state import APIError

# Fields of Anthropic's API that never change the output here: accepted and ignored.
IGNORED_FIELDS = frozenset({"metadata", "service_tier", "cache_control"})
# The chat pipeline's field names (in its errors) -> the Messages API's.
FIELD_NAMES = {"stop": "stop_sequences"}


class _Request(BaseModel):
    # strict: "5" is not an integer; extra: kept, for refuse_extra to judge.
    model_config = ConfigDict(strict=True, extra="allow")


class CountTokensRequest(_Request):
    """POST /v1/messages/count_tokens: the prompt a Messages request would make, counted."""

    model: str
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None


class MessagesRequest(CountTokensRequest):
    """POST /v1/messages."""

    max_tokens: int
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0, le=1)  # Anthropic's range
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=1)
    stream: NullableFlag = False
    lookup: LookupField = None  # gptkit's extension, as on its OpenAI endpoints


def error_message(err: APIError) -> str:
    """An APIError's message in the Messages API's field names, naming the field where the message does not."""
    param, message = err.param, err.message
    if param in FIELD_NAMES:
        message = FIELD_NAMES[param] + message.removeprefix(param) if message.startswith(param) else message
        param = FIELD_NAMES[param]
    return f"{param}: {message}" if param and param not in message else message


def parse(model: type[_Request], body: Any) -> Any:
    """body validated as model; the first field that is wrong is a 400 naming it."""
    try:
        request = model.model_validate(body)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "the request body"
        detail = "is required" if first["type"] == "missing" else str(first["msg"]).removeprefix("Value error, ")
        raise APIError(400, f"{where}: {detail}", param=where) from None
    for name in request.model_extra or {}:
        if name not in IGNORED_FIELDS:
            raise APIError(
                400, f"unknown field {name!r}: it is not part of the Messages API as gptkit serves it", param=name
            )
    if request.thinking is not None and request.thinking.get("type") != "disabled":
        raise APIError(
            400,
            "extended thinking is not supported: gptkit's models answer without a thinking budget; leave thinking out",
            param="thinking",
        )
    return request


def to_chat(request: MessagesRequest | CountTokensRequest) -> ChatRequest:
    """The request as the chat endpoint's request: system and messages as chat messages, tools as functions."""
    body: dict[str, Any] = {"model": request.model, "messages": _messages(request)}
    tools = [_tool(spec, i) for i, spec in enumerate(request.tools or [])]
    if tools:
        body["tools"] = tools
    if request.tool_choice is not None:
        body["tool_choice"], parallel = _tool_choice(request.tool_choice)
        if parallel is not None:
            body["parallel_tool_calls"] = parallel
    if isinstance(request, MessagesRequest):
        body |= {"max_tokens": request.max_tokens, "stream": request.stream}
        body |= {
            name: getattr(request, name)
            for name in ("temperature", "top_p", "top_k")
            if getattr(request, name) is not None
        }
        if request.stop_sequences:
            body["stop"] = request.stop_sequences
    try:
        return ChatRequest.model_validate(body)
    except ValidationError as err:  # what the blocks hold, checked by the chat request's own rules
        first = err.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise APIError(400, f"{where}: {first['msg']}", param=str(first["loc"][0])) from None


def _messages(request: MessagesRequest | CountTokensRequest) -> list[dict[str, Any]]:
    """system and the turns as chat messages: a user turn's tool_result blocks as tool messages."""
    out = []
    if request.system:
        out.append({"role": "system", "content": _text_of(request.system, "system")})
    for i, turn in enumerate(request.messages):
        role, content, where = turn.get("role"), turn.get("content"), f"messages[{i}]"
        if role not in ("user", "assistant"):
            raise APIError(400, f"{where}.role must be 'user' or 'assistant', got {role!r}", param="messages")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
        elif isinstance(content, list):
            out += _user_blocks(content, where) if role == "user" else [_assistant_blocks(content, where)]
        else:
            raise APIError(400, f"{where}.content must be a string or a list of content blocks", param="messages")
    if request.messages[-1].get("role") == "assistant":
        raise APIError(
            400,
            "messages: the last turn is the assistant's; gptkit does not continue a prefilled reply, "
            "so end with a user turn",
            param="messages",
        )
    return out


def _block_type(block: Any, where: str, allowed: tuple[str, ...]) -> str:
    kind = block.get("type") if isinstance(block, dict) else None
    if kind not in allowed:
        why = "gptkit serves text-only models" if kind in ("image", "document") else "it is not supported here"
        raise APIError(400, f"{where} is a {kind!r} block: {why}; send {' or '.join(allowed)} blocks", param="messages")
    return kind


def _text_of(content: Any, where: str) -> str:
    """A string, or text blocks joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where} must be a string or a list of text blocks", param=where.partition("[")[0])
    for j, block in enumerate(content):
        _block_type(block, f"{where}[{j}]", ("text",))
    return "".join(str(block.get("text", "")) for block in content)


def _user_blocks(blocks: list[Any], where: str) -> list[dict[str, Any]]:
    out, text = [], []
    for j, block in enumerate(blocks):
        if _block_type(block, f"{where}.content[{j}]", ("text", "tool_result")) == "text":
            text.append(str(block.get("text", "")))
            continue
        if text:  # keep the turn's order: text written before a result comes before it
            out.append({"role": "user", "content": "".join(text)})
            text = []
        result = _text_of(block.get("content", ""), f"{where}.content[{j}].content")
        # The chat message has no error flag: the template shows the failure in the result's text.
        out.append(
            {
                "role": "tool",
                "tool_call_id": str(block.get("tool_use_id")),
                "content": f"Error: {result}" if block.get("is_error") else result,
            }
        )
    if text or not out:
        out.append({"role": "user", "content": "".join(text)})
    return out


def _assistant_blocks(blocks: list[Any], where: str) -> dict[str, Any]:
    text, calls = [], []
    for j, block in enumerate(blocks):
        if _block_type(block, f"{where}.content[{j}]", ("text", "tool_use")) == "text":
            text.append(str(block.get("text", "")))
        else:
            calls.append(
                {
                    "id": str(block.get("id")),
                    "type": "function",
                    "function": {"name": str(block.get("name")), "arguments": json.dumps(block.get("input", {}))},
                }
            )
    message: dict[str, Any] = {"role": "assistant", "content": "".join(text) if text or not calls else None}
    if calls:
        message["tool_calls"] = calls
    return message


def _tool(spec: dict[str, Any], index: int) -> dict[str, Any]:
    """An Anthropic client tool as a chat function."""
    kind = spec.get("type", "custom")
    if kind != "custom":
        raise APIError(
            400,
            f"tools[{index}] is a {kind!r} tool: gptkit runs no tools itself; offer client tools "
            "(name, description, input_schema), which the client runs",
            param="tools",
        )
    function = {key: spec[key] for key in ("name", "description") if key in spec}
    if "input_schema" in spec:
        function["parameters"] = spec["input_schema"]
    return {"type": "function", "function": function}


def _tool_choice(choice: dict[str, Any]) -> tuple[Any, bool | None]:
    """Anthropic's tool_choice as the chat API's, and whether parallel calls are allowed (None: the default)."""
    kind = choice.get("type")
    parallel = False if choice.get("disable_parallel_tool_use") else None
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    forms = {"auto": "auto", "any": "required", "none": "none"}
    if kind not in forms:
        raise APIError(
            400,
            'tool_choice must be {"type": "auto"}, {"type": "any"}, {"type": "none"} or {"type": "tool", "name": ...}',
            param="tool_choice",
        )
    return forms[kind], parallel
