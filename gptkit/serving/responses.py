"""POST /v1/responses: OpenAI's Responses API, stateless. The client sends the whole conversation as `input` items
(messages, function calls and their outputs); the reply is decoded as a chat reply is (same template, tool shapes
and grammars) and written as output items, whole or as the API's stream of typed events."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from pydantic import ValidationError

from gptkit.serving.chat import ChatPlan, plan_chat
from gptkit.serving.engine import Chunk
from gptkit.serving.envelope import finish, sse, sse_response
from gptkit.serving.schemas import RESPONSES_IGNORED, RESPONSES_UNUSED, NamedToolChoice, ResponsesRequest, Tool
from gptkit.serving.sequences import Collector, collect, stream_events, submit
from gptkit.serving.state import APIError, ServerState, check_model

TEXT_PARTS = ("input_text", "output_text", "text")


def register(app: FastAPI, state: ServerState) -> None:
    """Add the endpoint to app."""

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request) -> Any:
        return await _responses(state, body, request)


def _check_fields(body: ResponsesRequest) -> None:
    if body.previous_response_id is not None:
        raise APIError(
            400,
            "previous_response_id is not supported: this server keeps no responses; send the whole "
            "conversation in input (the earlier output items included)",
            param="previous_response_id",
        )
    for name, value in (body.model_extra or {}).items():
        if name in RESPONSES_IGNORED or (name in RESPONSES_UNUSED and value in (None, *RESPONSES_UNUSED[name])):
            continue
        known = name in RESPONSES_UNUSED
        raise APIError(
            400,
            f"{name} is not supported by gptkit; leave it out"
            if known
            else f"unknown field {name!r}: it is not part of OpenAI's Responses API",
            param=name,
            code="unsupported_parameter",
        )


def _text(content: Any, where: str) -> str:
    """A message's content (a string or a list of parts) as text; a part that is not text is refused."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}.content must be a string or a list of parts", param=where)
    texts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise APIError(
                400,
                f"{where}.content[{i}] is a {kind!r} part: gptkit serves text-only models, so only "
                "text parts are supported",
                param=where,
            )
        texts.append(part["text"])
    return "".join(texts)


def messages_of(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The instructions and input items as chat-template messages (consecutive function calls as one assistant
    turn with several tool_calls, a call's output as a tool turn)."""
    messages = [{"role": "system", "content": body.instructions}] if body.instructions else []
    items = [{"role": "user", "content": body.input}] if isinstance(body.input, str) else body.input
    for i, item in enumerate(items):
        where, kind = f"input[{i}]", item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise APIError(
                    400, f"{where}.role must be user, assistant, system or developer, got {role!r}", param=where
                )
            messages.append({"role": role, "content": _text(item.get("content"), where)})
        elif kind == "function_call":
            call = _function_call(item, where)
            if messages and messages[-1]["role"] == "assistant" and messages[-1].get("tool_calls"):
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": str(item.get("call_id")),
                    "content": output if isinstance(output, str) else _text(output, where),
                }
            )
        elif kind != "reasoning":  # a reasoning item (from another model) carries nothing this model reads
            raise APIError(
                400,
                f"{where}: input items of type {kind!r} are not supported (message, function_call "
                "and function_call_output are)",
                param=where,
            )
    if not messages:
        raise APIError(400, "input holds no message", param="input")
    return messages


def _function_call(item: dict[str, Any], where: str) -> dict[str, Any]:
    try:
        arguments = json.loads(item.get("arguments", ""))
    except (TypeError, json.JSONDecodeError):
        raise APIError(400, f"{where}.arguments must be JSON text", param=where) from None
    return {
        "id": str(item.get("call_id")),
        "type": "function",
        "function": {"name": str(item.get("name")), "arguments": arguments},
    }


def tools_of(body: ResponsesRequest) -> tuple[list[Tool] | None, Any]:
    """The request's function tools in the chat API's form, and its tool_choice likewise."""
    tools = []
    for i, spec in enumerate(body.tools or []):
        kind = spec.get("type")
        if kind != "function":
            raise APIError(
                400,
                f"tools[{i}] is a {kind!r} tool: gptkit runs no tools itself; offer function tools, "
                "which the client runs",
                param=f"tools[{i}]",
            )
        definition = {key: spec[key] for key in ("name", "description", "parameters", "strict") if key in spec}
        try:
            tools.append(Tool.model_validate({"type": "function", "function": definition}))
        except ValidationError as err:
            raise APIError(400, f"tools[{i}]: {err.errors()[0]['msg']}", param=f"tools[{i}]") from None
    choice = body.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise APIError(
                400,
                'tool_choice must be none, auto, required or {"type": "function", "name": ...}',
                param="tool_choice",
            )
        choice = NamedToolChoice.model_validate({"type": "function", "function": {"name": choice["name"]}})
    return tools or None, choice


def schema_of(body: ResponsesRequest) -> str | None:
    """The JSON schema text.format asks for (None: free text)."""
    spec = (body.text or {}).get("format")
    kind = spec.get("type") if isinstance(spec, dict) else None
    if spec is None or kind == "text":
        return None
    if kind == "json_object":
        return '{"type": "object"}'
    if kind == "json_schema" and isinstance(spec.get("schema", {}), dict):
        return json.dumps(spec.get("schema", {}))
    raise APIError(
        400,
        'text.format must be {"type": "text"}, {"type": "json_object"} or {"type": '
        '"json_schema", "name": ..., "schema": {...}}',
        param="text.format",
    )


@dataclass
class ResponseWriter:
    """Builds one response: the object, its output items, and (streamed) the events that lead to it."""

    state: ServerState
    body: ResponsesRequest
    plan: ChatPlan
    id: str = field(default_factory=lambda: f"resp_{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))
    sequence: int = 0

    def response(
        self, status: str, output: list[dict[str, Any]], output_tokens: int = 0, reason: str | None = None
    ) -> dict[str, Any]:
        """The response object (status in_progress, completed or incomplete)."""
        body, prompt = self.body, len(self.plan.prompt)
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "model": body.model,
            "output": output,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "tool_choice": body.tool_choice or ("auto" if body.tools else "none"),
            "tools": body.tools or [],
            "temperature": body.temperature,
            "top_p": body.top_p,
            "previous_response_id": None,
            "store": False,
            "text": body.text or {"format": {"type": "text"}},
            "metadata": {},
            "usage": {
                "input_tokens": prompt,
                "output_tokens": output_tokens,
                "total_tokens": prompt + output_tokens,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens_details": {"reasoning_tokens": 0},
            },
        }

    def items(self, text: str, reason: str | None) -> tuple[list[dict[str, Any]], str]:
        """A finished reply's output items and the response's status."""
        message, reason = self.plan.message(text, reason)
        status = "completed" if reason in ("stop", "tool_calls") else "incomplete"
        items = [
            function_item(call["id"], call["function"]["name"], call["function"]["arguments"], status)
            for call in message.get("tool_calls") or []
        ]
        if not items or message["content"]:  # after the calls: text that follows calls is a call cut short
            items.append(message_item(f"msg_{uuid.uuid4().hex}", message["content"], status))
        return items, status

    def event(self, kind: str, **fields: Any) -> str:
        """One event of the stream, numbered."""
        self.sequence += 1
        return sse({"type": kind, "sequence_number": self.sequence - 1, **fields}, name=kind)


def message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    """An assistant message output item holding text (no part while text is None)."""
    content = [] if text is None else [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def function_item(call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    """A function_call output item."""
    return {
        "type": "function_call",
        "id": f"fc_{call_id.removeprefix('call_')}",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


async def _responses(state: ServerState, body: ResponsesRequest, request: Request) -> Any:
    _check_fields(body)
    check_model(state, body.model)
    tools, choice = tools_of(body)
    plan = await plan_chat(
        state,
        body,
        messages_of(body),
        tools,
        choice,
        body.parallel_tool_calls,
        schema_of(body),
        body.max_output_tokens,
        "max_output_tokens",
    )
    writer = ResponseWriter(state, body, plan)
    collector = Collector(stream=bool(body.stream))
    sequences = submit(state, [plan.prompt], plan.params, None, collector, plan.grammar, body.model, body.lookup)
    if body.stream:
        events = EventStream(writer)
        return sse_response(stream_events(state, sequences, collector, events.render, events.closing, events.opening()))
    [chunks] = await collect(state, sequences, collector, request)
    items, status = writer.items("".join(c.text for c in chunks), chunks[-1].finish_reason if chunks else "length")
    return writer.response(status, items, chunks[-1].completion_tokens if chunks else 0)


class EventStream:
    """A streamed response as the API's typed events: the response created, each output item added, its text or
    arguments as deltas, each item done, and the response completed (or incomplete)."""

    def __init__(self, writer: ResponseWriter) -> None:
        self.writer = writer
        self.reader = writer.plan.shape.stream() if writer.plan.shape is not None else None
        self.items: list[dict[str, Any]] = []  # output items in the order they were added, as built so far
        self.message: dict[str, Any] | None = None  # the message item, once text has come
        self.output_tokens = 0
        self.status = "incomplete"

    def opening(self) -> list[str]:
        """response.created and response.in_progress."""
        response = self.writer.response("in_progress", [])
        return [
            self.writer.event("response.created", response=response),
            self.writer.event("response.in_progress", response=response),
        ]

    def render(self, index: int, chunk: Chunk) -> list[str]:
        """The events for one chunk of the reply."""
        self.output_tokens = chunk.completion_tokens
        reason = finish(chunk.finish_reason)
        if self.reader is not None:
            delta, reason = self.reader.delta(chunk.text, reason)
        else:
            delta = {"content": chunk.text} if chunk.text else {}
        events = []
        for entry in delta.get("tool_calls", []):
            events += self._call(entry)
        if delta.get("content"):  # after the calls: text that follows calls is a call cut short
            events += self._text(delta["content"])
        if chunk.finish_reason is not None:
            self.status = "completed" if reason in ("stop", "tool_calls") else "incomplete"
            events += self._close()
        return events

    def closing(self) -> list[str]:
        """The last event: the whole response."""
        kind = "response.completed" if self.status == "completed" else "response.incomplete"
        return [self.writer.event(kind, response=self.writer.response(self.status, self.items, self.output_tokens))]

    def _text(self, piece: str) -> list[str]:
        events = []
        if self.message is None:
            self.message = message_item(f"msg_{uuid.uuid4().hex}", None, "in_progress")
            self.items.append(self.message)
            events += [
                self.writer.event(
                    "response.output_item.added", output_index=len(self.items) - 1, item=dict(self.message, content=[])
                ),
                self.writer.event(
                    "response.content_part.added",
                    item_id=self.message["id"],
                    output_index=len(self.items) - 1,
                    content_index=0,
                    part={"type": "output_text", "text": "", "annotations": []},
                ),
            ]
            self.message["content"] = [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]
        self.message["content"][0]["text"] += piece
        return events + [
            self.writer.event(
                "response.output_text.delta",
                item_id=self.message["id"],
                output_index=self.items.index(self.message),
                content_index=0,
                delta=piece,
                logprobs=[],
            )
        ]

    def _call(self, entry: dict[str, Any]) -> list[str]:
        events = []
        if "id" in entry:
            item = function_item(entry["id"], entry["function"]["name"], "", "in_progress")
            self.items.append(item)
            events.append(
                self.writer.event("response.output_item.added", output_index=len(self.items) - 1, item=dict(item))
            )
        calls = [item for item in self.items if item["type"] == "function_call"]
        item = calls[entry["index"]]
        piece = entry["function"].get("arguments", "")
        if piece:
            item["arguments"] += piece
            events.append(
                self.writer.event(
                    "response.function_call_arguments.delta",
                    item_id=item["id"],
                    output_index=self.items.index(item),
                    delta=piece,
                )
            )
        return events

    def _close(self) -> list[str]:
        """Each item done (an empty reply still gets its message)."""
        if not self.items:
            self._text("")
        events = []
        for index, item in enumerate(self.items):
            item["status"] = self.status
            if item["type"] == "message":
                part = item["content"][0]
                events += [
                    self.writer.event(
                        "response.output_text.done",
                        item_id=item["id"],
                        output_index=index,
                        content_index=0,
                        text=part["text"],
                        logprobs=[],
                    ),
                    self.writer.event(
                        "response.content_part.done", item_id=item["id"], output_index=index, content_index=0, part=part
                    ),
                ]
            else:
                events.append(
                    self.writer.event(
                        "response.function_call_arguments.done",
                        item_id=item["id"],
                        output_index=index,
                        arguments=item["arguments"],
                        name=item["name"],
                    )
                )
            events.append(self.writer.event("response.output_item.done", output_index=index, item=item))
        return events
