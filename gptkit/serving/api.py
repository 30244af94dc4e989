"""The HTTP face of the server: a FastAPI app speaking the OpenAI completions and chat API, plus the playground."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import hmac
import ipaddress
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, StreamingResponse
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gptkit.errors import GptkitError
from gptkit.chat import ChatTemplate, eos_text
from gptkit.decoding.api import grammar_for
from gptkit.decoding.grammar import ANY_OBJECT, Grammar
from gptkit.decoding.request import Request as DecodeRequest
from gptkit.decoding.sampling import SamplingParams, row_seed
from gptkit.serving.engine import Chunk, Engine, QueueFull, TokenInfo
from gptkit.serving.templates import TemplateWorkers
from gptkit.serving.tools import ToolChoiceError, new_call_id, template_message, template_tools, tool_plan
from gptkit.serving.schemas import (AttentionRequest, ChatRequest, CompletionRequest, DetokenizeRequest,
                                    LensRequest, TokenizeRequest, _Sampling, error_body, refused_field)

if TYPE_CHECKING:
    from gptkit.serving.inspection import LensPosition

STATIC = Path(__file__).parent / "static"
DEFAULT_MAX_TOKENS = SamplingParams.__dataclass_fields__["max_new_tokens"].default
RETRY_AFTER_SECONDS = 1
POLL_SECONDS = 0.5  # how often a non-streaming request checks whether its client is still there
_REQUEST_NAMES = {"num_samples": "n"}  # SamplingParams field -> OpenAI request field
RENDER_SECONDS = 5.0  # a chat template rendering longer is stopped (templates come with downloaded models)
COMPILE_SECONDS = 10.0  # a JSON schema (from a request) compiling longer is refused


class APIError(Exception):
    """An error answered with an OpenAI error object and the given HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error", headers: dict[str, str] | None = None) -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_
        self.headers = headers


@dataclass
class ServerState:
    """Everything the routes need: the engine, the tokenizer, the served name and the limits."""

    engine: Engine
    tokenizer: Any
    model_name: str
    chat_template: ChatTemplate
    api_key: str | None = None
    max_body_bytes: int = 1 << 20
    allowed_hosts: tuple[str, ...] | None = None  # Host names served besides loopback ones (None: any name)
    templates: TemplateWorkers | None = None  # where a model's own (Jinja) template renders; set from chat_template
    induction: concurrent.futures.Future | None = None  # the induction test, run once on the first request for it

    def __post_init__(self) -> None:
        if self.chat_template.source is not None and self.templates is None:
            self.templates = TemplateWorkers(self.chat_template, RENDER_SECONDS)

    @property
    def context_length(self) -> int:
        """The most tokens (prompt and completion) one request may hold."""
        return self.engine.max_context


class BodyLimit:
    """ASGI middleware: a request body larger than limit bytes gets 413 before the app parses it.

    The body is read here in full (it is at most limit bytes) and handed on as one message, so that a chunked
    upload without a Content-Length is refused as soon as it passes the limit.
    """

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            await self._reject(scope, receive, send)
            return
        body, more = bytearray(), True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending its body
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.limit:
                await self._reject(scope, receive, send)
                return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()  # later calls wait for the disconnect, as streaming responses expect

        await self.app(scope, replay, send)

    async def _reject(self, scope: Scope, receive: Receive, send: Send) -> None:
        message = f"request body exceeds the server's limit of {self.limit} bytes"
        response = JSONResponse(error_body(message, code="request_too_large"), status_code=413)
        await response(scope, receive, send)


def is_loopback(host: str) -> bool:
    """Whether a bind address or Host name means this machine only (localhost, 127.0.0.0/8, ::1)."""
    host = host.lower().rstrip(".")
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class HostGuard:
    """ASGI middleware: a request whose Host header names neither a loopback name nor an allowed host gets 403.

    A server on a loopback address is reachable from the user's browser; a web page whose DNS name the attacker
    rebinds to 127.0.0.1 sends its own name as Host, and is refused here (Jupyter's guard)."""

    def __init__(self, app: ASGIApp, allowed: tuple[str, ...]) -> None:
        self.app, self.allowed = app, {name.lower() for name in allowed}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        header = dict(scope.get("headers", [])).get(b"host")
        if scope["type"] in ("http", "websocket") and header is not None:
            name = _host_name(header.decode("latin-1"))
            if not (is_loopback(name) or name in self.allowed):
                message = (f"Host {name!r} is not served: this server answers loopback names only; start it with "
                           f"--allowed-host {name} to serve that name")  # fmt: skip
                response = JSONResponse(error_body(message, code="host_not_allowed"), status_code=403)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _host_name(host: str) -> str:
    """The name part of a Host header: without its port, an IPv6 address without its brackets."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].partition("]")[0]
    return host.rpartition(":")[0] if host.count(":") == 1 else host


def create_app(state: ServerState) -> FastAPI:
    """The FastAPI application serving state's engine."""
    app = FastAPI(title="gptkit", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.gptkit = state
    _install_error_handlers(app)
    app.add_middleware(BodyLimit, limit=state.max_body_bytes)

    if state.api_key:
        app.add_middleware(BearerAuth, key=state.api_key)
    if state.allowed_hosts is not None:
        app.add_middleware(HostGuard, allowed=state.allowed_hosts)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": state.model_name, **state.engine.stats()}

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [_model_card(state)]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> dict[str, Any]:
        _check_model(state, model_id)
        return _model_card(state)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        return await _completions(state, body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request) -> Any:
        return await _chat(state, body, request)

    # The tokenizer over HTTP, as vLLM offers it: lm-evaluation-harness's local-completions finds these and uses the
    # served model's own tokenizer (nothing to export, nothing to download).
    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict[str, Any]:
        return _tokenizer_info(state)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        encode = state.tokenizer.encode_prompt if body.add_special_tokens else state.tokenizer.encode
        try:
            tokens = await asyncio.to_thread(encode, body.prompt)  # a megabyte of text: not on the event loop
        except GptkitError as err:
            raise APIError(400, f"cannot tokenize the prompt: {err}", param="prompt") from None
        return {"tokens": tokens, "count": len(tokens), "max_model_len": state.engine.scoring_context}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        vocab = state.tokenizer.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token id {bad[0]} is outside the vocabulary [0, {vocab})", param="tokens")
        return {"prompt": state.tokenizer.decode(body.tokens)}

    @app.post("/playground/attention")
    async def attention(body: AttentionRequest) -> Any:
        return await _attention(state, body)

    @app.post("/playground/lens")
    async def lens(body: LensRequest) -> Any:
        return await _lens(state, body)

    @app.get("/playground/induction")
    async def induction() -> Any:
        return await _induction(state)

    @app.get("/", include_in_schema=False)
    async def playground() -> FileResponse:
        return FileResponse(STATIC / "index.html")

    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    return app


class BearerAuth:
    """ASGI middleware: API and playground routes answer 401 unless the request carries the bearer key."""

    GUARDED = ("/v1/", "/playground/", "/tokenize", "/detokenize", "/tokenizer_info")

    def __init__(self, app: ASGIApp, key: str) -> None:
        self.app, self.key = app, key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(self.GUARDED) and not self._authorised(scope):
            message = "missing or wrong API key: send the header 'Authorization: Bearer <key>'"
            response = JSONResponse(error_body(message, code="invalid_api_key"), status_code=401,
                                    headers={"WWW-Authenticate": "Bearer"})  # fmt: skip
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _authorised(self, scope: Scope) -> bool:
        header = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = header.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, err: APIError) -> JSONResponse:
        return JSONResponse(error_body(err.message, err.type, err.param, err.code), err.status, headers=err.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, err: RequestValidationError) -> JSONResponse:
        first = err.errors()[0] if err.errors() else {"msg": "invalid request", "loc": ()}
        if first.get("type") == "json_invalid":
            detail = first.get("ctx", {}).get("error", "")
            return JSONResponse(error_body(f"the request body is not valid JSON: {detail}".rstrip(": "),
                                           code="invalid_json"), 400)  # fmt: skip
        loc = [str(part) for part in first.get("loc", ()) if part != "body"]
        param = ".".join(loc) or None
        message = f"{param}: {first['msg']}" if param else str(first["msg"])
        if first.get("type") == "missing":
            # No loc past "body": the body itself is missing (an empty POST).
            message = f"{param} is required" if param else "the request has no body; send a JSON object"
        return JSONResponse(error_body(message, param=param, code="invalid_value"), 400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        message = f"no route {request.method} {request.url.path}" if err.status_code in (404, 405) else err.detail
        return JSONResponse(error_body(str(message)), err.status_code, headers=getattr(err, "headers", None))


def _model_card(state: ServerState) -> dict[str, Any]:
    """The model as /v1/models lists it: context_length is the window a client must size its prompts to (what
    echo with logprobs can score); max_context the most tokens one request may reach, prompt and completion."""
    return {"id": state.model_name, "object": "model", "created": 0, "owned_by": "gptkit",
            "context_length": state.engine.scoring_context, "max_context": state.context_length}  # fmt: skip


def _tokenizer_info(state: ServerState) -> dict[str, Any]:
    """The tokenizer's special tokens, context and chat template, as vLLM's /tokenizer_info gives them."""
    tokenizer = state.tokenizer
    bos = tokenizer.prompt_bos_id()
    return {"tokenizer_class": type(tokenizer).__name__, "eos_token": eos_text(tokenizer) or None,
            "bos_token": tokenizer.decode([bos]) if bos is not None else None,
            "pad_token": None, "model_max_length": state.engine.scoring_context,
            "chat_template": state.chat_template.jinja}  # fmt: skip


def _check_model(state: ServerState, name: str) -> None:
    if name != state.model_name:
        raise APIError(404, f"model {name!r} does not exist; this server serves {state.model_name!r}",
                       param="model", code="model_not_found")  # fmt: skip


# ----- turning a request into sequences -----


def _prompts(state: ServerState, prompt: Any) -> list[list[int]]:
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
        encoded.append(_check_prompt(state, ids))
    return encoded


def _check_prompt(state: ServerState, ids: list[int]) -> list[int]:
    vocab = state.tokenizer.vocab_size
    if not ids:
        raise APIError(400, "the prompt is empty; send at least one token of text", param="prompt")
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise APIError(400, f"token id {bad[0]} is outside the vocabulary [0, {vocab})", param="prompt")
    if len(ids) > state.context_length:
        raise APIError(400, f"the prompt is {len(ids)} tokens; this server's context is {state.context_length} "
                       "tokens",
                       param="prompt", code="context_length_exceeded")  # fmt: skip
    return ids


def _max_tokens(state: ServerState, requested: int | None, prompt_len: int, allow_zero: bool = False) -> int:
    """The tokens to generate: as requested (checked against the context), else the default capped to fit."""
    room = state.context_length - prompt_len
    if requested is None:
        if room < 1:
            raise APIError(400, f"the prompt ({prompt_len} tokens) fills the context of {state.context_length} tokens; "
                           "nothing can be generated", param="prompt", code="context_length_exceeded")  # fmt: skip
        return min(DEFAULT_MAX_TOKENS, room)
    if requested < (0 if allow_zero else 1):
        hint = " (0 is allowed only with echo, to score the prompt)" if not allow_zero else ""
        raise APIError(400, f"max_tokens must be >= 1, got {requested}{hint}", param="max_tokens")
    if requested > room:
        raise APIError(400, f"max_tokens {requested} plus the prompt's {prompt_len} tokens exceed this model's "
                       f"context of {state.context_length} tokens; ask for at most {max(room, 0)}",
                       param="max_tokens", code="context_length_exceeded")  # fmt: skip
    return requested


def _sampling_params(state: ServerState, body: _Sampling, max_tokens: int, extra_stop: tuple[str, ...] = (),
                     json_schema: str | None = None, schema_field: str = "response_format") -> SamplingParams:  # fmt: skip
    """SamplingParams from the request's fields; fields the request leaves out keep SamplingParams' defaults.
    schema_field: the request field json_schema came from (a refused schema is a 400 naming it)."""
    given: dict[str, Any] = {"json_schema": json_schema} if json_schema is not None else {}
    given |= {name: getattr(body, name) for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                                                      "frequency_penalty", "presence_penalty", "seed")
              if getattr(body, name) is not None}  # fmt: skip
    if body.logit_bias:
        given["logit_bias"] = _logit_bias(body.logit_bias, state.tokenizer.vocab_size)
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


async def _off_loop(work: Callable[[], Any], timeout: float) -> Any:
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


def _response_schema(body: _Sampling) -> str | None:
    """The JSON schema response_format asks the reply to follow (None: free text)."""
    spec = body.response_format
    if spec is None or spec.type == "text":
        return None
    if spec.type == "json_object":
        return ANY_OBJECT
    return json.dumps(spec.json_schema.schema_)


async def _grammar(state: ServerState, params: SamplingParams, param: str) -> Grammar | None:
    """params.json_schema compiled for the served model, off the event loop; one that fails is a 400 on param."""
    if params.json_schema is None:
        return None
    try:
        return await _off_loop(lambda: grammar_for(state.engine.model, state.tokenizer, params), COMPILE_SECONDS)
    except GptkitError as err:
        raise APIError(400, str(err), param=param) from None
    except asyncio.TimeoutError:
        raise APIError(400, f"the JSON schema did not compile within {COMPILE_SECONDS:g} s", param=param) from None


def _check_fields(body: _Sampling) -> None:
    """A 400 naming the first field that gptkit cannot honour (OpenAI's answer to an argument it does not know)."""
    refused = refused_field(body)
    if refused is not None:
        raise APIError(400, refused[1], param=refused[0], code="unsupported_parameter")


def _logit_bias(bias: dict[str, float], vocab: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias ({"token id": bias}) as (id, bias) pairs, each id checked against the vocabulary."""
    pairs = []
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit()) or int(key) >= vocab:
            raise APIError(400, f"logit_bias keys are token ids in [0, {vocab}) written as strings, got {key!r}",
                           param="logit_bias")  # fmt: skip
        pairs.append((int(key), value))
    return tuple(pairs)


def _choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """The params of choice `index` of n: its own seed (seed + index), one sample."""
    return dataclasses.replace(params, seed=row_seed(params.seed, index), num_samples=1)


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


def _submit(state: ServerState, prompts: list[list[int]], params: SamplingParams, top: int | None,
            collector: Collector, grammar: Grammar | None = None) -> list[DecodeRequest]:  # fmt: skip
    count, capacity = len(prompts) * params.num_samples, state.engine.max_batch_size + state.engine.max_queue
    if count > capacity:
        raise APIError(400, f"n x prompts = {count} sequences exceed the {capacity} this server can hold "
                       "(--max-batch-size + --max-queue); ask for fewer", param="n")  # fmt: skip
    sequences = []
    for p, prompt in enumerate(prompts):
        for i in range(params.num_samples):
            choice = _choice_params(params, i)
            request = DecodeRequest(prompt, choice, state.tokenizer.eos_ids, state.tokenizer.decode, seed=choice.seed,
                                    top_logprobs=top, constraint=grammar.start() if grammar else None)  # fmt: skip
            sequences.append((request, collector.sink(p * params.num_samples + i)))
    try:
        state.engine.submit(sequences, stream=collector.stream)
    except QueueFull as err:
        raise APIError(503, str(err), code="server_busy", type_="server_error",
                       headers={"Retry-After": str(RETRY_AFTER_SECONDS)}) from None  # fmt: skip
    return [request for request, _ in sequences]


async def _collect(state: ServerState, sequences: list[DecodeRequest], collector: Collector,
                   request: Request) -> list[list[Chunk]]:  # fmt: skip
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


async def _stream_events(state: ServerState, sequences: list[DecodeRequest], collector: Collector,
                         render: Callable[[int, Chunk], dict[str, Any] | None],
                         usage: Callable[[], dict[str, Any]] | None,
                         preamble: list[dict[str, Any]]) -> AsyncIterator[str]:  # fmt: skip
    """Server-sent events: the preamble, one event per chunk, the usage if asked, then [DONE]."""
    remaining = len(sequences)
    try:
        for event in preamble:
            yield _sse(event)
        while remaining:
            index, chunk = await collector.queue.get()
            remaining -= chunk.finish_reason is not None
            event = render(index, chunk)
            if event is not None:
                yield _sse(event)
        if usage is not None:
            yield _sse(usage())
        yield "data: [DONE]\n\n"
    finally:  # also runs when the client disconnects and the response is cancelled
        state.engine.cancel(sequences)


def _sse_response(events: AsyncIterator[str]) -> StreamingResponse:
    """An event stream that proxies must not buffer or cache."""
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})  # fmt: skip


def _sse(event: dict[str, Any]) -> str:
    return f"data: {json.dumps(event, ensure_ascii=False)}\n\n"


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}  # fmt: skip


def _finish(reason: str | None) -> str | None:
    """OpenAI's finish reasons; a cancelled or failed sequence reports what it has as "length"."""
    return reason if reason in (None, "stop", "length") else "length"


# ----- /v1/completions -----


def _completion_logprobs(tokens: list[TokenInfo], offset: int) -> dict[str, Any]:
    """OpenAI's legacy logprobs object; text_offset counts characters from the start of the echoed text."""
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token.text)
    return {
        "tokens": [t.text for t in tokens],
        "token_logprobs": [t.logprob for t in tokens],
        # OpenAI: "the logprob of the sampled token" is always among them (so up to logprobs + 1 entries).
        "top_logprobs": [{**{a.text: a.logprob for a in t.top}, t.text: t.logprob} if t.logprob is not None else None
                         for t in tokens],  # fmt: skip
        "text_offset": offsets,
    }


async def _completions(state: ServerState, body: CompletionRequest, request: Request) -> Any:
    _check_fields(body)
    _check_model(state, body.model)
    prompts = _prompts(state, body.prompt)
    longest = max(len(p) for p in prompts)
    scoring_only = body.echo and body.max_tokens == 0
    max_tokens = _max_tokens(state, body.max_tokens, longest, allow_zero=body.echo)
    params = _sampling_params(state, body, max_tokens, json_schema=_response_schema(body))
    grammar = await _grammar(state, params, "response_format")
    n = params.num_samples
    created, rid = int(time.time()), f"cmpl-{uuid.uuid4().hex}"
    texts = [state.tokenizer.decode(p) for p in prompts]
    echoed: list[list[TokenInfo]] = [[] for _ in prompts]
    if body.echo and body.logprobs is not None:
        window = state.engine.scoring_context + 1  # the last token's own prediction is not needed
        if longest > window:
            raise APIError(400, f"the prompt is {longest} tokens; echo with logprobs scores at most {window} "
                           "(this model's context): send a shorter prompt, e.g. its last tokens", param="prompt",
                           code="context_length_exceeded")  # fmt: skip
        futures = [state.engine.call(lambda p=p: state.engine.score(p, body.logprobs)) for p in prompts]
        try:
            echoed = [await asyncio.wrap_future(f) for f in futures]
        except GptkitError as err:
            raise APIError(400, f"cannot score the prompt: {err}", param="prompt") from None

    def choice(index: int, text: str, tokens: list[TokenInfo], reason: str | None, echo: bool) -> dict[str, Any]:
        p = index // n
        logprobs = None
        if body.logprobs is not None:
            pre = echoed[p] if echo else []
            logprobs = _completion_logprobs(pre + tokens, 0 if echo else len(texts[p]))
        return {"index": index, "text": (texts[p] if echo else "") + text, "logprobs": logprobs,
                "finish_reason": _finish(reason)}  # fmt: skip

    def envelope(choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> dict[str, Any]:
        out = {"id": rid, "object": "text_completion", "created": created, "model": state.model_name,
               "choices": choices}  # fmt: skip
        if usage is not None:
            out["usage"] = usage
        return out

    prompt_tokens = sum(len(p) for p in prompts)  # once per prompt, however many choices (as OpenAI counts)
    if scoring_only:
        choices = [choice(i, "", [], "length", True) for i in range(len(prompts) * n)]
        result = envelope(choices, _usage(prompt_tokens, 0))
        if body.stream:
            return _sse_response(_one_shot(result))
        return result

    collector = Collector(stream=bool(body.stream))
    sequences = _submit(state, prompts, params, body.logprobs, collector, grammar)
    if body.stream:
        completion_tokens = [0] * len(sequences)
        offsets = [len(texts[i // n]) for i in range(len(sequences))]  # where each choice's next text starts

        def render(index: int, chunk: Chunk) -> dict[str, Any] | None:
            completion_tokens[index] = chunk.completion_tokens
            if not chunk.text and not chunk.tokens and chunk.finish_reason is None:
                return None
            event = choice(index, chunk.text, chunk.tokens, chunk.finish_reason, False)
            if event["logprobs"] is not None:
                event["logprobs"] = _completion_logprobs(chunk.tokens, offsets[index])
            offsets[index] += len(chunk.text)
            return envelope([event])

        preamble = [envelope([choice(i, "", [], None, True)]) for i in range(len(sequences))] if body.echo else []
        want_usage = body.stream_options is not None and body.stream_options.include_usage
        usage = (lambda: envelope([], _usage(prompt_tokens, sum(completion_tokens)))) if want_usage else None
        return _sse_response(_stream_events(state, sequences, collector, render, usage, preamble))
    chunks = await _collect(state, sequences, collector, request)
    choices = []
    for index, per_choice in enumerate(chunks):
        text = "".join(c.text for c in per_choice)
        tokens = [t for c in per_choice for t in c.tokens]
        reason = per_choice[-1].finish_reason if per_choice else "length"
        choices.append(choice(index, text, tokens, reason, body.echo))
    completion_tokens = sum(c[-1].completion_tokens for c in chunks if c)
    return envelope(choices, _usage(prompt_tokens, completion_tokens))


async def _one_shot(event: dict[str, Any]) -> AsyncIterator[str]:
    yield _sse(event)
    yield "data: [DONE]\n\n"


# ----- /v1/chat/completions -----


def _chat_logprobs(tokens: list[TokenInfo]) -> list[dict[str, Any]]:
    """OpenAI's chat logprobs content list."""

    def entry(token: TokenInfo) -> dict[str, Any]:
        return {"token": token.text, "logprob": token.logprob, "bytes": list(token.data)}

    return [{**entry(t), "top_logprobs": [entry(a) for a in t.top]} for t in tokens]


async def _chat(state: ServerState, body: ChatRequest, request: Request) -> Any:
    _check_fields(body)
    _check_model(state, body.model)
    try:
        plan = tool_plan(body)
        messages = [template_message(m, i) for i, m in enumerate(body.messages)]
    except ToolChoiceError as err:
        raise APIError(400, str(err), param=err.param) from None
    tools = template_tools(body)

    def render() -> list[int]:
        if state.templates is not None:  # a model's own template: in a process that can be stopped
            text = state.templates.render(messages, tools, max_chars=4 * state.max_body_bytes)
        else:  # gptkit's default, which always ends
            text = state.chat_template.render(messages, max_chars=4 * state.max_body_bytes, tools=tools)
        return state.tokenizer.encode(text)

    try:
        prompt = _check_prompt(state, await _off_loop(render, 2 * RENDER_SECONDS))
    except GptkitError as err:
        raise APIError(400, str(err), param="messages") from None
    except asyncio.TimeoutError:
        raise APIError(400, f"the chat template did not render within {2 * RENDER_SECONDS:g} s",
                       param="messages") from None  # fmt: skip
    schema = plan.schema if plan is not None else _response_schema(body)
    requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    params = _sampling_params(state, body, _max_tokens(state, requested, len(prompt)), state.chat_template.stop,
                              schema, "tools" if plan is not None else "response_format")  # fmt: skip
    grammar = await _grammar(state, params, "tools" if plan is not None else "response_format")
    top = (body.top_logprobs or 0) if body.logprobs else None
    created, rid = int(time.time()), f"chatcmpl-{uuid.uuid4().hex}"
    collector = Collector(stream=bool(body.stream))
    sequences = _submit(state, [prompt], params, top, collector, grammar)
    prompt_tokens = len(prompt)

    def envelope(kind: str, choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> dict[str, Any]:
        out = {"id": rid, "object": kind, "created": created, "model": state.model_name, "choices": choices}
        if usage is not None:
            out["usage"] = usage
        return out

    def reply(text: str, reason: str | None) -> tuple[dict[str, Any], str | None]:
        """A finished choice's message and finish reason: a tool call when the plan's call is complete, the call as
        far as written when it was cut short (finish reason "length", as OpenAI answers)."""
        call = plan.call(text) if plan is not None and reason == "stop" else None
        if call is not None:
            return {"role": "assistant", "content": None, "tool_calls": [call]}, "tool_calls"
        if plan is not None and _finish(reason) == "length":
            return {"role": "assistant", "content": None, "tool_calls": [plan.cut_short(text)]}, "length"
        return {"role": "assistant", "content": text}, _finish(reason)

    if body.stream:
        completion_tokens = [0] * len(sequences)
        texts = [""] * len(sequences)  # a required call's text, held until it is whole
        named_ids = [new_call_id() for _ in sequences]

        def render_chunk(index: int, chunk: Chunk) -> dict[str, Any] | None:
            completion_tokens[index] = chunk.completion_tokens
            if not chunk.text and chunk.finish_reason is None:
                return None
            reason, delta = _finish(chunk.finish_reason), {}
            if plan is None:
                delta = {"content": chunk.text} if chunk.text else {}
            elif plan.name is not None:  # the reply is the named function's arguments: stream them as they come
                if chunk.text:
                    delta = {"tool_calls": [{"index": 0, "function": {"arguments": chunk.text}}]}
                reason = "tool_calls" if reason == "stop" else reason
            else:
                texts[index] += chunk.text
                if chunk.finish_reason is None and not (top is not None and chunk.tokens):
                    return None  # nothing to show until the call is whole
                if chunk.finish_reason is not None:
                    message, reason = reply(texts[index], chunk.finish_reason)
                    delta = {"tool_calls": [{"index": 0, **call} for call in message["tool_calls"]]} \
                        if message.get("tool_calls") else {"content": message["content"]}  # fmt: skip
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": reason}
            if top is not None and chunk.tokens:
                choice["logprobs"] = {"content": _chat_logprobs(chunk.tokens)}
            return envelope("chat.completion.chunk", [choice])

        def opening(index: int) -> dict[str, Any]:
            delta: dict[str, Any] = {"role": "assistant", "content": "" if plan is None else None}
            if plan is not None and plan.name is not None:
                delta["tool_calls"] = [{"index": 0, "id": named_ids[index], "type": "function",
                                        "function": {"name": plan.name, "arguments": ""}}]  # fmt: skip
            return envelope("chat.completion.chunk", [{"index": index, "delta": delta, "logprobs": None,
                                                       "finish_reason": None}])  # fmt: skip

        want_usage = body.stream_options is not None and body.stream_options.include_usage
        usage = None
        if want_usage:
            usage = lambda: envelope("chat.completion.chunk", [], _usage(prompt_tokens,
                                                                         sum(completion_tokens)))  # noqa: E731
        preamble = [opening(i) for i in range(len(sequences))]
        return _sse_response(_stream_events(state, sequences, collector, render_chunk, usage, preamble))
    chunks = await _collect(state, sequences, collector, request)
    choices = []
    for index, per_choice in enumerate(chunks):
        tokens = [t for c in per_choice for t in c.tokens]
        message, reason = reply("".join(c.text for c in per_choice), per_choice[-1].finish_reason if per_choice
                                else "length")  # fmt: skip
        choices.append({"index": index, "message": message,
                        "logprobs": {"content": _chat_logprobs(tokens)} if top is not None else None,
                        "finish_reason": reason})  # fmt: skip
    completion_tokens = sum(c[-1].completion_tokens for c in chunks if c)
    return envelope("chat.completion", choices, _usage(prompt_tokens, completion_tokens))


# ----- the playground's inspection -----


def _text_ids(state: ServerState, text: str) -> list[int]:
    """A playground text's token ids, checked as a prompt is; an error names the field `text`."""
    try:
        return _check_prompt(state, state.tokenizer.encode(text))
    except GptkitError as err:
        raise APIError(400, f"cannot tokenize the text: {err}", param="text") from None
    except APIError as err:
        raise APIError(err.status, err.message.replace("the prompt", "the text"), param="text",
                       code=err.code) from None  # fmt: skip


async def _attention(state: ServerState, body: AttentionRequest) -> dict[str, Any]:
    from gptkit.serving.inspection import attention_map, lens_window

    config = state.engine.model.config
    # The model reads (and the lens shows) the text's last block_size tokens: the map covers those, and `offset`
    # says how many came before them.
    offset, ids = lens_window(_text_ids(state, body.text), config.block_size, None)
    if body.layer >= config.n_layer:
        raise APIError(400, f"layer must be < {config.n_layer}, got {body.layer}", param="layer")
    if body.head is not None and body.head >= config.n_head:
        raise APIError(400, f"head must be < {config.n_head}, got {body.head}", param="head")
    future = state.engine.call(lambda: attention_map(state.engine.model, ids, body.layer, body.head))
    weights, probs = await asyncio.wrap_future(future)
    return {
        "tokens": [state.tokenizer.decode([t]) for t in ids],
        "offset": offset,
        "layers": config.n_layer,
        "heads": config.n_head,
        "layer": body.layer,
        "head": body.head,
        "attention": [[round(w, 4) for w in row] for row in weights],
        "probs": [None if p is None else round(p, 5) for p in probs],
    }


async def _lens(state: ServerState, body: LensRequest) -> dict[str, Any]:
    from gptkit.serving.inspection import lens_labels, lens_positions

    ids = _text_ids(state, body.text)
    if body.position is not None and body.position >= len(ids):
        raise APIError(400, f"position must be < {len(ids)} (the text's tokens), got {body.position}",
                       param="position")  # fmt: skip
    model = state.engine.model
    rows = await asyncio.wrap_future(state.engine.call(lambda: lens_positions(model, ids, body.position, body.top)))
    return {"labels": lens_labels(model), "positions": [_lens_row(state, row) for row in rows]}


def _lens_row(state: ServerState, row: LensPosition) -> dict[str, Any]:
    """One position's lens as JSON: token texts, and per layer its top [text, p] pairs and p(prediction)."""
    from gptkit.serving.inspection import DIGITS

    def text(token: int) -> str:
        return state.tokenizer.decode([token])

    layers = [{"top": [[text(t), round(p, DIGITS)] for t, p in top], "prediction_p": round(q, DIGITS)}
              for top, q in zip(row.top, row.prediction_probs)]  # fmt: skip
    return {"position": row.position, "token": text(row.token), "prediction": text(row.prediction),
            "decided_at": row.decided_at, "layers": layers}  # fmt: skip


async def _induction(state: ServerState) -> dict[str, Any]:
    from gptkit.serving.inspection import induction_summary

    # The test reads random sequences, not the request: run it once per server, on the engine thread.
    if state.induction is None:
        state.induction = state.engine.call(lambda: induction_summary(state.engine.model))
    try:
        return await asyncio.wrap_future(state.induction)
    except GptkitError as err:  # a context too short for the test (block_size < 4)
        raise APIError(400, f"cannot run the induction test on this model: {err}") from None
    except Exception:
        state.induction = None  # a passing failure (out of memory, say): the next request runs it again
        raise
