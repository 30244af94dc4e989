"""POST /v1/completions: text in, text out, with echo, logprobs, n and streaming as OpenAI's legacy API has them."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI, Request

from gptkit.decoding.api import grammar_for
from gptkit.errors import GptkitError
from gptkit.serving.engine import Chunk, TokenInfo
from gptkit.serving.envelope import Envelope, finish, one_shot, sse, sse_response, usage
from gptkit.serving.schemas import CompletionRequest
from gptkit.serving.sequences import (
    Collector,
    check_fields,
    collect,
    compile_grammar,
    max_tokens_of,
    openai_closing,
    prompts_of,
    response_schema,
    sampling_params,
    stream_events,
    submit,
)
from gptkit.serving.state import APIError, ServerState, check_model


def register(app: FastAPI, state: ServerState) -> None:
    """Add the endpoint to app."""

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        return await _completions(state, body, request)


def completion_logprobs(tokens: list[TokenInfo], offset: int) -> dict[str, Any]:
    """OpenAI's legacy logprobs object; text_offset counts characters from the start of the echoed text."""
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token.text)
    return {
        "tokens": [t.text for t in tokens],
        "token_logprobs": [t.logprob for t in tokens],
        # OpenAI: "the logprob of the sampled token" is always among them (so up to logprobs + 1 entries).
        "top_logprobs": [
            {**{a.text: a.logprob for a in t.top}, t.text: t.logprob} if t.logprob is not None else None for t in tokens
        ],
        "text_offset": offsets,
    }


async def _scored_prompts(
    state: ServerState, prompts: list[list[int]], top: int, adapter: int
) -> list[list[TokenInfo]]:
    """Each prompt's tokens with their log-probabilities (echo with logprobs)."""
    window = state.engine.scoring_context + 1  # the last token's own prediction is not needed
    longest = max(len(p) for p in prompts)
    if longest > window:
        raise APIError(
            400,
            f"the prompt is {longest} tokens; echo with logprobs scores at most {window} (this "
            "model's context): send a shorter prompt, e.g. its last tokens",
            param="prompt",
            code="context_length_exceeded",
        )
    futures = [state.engine.call(lambda p=p: state.engine.score(p, top, adapter)) for p in prompts]
    try:
        return [await asyncio.wrap_future(f) for f in futures]
    except GptkitError as err:
        raise APIError(400, f"cannot score the prompt: {err}", param="prompt") from None


async def _completions(state: ServerState, body: CompletionRequest, request: Request) -> Any:
    check_fields(body)
    adapter = check_model(state, body.model)
    prompts = prompts_of(state, body.prompt)
    max_tokens = max_tokens_of(state, body.max_tokens, max(len(p) for p in prompts), allow_zero=body.echo)
    params = sampling_params(state, body, max_tokens, json_schema=response_schema(body))
    grammar = await compile_grammar(lambda model: grammar_for(model, state.tokenizer, params), state, "response_format")
    n, envelope = params.num_samples, Envelope("text_completion", body.model, "cmpl")
    texts = [state.tokenizer.decode(p) for p in prompts]
    echoed = [[] for _ in prompts]
    if body.echo and body.logprobs is not None:
        echoed = await _scored_prompts(state, prompts, body.logprobs, adapter)

    def choice(index: int, text: str, tokens: list[TokenInfo], reason: str | None, echo: bool) -> dict[str, Any]:
        p = index // n
        logprobs = None
        if body.logprobs is not None:
            logprobs = completion_logprobs((echoed[p] if echo else []) + tokens, 0 if echo else len(texts[p]))
        return {
            "index": index,
            "text": (texts[p] if echo else "") + text,
            "logprobs": logprobs,
            "finish_reason": finish(reason),
        }

    prompt_tokens = sum(len(p) for p in prompts)  # once per prompt, however many choices (as OpenAI counts)
    if body.echo and max_tokens == 0:  # scoring only
        result = envelope.body(
            [choice(i, "", [], "length", True) for i in range(len(prompts) * n)], usage(prompt_tokens, 0)
        )
        return sse_response(one_shot(result)) if body.stream else result
    collector = Collector(stream=bool(body.stream))
    sequences = submit(state, prompts, params, body.logprobs, collector, grammar, body.model, body.lookup)
    if body.stream:
        completion_tokens = [0] * len(sequences)
        offsets = [len(texts[i // n]) for i in range(len(sequences))]  # where each choice's next text starts

        def render(index: int, chunk: Chunk) -> list[str]:
            completion_tokens[index] = chunk.completion_tokens
            if not chunk.text and not chunk.tokens and chunk.finish_reason is None:
                return []
            event = choice(index, chunk.text, chunk.tokens, chunk.finish_reason, False)
            if event["logprobs"] is not None:
                event["logprobs"] = completion_logprobs(chunk.tokens, offsets[index])
            offsets[index] += len(chunk.text)
            return [sse(envelope.body([event]))]

        preamble = (
            [sse(envelope.body([choice(i, "", [], None, True)])) for i in range(len(sequences))] if body.echo else []
        )
        want_usage = body.stream_options is not None and body.stream_options.include_usage
        total = (lambda: envelope.body([], usage(prompt_tokens, sum(completion_tokens)))) if want_usage else None
        return sse_response(stream_events(state, sequences, collector, render, openai_closing(total), preamble))
    chunks = await collect(state, sequences, collector, request)
    choices = []
    for index, per_choice in enumerate(chunks):
        text = "".join(c.text for c in per_choice)
        tokens = [t for c in per_choice for t in c.tokens]
        choices.append(choice(index, text, tokens, per_choice[-1].finish_reason if per_choice else "length", body.echo))
    completion_tokens = sum(c[-1].completion_tokens for c in chunks if c)
    return envelope.body(choices, usage(prompt_tokens, completion_tokens))
