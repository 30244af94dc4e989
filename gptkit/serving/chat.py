"""POST /v1/chat/completions: messages rendered with the model's chat template, the reply as text or tool calls."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Callable

from fastapi import FastAPI, Request

from gptkit.chat import reply_lead as template_reply_lead
from gptkit.decoding.grammar import Grammar
from gptkit.decoding.sampling import SamplingParams
from gptkit.errors import GptkitError
from gptkit.serving.engine import Chunk, TokenInfo
from gptkit.serving.envelope import Envelope, finish, sse, sse_response, usage
from gptkit.serving.schemas import ChatRequest, ResponsesRequest, SamplingFields, Tool
from gptkit.serving.sequences import (
    Collector,
    check_fields,
    check_prompt,
    collect,
    compile_grammar,
    max_tokens_of,
    off_loop,
    openai_closing,
    response_schema,
    sampling_params,
    stream_events,
    submit,
)
from gptkit.serving.state import RENDER_SECONDS, APIError, ServerState, check_model
from gptkit.serving.tools import ToolCalls, ToolChoiceError, template_message, template_tools, tool_shape


def register(app: FastAPI, state: ServerState) -> None:
    """Add the endpoint to app."""

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request) -> Any:
        return await _chat(state, body, request)


@dataclass
class ChatPlan:
    """A chat request made ready to decode: the prompt's ids, the sampling settings, the grammar and the shape of
    the reply (None: text)."""

    prompt: list[int]
    params: SamplingParams
    grammar: Grammar | None
    shape: ToolCalls | None

    def message(self, text: str, reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The finished reply as OpenAI's assistant message, and its finish reason."""
        if self.shape is not None:
            return self.shape.message(text, finish(reason))
        return {"role": "assistant", "content": text}, finish(reason)


async def _render(state: ServerState, work: Callable[[], Any]) -> Any:
    """work() (which renders with the chat template) off the event loop; a template failure is a 400."""
    try:
        return await off_loop(work, 2 * RENDER_SECONDS)
    except GptkitError as err:
        raise APIError(400, str(err), param="messages") from None
    except asyncio.TimeoutError:
        raise APIError(
            400, f"the chat template did not render within {2 * RENDER_SECONDS:g} s", param="messages"
        ) from None


async def reply_lead(state: ServerState) -> str:
    """The whitespace the template writes between the generation prompt and a reply (the default template's space),
    found once by rendering a conversation with and without a reply."""
    if state.reply_lead is None:
        state.reply_lead = await _render(state, lambda: template_reply_lead(state.render_chat))
    return state.reply_lead


async def prompt_ids(state: ServerState, messages: list[dict[str, Any]], tools: list[Tool] | None) -> list[int]:
    """The token ids of messages and tools as the chat template writes them, up to where the reply begins."""
    rendered = template_tools(tools)
    return await _render(state, lambda: state.tokenizer.encode(state.render_chat(messages, rendered)))


async def plan_chat(
    state: ServerState,
    body: SamplingFields | ResponsesRequest,
    messages: list[dict[str, Any]],
    tools: list[Tool] | None,
    tool_choice: Any,
    parallel: bool | None,
    schema: str | None,
    max_tokens: int | None,
    max_tokens_field: str,
) -> ChatPlan:
    """Render, tokenize and check a chat request; its sampling settings, grammar and reply shape."""
    try:
        shape = tool_shape(tools, tool_choice, parallel, schema is not None)
    except ToolChoiceError as err:
        raise APIError(400, str(err), param=err.param) from None
    prompt = check_prompt(state, await prompt_ids(state, messages, tools), "messages")
    params = sampling_params(
        state,
        body,
        max_tokens_of(state, max_tokens, len(prompt), param=max_tokens_field),
        state.chat_template.stop,
        schema,
    )
    grammar = None
    if shape is not None or schema is not None:
        lead = await reply_lead(state)

        def build(model: Any) -> Grammar:
            size = model.config.vocab_size
            if shape is not None:
                return shape.grammar(state.tokenizer, size, lead)
            return Grammar(state.tokenizer, schema, size, lead)

        grammar = await compile_grammar(build, state, "tools" if shape is not None else "response_format")
    return ChatPlan(prompt, params, grammar, shape)


def chat_logprobs(tokens: list[TokenInfo]) -> list[dict[str, Any]]:
    """OpenAI's chat logprobs content list."""

    def entry(token: TokenInfo) -> dict[str, Any]:
        return {"token": token.text, "logprob": token.logprob, "bytes": list(token.data)}

    return [{**entry(t), "top_logprobs": [entry(a) for a in t.top]} for t in tokens]


async def _chat(state: ServerState, body: ChatRequest, request: Request) -> Any:
    check_fields(body)
    check_model(state, body.model)
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: send logprobs true with it", param="top_logprobs")
    try:
        messages = [template_message(m, i) for i, m in enumerate(body.messages)]
    except ToolChoiceError as err:
        raise APIError(400, str(err), param=err.param) from None
    use_max = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    plan = await plan_chat(
        state,
        body,
        messages,
        body.tools,
        body.tool_choice,
        body.parallel_tool_calls,
        response_schema(body),
        getattr(body, use_max),
        use_max,
    )
    top = (body.top_logprobs or 0) if body.logprobs else None
    envelope = Envelope("chat.completion", body.model, "chatcmpl")
    collector = Collector(stream=bool(body.stream))
    sequences = submit(state, [plan.prompt], plan.params, top, collector, plan.grammar, body.model, body.lookup)
    if body.stream:
        return _streamed(state, body, plan, envelope, sequences, collector, top)
    chunks = await collect(state, sequences, collector, request)
    choices = []
    for index, per_choice in enumerate(chunks):
        tokens = [t for c in per_choice for t in c.tokens]
        message, reason = plan.message(
            "".join(c.text for c in per_choice), per_choice[-1].finish_reason if per_choice else "length"
        )
        choices.append(
            {
                "index": index,
                "message": message,
                "logprobs": {"content": chat_logprobs(tokens)} if top is not None else None,
                "finish_reason": reason,
            }
        )
    completion_tokens = sum(c[-1].completion_tokens for c in chunks if c)
    return envelope.body(choices, usage(len(plan.prompt), completion_tokens))


def _streamed(
    state: ServerState,
    body: ChatRequest,
    plan: ChatPlan,
    envelope: Envelope,
    sequences: list[Any],
    collector: Collector,
    top: int | None,
) -> Any:
    """The reply as chat.completion.chunk events: content deltas, or tool calls as their names and arguments come."""
    completion_tokens = [0] * len(sequences)
    readers = [plan.shape.stream() if plan.shape is not None else None for _ in sequences]

    def render(index: int, chunk: Chunk) -> list[str]:
        completion_tokens[index] = chunk.completion_tokens
        if not chunk.text and chunk.finish_reason is None and not (top is not None and chunk.tokens):
            return []
        reader = readers[index]
        if reader is None:
            delta, reason = ({"content": chunk.text} if chunk.text else {}), finish(chunk.finish_reason)
        else:
            delta, reason = reader.delta(chunk.text, finish(chunk.finish_reason))
        if not delta and reason is None and not (top is not None and chunk.tokens):
            return []
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": reason}
        if top is not None and chunk.tokens:
            choice["logprobs"] = {"content": chat_logprobs(chunk.tokens)}
        return [sse(envelope.body([choice], kind="chat.completion.chunk"))]

    calls_only = plan.shape is not None and not plan.shape.text_allowed
    opening = [
        sse(
            envelope.body(
                [
                    {
                        "index": i,
                        "delta": {"role": "assistant", "content": None if calls_only else ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ],
                kind="chat.completion.chunk",
            )
        )
        for i in range(len(sequences))
    ]
    want_usage = body.stream_options is not None and body.stream_options.include_usage

    def total() -> dict[str, Any]:  # the closing chunk with the usage, where the request asked for it
        return envelope.body([], usage(len(plan.prompt), sum(completion_tokens)), kind="chat.completion.chunk")

    closing = openai_closing(total if want_usage else None)
    return sse_response(stream_events(state, sequences, collector, render, closing, opening))
