"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API, on the chat endpoint's pipeline. A
request is read into a ChatRequest (gptkit.serving.messages_schema), planned, decoded and parsed as a chat request
is (same template, tool shapes and grammars), and the reply written as Anthropic's content blocks, whole or as its
stream of events. Errors are answered in Anthropic's error shape."""

from __future__ import annotations

import json
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from gptkit.decoding.request import Request as DecodeRequest
from gptkit.serving.chat import ChatPlan, plan_chat, prompt_ids
from gptkit.serving.engine import Chunk
from gptkit.serving.envelope import finish, sse, sse_response
from gptkit.serving.messages_schema import (
    CountTokensRequest,
    MessagesRequest,
    error_message,
    parse,
    to_chat,
)
from gptkit.serving.schemas import anthropic_error
from gptkit.serving.sequences import Collector, collect, stream_events, submit
from gptkit.serving.state import APIError, ServerState, check_model
from gptkit.serving.tools import template_message
from gptkit.tokenizer import Tokenizer

# The chat pipeline's finish reasons -> Anthropic's stop reasons ("stop" is end_turn unless a stop sequence ended it).
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def register(app: FastAPI, state: ServerState) -> None:
    """Add the endpoints to app."""

    @app.post("/v1/messages")
    async def messages(request: Request) -> Any:
        return await _answer(request, lambda body: _messages(state, body, request))

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> Any:
        return await _answer(request, lambda body: _count(state, body))


async def _answer(request: Request, handle: Callable[[Any], Awaitable[Any]]) -> Any:
    """handle(the request's JSON body); an APIError (or a body that is not JSON) answered in Anthropic's shape."""
    try:
        try:
            body = await request.json()
        except (ValueError, RecursionError):
            raise APIError(
                400, "the request body is not valid JSON (or nests too deeply); send a JSON object"
            ) from None
        return await handle(body)
    except APIError as err:
        return JSONResponse(anthropic_error(err.status, error_message(err)), err.status, headers=err.headers)


async def _count(state: ServerState, body: Any) -> dict[str, int]:
    request = parse(CountTokensRequest, body)
    check_model(state, request.model)
    chat = to_chat(request)
    messages = [template_message(m, i) for i, m in enumerate(chat.messages)]
    return {"input_tokens": len(await prompt_ids(state, messages, chat.tools))}


@dataclass
class Reply:
    """One reply's identity and the stop sequences it was asked to end at."""

    model: str
    plan: ChatPlan
    stop_sequences: list[str]
    id: str = field(default_factory=lambda: f"msg_{uuid.uuid4().hex}")

    def message(
        self, content: list[dict[str, Any]], stop: tuple[str | None, str | None], output_tokens: int
    ) -> dict[str, Any]:
        """The message object; stop is (stop_reason, stop_sequence)."""
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": stop[0],
            "stop_sequence": stop[1],
            "usage": {"input_tokens": len(self.plan.prompt), "output_tokens": output_tokens},
        }

    def stop(
        self, reason: str | None, text: str, sequence: DecodeRequest, tokenizer: Tokenizer
    ) -> tuple[str, str | None]:
        """The stop reason and stop sequence of a finished reply: reason is the chat pipeline's, text the reply as
        sent (cut before a stop string); which stop string ended it is read from the whole decoded output."""
        if reason == "stop" and self.stop_sequences and sequence.finish_reason == "stop":
            whole = tokenizer.decode(sequence.generated)
            hit = next((s for s in self.stop_sequences if whole.startswith(s, len(text))), None)
            if hit is not None:
                return "stop_sequence", hit
        return STOP_REASONS.get(reason or "length", "max_tokens"), None


async def _messages(state: ServerState, body: Any, request: Request) -> Any:
    anthropic = parse(MessagesRequest, body)
    check_model(state, anthropic.model)
    chat = to_chat(anthropic)
    messages = [template_message(m, i) for i, m in enumerate(chat.messages)]
    plan = await plan_chat(
        state,
        chat,
        messages,
        chat.tools,
        chat.tool_choice,
        chat.parallel_tool_calls,
        None,
        chat.max_tokens,
        "max_tokens",
    )
    reply = Reply(anthropic.model, plan, anthropic.stop_sequences or [])
    collector = Collector(stream=anthropic.stream)
    sequences = submit(
        state, [plan.prompt], plan.params, None, collector, plan.grammar, anthropic.model, anthropic.lookup
    )
    if anthropic.stream:
        events = EventStream(reply, state.tokenizer, sequences[0])
        return sse_response(stream_events(state, sequences, collector, events.render, events.closing, events.opening()))
    [chunks] = await collect(state, sequences, collector, request)
    text = "".join(c.text for c in chunks)
    message, reason = plan.message(text, chunks[-1].finish_reason if chunks else "length")
    stop = reply.stop(reason, text, sequences[0], state.tokenizer)
    return reply.message(content_blocks(message), stop, chunks[-1].completion_tokens if chunks else 0)


def tool_use_id(call_id: str) -> str:
    """A chat call id (call_...) as an Anthropic tool_use id (toolu_...)."""
    return "toolu_" + call_id.removeprefix("call_")


def _input(arguments: str) -> Any:
    """A call's arguments as its input object; arguments cut short (max_tokens) are no object yet: {}."""
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def content_blocks(message: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat reply message as content blocks: a tool_use block per call, then its text (a call cut short)."""
    blocks = [
        {
            "type": "tool_use",
            "id": tool_use_id(call["id"]),
            "name": call["function"]["name"],
            "input": _input(call["function"]["arguments"]),
        }
        for call in message.get("tool_calls") or []
    ]
    return blocks + ([{"type": "text", "text": message["content"]}] if message["content"] else [])


def event(kind: str, **fields: Any) -> str:
    """One server-sent event of the Messages stream, named by its type."""
    return sse({"type": kind, **fields}, name=kind)


class EventStream:
    """A streamed reply as Anthropic's events: message_start; per content block its start, deltas and stop;
    message_delta with the stop reason and usage; message_stop."""

    def __init__(self, reply: Reply, tokenizer: Tokenizer, sequence: DecodeRequest) -> None:
        self.reply, self.tokenizer, self.sequence = reply, tokenizer, sequence
        self.reader = reply.plan.shape.stream() if reply.plan.shape is not None else None
        self.blocks = 0  # content blocks started
        self.open: str | None = None  # the type of the block being written ("text", "tool_use")
        self.text = ""  # the reply's text as sent (what the stop sequence is found after)
        self.output_tokens = 0
        self.stop: tuple[str | None, str | None] = ("max_tokens", None)
        self.failed = False  # an error event ends the stream: no message_delta or message_stop follow it

    def opening(self) -> list[str]:
        """message_start: the message with no content yet."""
        return [event("message_start", message=self.reply.message([], (None, None), 0))]

    def render(self, index: int, chunk: Chunk) -> list[str]:
        """The events for one chunk of the reply."""
        self.output_tokens = chunk.completion_tokens
        self.text += chunk.text
        if chunk.finish_reason == "error":
            self.failed = True
            return [event("error", error={"type": "api_error", "message": "generation failed on the server"})]
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
            self.stop = self.reply.stop(reason, self.text, self.sequence, self.tokenizer)
            events += self._close()
        return events

    def closing(self) -> list[str]:
        """message_delta (the stop reason and usage), then message_stop."""
        if self.failed:
            return []
        delta = {"stop_reason": self.stop[0], "stop_sequence": self.stop[1]}
        return [
            event("message_delta", delta=delta, usage={"output_tokens": self.output_tokens}),
            event("message_stop"),
        ]

    def _start(self, block: dict[str, Any]) -> list[str]:
        events = self._close()
        self.open, self.blocks = block["type"], self.blocks + 1
        return events + [event("content_block_start", index=self.blocks - 1, content_block=block)]

    def _close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [event("content_block_stop", index=self.blocks - 1)]

    def _text(self, piece: str) -> list[str]:
        events = self._start({"type": "text", "text": ""}) if self.open != "text" else []
        return events + [
            event("content_block_delta", index=self.blocks - 1, delta={"type": "text_delta", "text": piece})
        ]

    def _call(self, entry: dict[str, Any]) -> list[str]:
        events = []
        if "id" in entry:
            block = {"type": "tool_use", "id": tool_use_id(entry["id"]), "name": entry["function"]["name"], "input": {}}
            events += self._start(block)
        piece = entry["function"].get("arguments", "")
        if piece:
            delta = {"type": "input_json_delta", "partial_json": piece}
            events.append(event("content_block_delta", index=self.blocks - 1, delta=delta))
        return events
