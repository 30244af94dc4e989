"""Requests into sequences and back: prompts checked and encoded, sampling settings, grammars, submission to the
engine, and the engine's chunks collected (whole) or streamed (as events)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request

from gptkit.decoding.grammar import ANY_OBJECT, Grammar
from gptkit.decoding.request import Request as DecodeRequest
from gptkit.decoding.sampling import SamplingParams, row_seed
from gptkit.errors import GptkitError
from gptkit.model import GPT
from gptkit.serving.engine import Chunk, QueueFull
from gptkit.serving.envelope import DONE, sse
from gptkit.serving.schemas import LookupSettings, SamplingFields, refused_field
from gptkit.serving.state import APIError, ServerState, check_model

DEFAULT_MAX_TOKENS = SamplingParams.__dataclass_fields__["max_new_tokens"].default
RETRY_AFTER_SECONDS = 1
POLL_SECONDS = 0.5  # how often a non-streaming request checks whether its client is still there
COMPILE_SECONDS = 10.0  # a JSON schema (from a request) compiling longer is refused
_REQUEST_NAMES = {"num_samples": "n"}  # SamplingParams field -> OpenAI request field


def prompts_of(state: ServerState, prompt: Any) -> list[list[int]]:
    """The request's prompt(s) as token-id lists, each checked against the vocabulary and the context."""
    if isinstance(prompt, str):
        prompts = [prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
        prompts = [prompt]
    else:
        prompts = list(prompt)
    if not prompts:
        raise APIError(400, "prompt must not be an empty list", param="prompt")
    encoded = []
    for p in prompts:
        try:
            ids = state.tokenizer.encode_prompt(p) if isinstance(p, str) else list(p)
        except GptkitError as err:
            raise APIError(400, f"cannot tokenize the prompt: {err}", param="prompt") from None
        encoded.append(check_prompt(state, ids))
    return encoded


def check_prompt(state: ServerState, ids: list[int], param: str = "prompt") -> list[int]:
    """ids, checked: not empty, inside the vocabulary, within the context."""
    vocab = state.tokenizer.vocab_size
    if not ids:
        raise APIError(400, f"the {param} is empty; send at least one token of text", param=param)
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise APIError(400, f"token id {bad[0]} is outside the vocabulary [0, {vocab})", param=param)
    if len(ids) > state.context_length:
        raise APIError(
            400,
            f"the {param} is {len(ids)} tokens; this server's context is {state.context_length} tokens",
            param=param,
            code="context_length_exceeded",
        )
    return ids


def max_tokens_of(
    state: ServerState, requested: int | None, prompt_len: int, allow_zero: bool = False, param: str = "max_tokens"
) -> int:
    """The tokens to generate: as requested (checked against the context), else the default capped to fit."""
    room = state.context_length - prompt_len
    if requested is not None and requested < (0 if allow_zero else 1):
        hint = " (0 is allowed only with echo, to score the prompt)" if not allow_zero else ""
        raise APIError(400, f"{param} must be >= 1, got {requested}{hint}", param=param)
    if requested == 0:
        return 0
    if room < 1:
        hint = "; send max_tokens 0 with echo to score it" if allow_zero else ""
        raise APIError(
            400,
            f"the prompt ({prompt_len} tokens) fills this server's context of {state.context_length} "
            f"tokens: nothing can be generated; shorten the prompt{hint}",
            param="prompt",
            code="context_length_exceeded",
        )
    if requested is None:
        return min(DEFAULT_MAX_TOKENS, room)
    if requested > room:
        raise APIError(
            400,
            f"{param} {requested} plus the prompt's {prompt_len} tokens exceed this server's context "
            f"of {state.context_length} tokens; ask for at most {room}",
            param=param,
            code="context_length_exceeded",
        )
    return requested


def sampling_params(
    state: ServerState,
    body: SamplingFields,
    max_tokens: int,
    extra_stop: tuple[str, ...] = (),
    json_schema: str | None = None,
    schema_field: str = "response_format",
) -> SamplingParams:
    """SamplingParams from the request's fields; fields the request leaves out keep SamplingParams' defaults.
    schema_field: the request field json_schema came from (a refused schema is a 400 naming it)."""
    given: dict[str, Any] = {"json_schema": json_schema} if json_schema is not None else {}
    given |= {
        name: getattr(body, name)
        for name in (
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "repetition_penalty",
            "frequency_penalty",
            "presence_penalty",
            "seed",
        )
        if getattr(body, name) is not None
    }
    if body.logit_bias:
        given["logit_bias"] = logit_bias(body.logit_bias, state.tokenizer.vocab_size)
    if body.n is not None:
        given["num_samples"] = body.n
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stop) > 4:
        raise APIError(400, f"stop takes at most 4 strings, got {len(stop)}", param="stop")
    try:
        return SamplingParams(max_new_tokens=max(max_tokens, 1), stop=tuple(stop) + extra_stop, **given)
    except (GptkitError, ValueError) as err:
        message = str(err).replace("num_samples", "n")  # the request's names, not SamplingParams'
        param = next((name for name in [*given, "stop"] if name in str(err)), None)
        names = {**_REQUEST_NAMES, "json_schema": schema_field}
        raise APIError(400, message, param=names.get(param, param)) from None


def logit_bias(bias: dict[str, float], vocab: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias ({"token id": bias}) as (id, bias) pairs, each id checked against the vocabulary."""
    pairs = []
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit()) or int(key) >= vocab:
            raise APIError(
                400,
                f"logit_bias keys are token ids in [0, {vocab}) written as strings, got {key!r}",
                param="logit_bias",
            )
        pairs.append((int(key), value))
    return tuple(pairs)


def check_fields(body: SamplingFields) -> None:
    """A 400 naming the first field that gptkit cannot honour (OpenAI's answer to an argument it does not know)."""
    refused = refused_field(body)
    if refused is not None:
        raise APIError(400, refused[1], param=refused[0], code="unsupported_parameter")


def response_schema(body: SamplingFields) -> str | None:
    """The JSON schema response_format asks the reply to follow (None: free text)."""
    spec = body.response_format
    if spec is None or spec.type == "text":
        return None
    if spec.type == "json_object":
        return ANY_OBJECT
    return json.dumps(spec.json_schema.schema_)


async def off_loop(work: Callable[[], Any], timeout: float) -> Any:
    """work() run in a thread of its own, so that the event loop (every other client, and SIGTERM) goes on; its
    result, or asyncio.TimeoutError after timeout seconds. The thread is a daemon: one that never ends (a template
    looping without output) cannot hold the process at exit."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if done.done():  # the caller gave up already
            return
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(result)

    def run() -> None:
        try:
            result, error = work(), None
        except Exception as err:  # handed to the awaiting request, which answers it
            result, error = None, err
        with contextlib.suppress(RuntimeError):  # the server stopped (its loop closed) meanwhile
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=run, name="gptkit-render", daemon=True).start()
    return await asyncio.wait_for(done, timeout)


async def compile_grammar(build: Callable[[GPT], Grammar | None], state: ServerState, param: str) -> Grammar | None:
    """build(model) run off the event loop: a grammar for the served model; one that fails is a 400 on param."""
    try:
        return await off_loop(lambda: build(state.engine.model), COMPILE_SECONDS)
    except GptkitError as err:
        raise APIError(400, str(err), param=param) from None
    except asyncio.TimeoutError:
        raise APIError(400, f"the JSON schema did not compile within {COMPILE_SECONDS:g} s", param=param) from None


class Collector:
    """Receives chunks from the engine thread into an asyncio queue on the server's loop."""

    def __init__(self, stream: bool = True) -> None:
        self.stream = stream  # False: one chunk per sequence, when it ends
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[tuple[int, Chunk]] = asyncio.Queue()

    def sink(self, index: int) -> Callable[[Chunk], None]:
        """The emit callback of choice `index`."""

        def emit(chunk: Chunk) -> None:
            try:
                self.loop.call_soon_threadsafe(self.queue.put_nowait, (index, chunk))
            except RuntimeError:  # the server's loop has closed (shutdown): nobody is listening any more
                pass

        return emit


def submit(
    state: ServerState,
    prompts: list[list[int]],
    params: SamplingParams,
    top: int | None,
    collector: Collector,
    grammar: Grammar | None = None,
    model: str = "",
    lookup: bool | LookupSettings | None = None,
) -> list[DecodeRequest]:
    """One decode request per prompt and choice (choice i of n seeded seed + i), queued on the engine; model: the
    request's `model`, naming the base or one of its adapters; lookup: the request's `lookup` field."""
    lookup_k, lookup_ngram = lookup_settings(state, lookup)
    adapter = check_model(state, model or state.model_name)
    key = state.adapters.key_of(adapter) if adapter else ""  # its weights' hash: the name may be reloaded with others
    count, capacity = len(prompts) * params.num_samples, state.engine.max_batch_size + state.engine.max_queue
    if count > capacity:
        raise APIError(
            400,
            f"n x prompts = {count} sequences exceed the {capacity} this server can hold "
            "(--max-batch-size + --max-queue); ask for fewer",
            param="n",
        )
    sequences = []
    for p, prompt in enumerate(prompts):
        for i in range(params.num_samples):
            choice = dataclasses.replace(params, seed=row_seed(params.seed, i), num_samples=1)
            request = DecodeRequest(
                prompt,
                choice,
                state.tokenizer.eos_ids,
                state.tokenizer.decode,
                seed=choice.seed,
                top_logprobs=top,
                constraint=grammar.start() if grammar else None,
                adapter=adapter,
                adapter_name=key,
                lookup_k=lookup_k,
                lookup_ngram=lookup_ngram,
            )
            sequences.append((request, collector.sink(p * params.num_samples + i)))
    try:
        state.engine.submit(sequences, stream=collector.stream)
    except QueueFull as err:
        raise APIError(
            503, str(err), code="server_busy", type_="server_error", headers={"Retry-After": str(RETRY_AFTER_SECONDS)}
        ) from None
    return [request for request, _ in sequences]


def lookup_settings(state: ServerState, lookup: bool | LookupSettings | None) -> tuple[int, int]:
    """(k, ngram) of the prompt lookup a request asked for (true, false or settings; None: the server's default),
    k 0 for none; a 400 where the server cannot give it."""
    default = state.engine.lookup
    if lookup is None:
        lookup = state.engine.lookup_by_default
    if lookup is False:
        return 0, 0
    settings = LookupSettings() if lookup is True else lookup
    k, ngram = settings.k or default.k, settings.ngram or default.ngram
    if k > state.engine.lookup_k:
        most = state.engine.lookup_k
        hint = f"ask for k <= {most}" if most else "start the server with --lookup to serve it (a sliding-window model)"
        raise APIError(400, f"lookup k {k} is more than this server proposes per check; {hint}", param="lookup")
    return k, ngram


async def collect(
    state: ServerState, sequences: list[DecodeRequest], collector: Collector, request: Request
) -> list[list[Chunk]]:
    """Every chunk of every sequence, waiting for the last; a client that leaves cancels its sequences."""
    chunks: list[list[Chunk]] = [[] for _ in sequences]
    remaining = len(sequences)
    next_check = time.monotonic() + POLL_SECONDS
    try:
        while remaining:
            try:
                index, chunk = await asyncio.wait_for(collector.queue.get(), POLL_SECONDS)
                chunks[index].append(chunk)
                remaining -= chunk.finish_reason is not None
            except asyncio.TimeoutError:
                pass
            if time.monotonic() >= next_check:  # on a clock: tokens may flow without pause for minutes
                if await request.is_disconnected():
                    break
                next_check = time.monotonic() + POLL_SECONDS
    finally:
        state.engine.cancel(sequences)  # a no-op for finished ones
    for per_choice in chunks:
        if per_choice and per_choice[-1].finish_reason == "error":
            raise APIError(500, "generation failed on the server; see its log", type_="server_error")
    return chunks


async def stream_events(
    state: ServerState,
    sequences: list[DecodeRequest],
    collector: Collector,
    render: Callable[[int, Chunk], list[str]],
    closing: Callable[[], list[str]],
    preamble: list[str],
) -> AsyncIterator[str]:
    """Server-sent events: the preamble, the events render makes of each chunk, then the closing events."""
    remaining = len(sequences)
    try:
        for event in preamble:
            yield event
        while remaining:
            index, chunk = await collector.queue.get()
            remaining -= chunk.finish_reason is not None
            for event in render(index, chunk):
                yield event
        for event in closing():
            yield event
    finally:  # also runs when the client disconnects and the response is cancelled
        state.engine.cancel(sequences)


def openai_closing(usage: Callable[[], dict[str, Any]] | None) -> Callable[[], list[str]]:
    """The end of a completions or chat stream: the usage event when asked for, then [DONE]."""
    return lambda: ([sse(usage())] if usage is not None else []) + [DONE]
