"""POST /v1/embeddings: a text's vector, pooled from the model's final hidden states (after the last norm).

Pooling: `mean` (the default) averages every token's state; `last` takes the last token's. A model trained only to
predict the next token puts most of its last state into that prediction, which says more about what comes next
than about what the text means; the mean reads every position. Vectors are scaled to unit length, as OpenAI's are,
so a dot product is the cosine similarity. (llama-server offers the same choice with --pooling.)
"""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import numpy as np
import torch
from fastapi import FastAPI

from gptkit.model import GPT
from gptkit.multi_lora import rows_using
from gptkit.serving.schemas import EmbeddingRequest
from gptkit.serving.sequences import check_prompt
from gptkit.serving.state import APIError, ServerState, check_model

POOLINGS = ("mean", "last")


def register(app: FastAPI, state: ServerState) -> None:
    """Add the endpoint to app."""

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest) -> Any:
        return await _embeddings(state, body)


@torch.no_grad()
def embed(model: GPT, ids: list[int], pooling: str, adapter: int = 0) -> list[float]:
    """One text's unit-length vector of model.config.n_embd numbers, pooled as `pooling` says (through one of the
    model's served adapters: gptkit.multi_lora)."""
    device = next(model.parameters()).device
    with rows_using(model, [adapter]):
        hidden = model.hidden(torch.tensor([ids], device=device))[0].float()  # (T, d)
    vector = hidden.mean(dim=0) if pooling == "mean" else hidden[-1]  # (d,)
    return torch.nn.functional.normalize(vector, dim=0).tolist()


def _inputs(state: ServerState, value: Any) -> list[list[int]]:
    """The request's inputs as token-id lists, each within what the model reads at once."""
    if isinstance(value, str) or (value and all(isinstance(v, int) for v in value)):
        value = [value]
    if not value:
        raise APIError(400, "input must not be an empty list", param="input")
    window = state.engine.scoring_context
    out = []
    for i, item in enumerate(value):
        ids = check_prompt(state, state.tokenizer.encode(item) if isinstance(item, str) else list(item), "input")
        if len(ids) > window:
            raise APIError(
                400,
                f"input[{i}] is {len(ids)} tokens; this model embeds at most {window} (its context): split the text",
                param="input",
                code="context_length_exceeded",
            )
        out.append(ids)
    return out


async def _embeddings(state: ServerState, body: EmbeddingRequest) -> dict[str, Any]:
    adapter = check_model(state, body.model)
    width = state.engine.model.config.n_embd
    if body.dimensions is not None and body.dimensions != width:
        raise APIError(
            400,
            f"dimensions {body.dimensions} is not supported: this model's embeddings have {width} "
            "(leave dimensions out)",
            param="dimensions",
        )
    inputs = await asyncio.to_thread(_inputs, state, body.input)
    model, pooling = state.engine.model, state.pooling
    # One job per input: decode steps of other requests run between them.
    futures = [state.engine.call(lambda ids=ids: embed(model, ids, pooling, adapter)) for ids in inputs]
    vectors = [await asyncio.wrap_future(f) for f in futures]
    data = [
        {"object": "embedding", "index": i, "embedding": _encoded(v, body.encoding_format)}
        for i, v in enumerate(vectors)
    ]
    tokens = sum(len(ids) for ids in inputs)
    return {
        "object": "list",
        "data": data,
        "model": body.model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


def _encoded(vector: list[float], encoding: str) -> list[float] | str:
    """float: the numbers; base64: their little-endian float32 bytes, as OpenAI encodes them."""
    if encoding == "float":
        return vector
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
