"""What every route shares: the server's state (engine, tokenizer, template, limits) and the API's error."""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass, field
from typing import Any

from gptkit.chat import ChatTemplate
from gptkit.serving.engine import Engine
from gptkit.serving.lora_registry import AdapterRegistry
from gptkit.serving.metrics import Metrics
from gptkit.serving.templates import TemplateWorkers
from gptkit.tokenizer import Tokenizer

RENDER_SECONDS = 5.0  # a chat template rendering longer is stopped (templates come with downloaded models)


class APIError(Exception):
    """An error answered with an OpenAI error object and the given HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type_: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_
        self.headers = headers


@dataclass
class ServerState:
    """Everything the routes need: the engine, the tokenizer, the served name and the limits."""

    engine: Engine
    tokenizer: Tokenizer
    model_name: str
    chat_template: ChatTemplate
    api_key: str | None = None
    max_body_bytes: int = 1 << 20
    allowed_hosts: tuple[str, ...] | None = None  # Host names served besides loopback ones (None: any name)
    templates: TemplateWorkers | None = None  # where a model's own (Jinja) template renders; set from chat_template
    induction: concurrent.futures.Future | None = None  # the induction test, run once on the first request for it
    metrics: Metrics = field(default_factory=Metrics)
    adapters: AdapterRegistry | None = None  # LoRA adapters served beside the base (None: none can be)
    pooling: str = "mean"  # how /v1/embeddings pools hidden states: mean or last
    reply_lead: str | None = None  # what the template's replies begin with (" " for the default); found on first use

    def __post_init__(self) -> None:
        if self.chat_template.source is not None and self.templates is None:
            self.templates = TemplateWorkers(self.chat_template, RENDER_SECONDS)
        self.engine.metrics = self.metrics

    @property
    def context_length(self) -> int:
        """The most tokens (prompt and completion) one request may hold."""
        return self.engine.max_context

    def render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
        """The messages as the model's template writes them, ending where the reply begins (a model's own template
        in a process that can be stopped; gptkit's default, which always ends, here)."""
        limit = 4 * self.max_body_bytes
        if self.templates is not None:
            return self.templates.render(messages, tools, max_chars=limit)
        return self.chat_template.render(messages, max_chars=limit, tools=tools)


def check_model(state: ServerState, name: str) -> int:
    """Which served model a request's `model` names: 0 for the base, an adapter's number; a 404 for neither."""
    if name == state.model_name:
        return 0
    if state.adapters is not None and name in state.adapters.adapters:
        return state.adapters.adapters[name].index
    served = [state.model_name, *(state.adapters.adapters if state.adapters is not None else ())]
    raise APIError(
        404,
        f"model {name!r} does not exist; this server serves {', '.join(map(repr, served))}",
        param="model",
        code="model_not_found",
    )


def model_cards(state: ServerState) -> list[dict[str, Any]]:
    """The models as /v1/models lists them: the base, then each adapter with the base as its parent.
    context_length is the window a client must size its prompts to (what echo with logprobs can score);
    max_context the most tokens one request may reach, prompt and completion."""
    card = {
        "object": "model",
        "created": 0,
        "owned_by": "gptkit",
        "context_length": state.engine.scoring_context,
        "max_context": state.context_length,
    }
    cards = [{"id": state.model_name, **card, "root": state.model_name, "parent": None}]
    if state.adapters is not None:
        cards += [
            {"id": name, **card, "root": adapter.path, "parent": state.model_name}
            for name, adapter in state.adapters.adapters.items()
        ]
    return cards
