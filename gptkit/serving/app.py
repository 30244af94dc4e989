"""The HTTP face of the server: the FastAPI app, its middleware and error handlers, the small routes (health,
models, props, metrics, the tokenizer), and each endpoint family registered from its own module."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from gptkit.chat import eos_text
from gptkit.decoding.sampling import SamplingParams
from gptkit.errors import GptkitError
from gptkit.serving import chat, completions, embeddings, messages, playground, responses
from gptkit.serving.lora_registry import AdapterError, AdapterRegistry, ReadAdapter
from gptkit.serving.metrics import RequestCounter
from gptkit.serving.middleware import BODY_KEY, BearerAuth, BodyLimit, HostGuard
from gptkit.serving.nesting import deepest, field_name
from gptkit.serving.schemas import (
    DetokenizeRequest,
    LoadAdapterRequest,
    TokenizeRequest,
    UnloadAdapterRequest,
    error_body,
)
from gptkit.serving.state import APIError, ServerState, check_model, model_cards

PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


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
    app.add_middleware(RequestCounter, metrics=state.metrics)  # outermost: refusals are counted too
    _register_small_routes(app, state)
    _register_tokenizer_routes(app, state)
    for family in (completions, chat, responses, messages, embeddings, playground):
        family.register(app, state)
    _register_adapter_routes(app, state)
    return app


def _register_adapter_routes(app: FastAPI, state: ServerState) -> None:
    # vLLM's routes and fields for adapters loaded at run time.
    @app.post("/v1/load_lora_adapter")
    async def load_adapter(body: LoadAdapterRequest) -> dict[str, Any]:
        registry = _runtime_registry(state)
        try:  # the files are read off the engine thread (and off the event loop), under a deadline
            read = await asyncio.to_thread(registry.read, body.lora_name, body.lora_path)
        except GptkitError as err:
            raise APIError(400, str(err), param=_param(err, "lora_path")) from None
        return await _on_engine(state, lambda: _load(state, registry, body.lora_name, read))

    @app.post("/v1/unload_lora_adapter")
    async def unload_adapter(body: UnloadAdapterRequest) -> dict[str, Any]:
        registry = _runtime_registry(state)
        return await _on_engine(state, lambda: _unload(state, registry, body.lora_name))


def _runtime_registry(state: ServerState) -> AdapterRegistry:
    if not state.api_key or state.adapters is None:
        raise APIError(
            403,
            "loading adapters at run time needs a server started with --api-key (anyone who can "
            "reach it could otherwise make it read any directory)",
            code="forbidden",
        )
    return state.adapters


async def _on_engine(state: ServerState, work: Any) -> dict[str, Any]:
    """work() on the engine thread (between two steps); a GptkitError is a 400 on the field it names (lora_name
    unless it says)."""
    try:
        return await asyncio.wrap_future(state.engine.call(work))
    except GptkitError as err:
        raise APIError(400, str(err), param=_param(err, "lora_name")) from None


def _param(err: GptkitError, otherwise: str) -> str:
    return err.param if isinstance(err, AdapterError) else otherwise


def _load(state: ServerState, registry: AdapterRegistry, name: str, read: ReadAdapter) -> dict[str, Any]:
    adapter = registry.add(state.engine.model, name, read)
    state.engine.batch.model_changed()
    return {"object": "lora_adapter", "id": name, "index": adapter.index, "root": adapter.path}


def _unload(state: ServerState, registry: AdapterRegistry, name: str) -> dict[str, Any]:
    adapter = registry.adapters.get(name)
    if adapter is not None and state.engine.uses_adapter(adapter.index):
        raise GptkitError(f"adapter {name!r} is decoding requests now; unload it once they have finished")
    registry.remove(state.engine.model, name)
    state.engine.batch.model_changed()
    return {"object": "lora_adapter", "id": name, "deleted": True}


def _register_small_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": state.model_name, **state.engine.stats()}

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": model_cards(state)}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> dict[str, Any]:
        check_model(state, model_id)
        return next(card for card in model_cards(state) if card["id"] == model_id)

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(state.metrics.render(state.engine.stats()), media_type=PROMETHEUS_TEXT)

    @app.get("/props")
    async def props() -> dict[str, Any]:
        return _props(state)


def _props(state: ServerState) -> dict[str, Any]:
    """The model and server settings a client may adapt to (llama-server's /props, in gptkit's terms)."""
    config = state.engine.model.config
    defaults = SamplingParams()
    return {
        "model": state.model_name,
        "context_length": state.engine.scoring_context,
        "max_context": state.context_length,
        "vocab_size": state.tokenizer.vocab_size,
        "n_layer": config.n_layer,
        "n_head": config.n_head,
        "n_embd": config.n_embd,
        "chat_template": state.chat_template.jinja,
        "chat_template_is_default": state.chat_template.source is None,
        "eos_token": eos_text(state.tokenizer) or None,
        "max_batch_size": state.engine.max_batch_size,
        "max_queue": state.engine.max_queue,
        "default_generation_settings": {
            "max_tokens": defaults.max_new_tokens,
            "temperature": defaults.temperature,
            "top_p": defaults.top_p,
            "top_k": defaults.top_k,
        },
    }


def _register_tokenizer_routes(app: FastAPI, state: ServerState) -> None:
    # The tokenizer over HTTP, as vLLM offers it: lm-evaluation-harness's local-completions finds these and uses the
    # served model's own tokenizer (nothing to export, nothing to download).
    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict[str, Any]:
        tokenizer = state.tokenizer
        bos = tokenizer.prompt_bos_id()
        return {
            "tokenizer_class": type(tokenizer).__name__,
            "eos_token": eos_text(tokenizer) or None,
            "bos_token": tokenizer.decode([bos]) if bos is not None else None,
            "pad_token": None,
            "model_max_length": state.engine.scoring_context,
            "chat_template": state.chat_template.jinja,
        }

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


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, err: APIError) -> JSONResponse:
        return JSONResponse(error_body(err.message, err.type, err.param, err.code), err.status, headers=err.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, err: RequestValidationError) -> JSONResponse:
        return _validation_error(err)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        if isinstance(err.__cause__, RecursionError):  # FastAPI's "error parsing the body": nested past the parser
            return _too_deep(request)
        message = f"no route {request.method} {request.url.path}" if err.status_code in (404, 405) else err.detail
        return JSONResponse(error_body(str(message)), err.status_code, headers=getattr(err, "headers", None))


def _too_deep(request: Request) -> JSONResponse:
    """A 400 naming the field of the request's body that nests deeper than the JSON parser goes."""
    path, depth = deepest(request.scope.get(BODY_KEY, b""))
    route = request.scope.get("route")
    body_field = getattr(route, "body_field", None)
    model = body_field.field_info.annotation if body_field is not None else None
    param = field_name(path, model) if isinstance(model, type) and issubclass(model, BaseModel) else None
    what = param or "the request body"
    message = f"{what} is nested {depth} levels deep, deeper than this server parses JSON; send it less deeply nested"
    return JSONResponse(error_body(message, param=param or None, code="invalid_value"), 400)


def _validation_error(err: RequestValidationError) -> JSONResponse:
    """A request body that does not validate: a 400 naming the first field that is wrong, in OpenAI's error form."""
    first = err.errors()[0] if err.errors() else {"msg": "invalid request", "loc": ()}
    if first.get("type") == "json_invalid":
        detail = first.get("ctx", {}).get("error", "")
        return JSONResponse(
            error_body(f"the request body is not valid JSON: {detail}".rstrip(": "), code="invalid_json"), 400
        )
    # A union's alternatives add their type to the location (prompt.str, prompt.list[int]): the field is enough.
    loc = [str(part) for part in first.get("loc", ()) if part != "body" and not _is_type_tag(part)]
    param = ".".join(loc) or None
    detail = str(first["msg"]).removeprefix("Value error, ")
    message = f"{param}: {detail}" if param else detail
    if first.get("type") == "missing":
        # No loc past "body": the body itself is missing (an empty POST).
        message = f"{param} is required" if param else "the request has no body; send a JSON object"
    return JSONResponse(error_body(message, param=param, code="invalid_value"), 400)


def _is_type_tag(part: Any) -> bool:
    return isinstance(part, str) and (
        part in ("str", "int", "float", "bool", "none") or "[" in part or part.startswith("function-")
    )
