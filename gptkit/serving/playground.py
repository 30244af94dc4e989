"""The playground: its page, and the inspection it asks for (attention maps, the logit lens, the induction test)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

from gptkit.errors import GptkitError
from gptkit.serving.schemas import AttentionRequest, LensRequest
from gptkit.serving.sequences import check_prompt
from gptkit.serving.state import APIError, ServerState

# The routes below import gptkit.serving.inspection (and gptkit.observe under it) when first asked: a server that
# is never asked to inspect loads none of it.
if TYPE_CHECKING:
    from gptkit.serving.inspection import LensPosition

STATIC = Path(__file__).parent / "static"


def register(app: FastAPI, state: ServerState) -> None:
    """Add the page and its routes to app."""

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


def _text_ids(state: ServerState, text: str) -> list[int]:
    """A playground text's token ids, checked as a prompt is; an error names the field `text`."""
    try:
        return check_prompt(state, state.tokenizer.encode(text), "text")
    except GptkitError as err:
        raise APIError(400, f"cannot tokenize the text: {err}", param="text") from None


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
        raise APIError(400, f"position must be < {len(ids)} (the text's tokens), got {body.position}", param="position")
    model = state.engine.model
    rows = await asyncio.wrap_future(state.engine.call(lambda: lens_positions(model, ids, body.position, body.top)))
    return {"labels": lens_labels(model), "positions": [_lens_row(state, row) for row in rows]}


def _lens_row(state: ServerState, row: LensPosition) -> dict[str, Any]:
    """One position's lens as JSON: token texts, and per layer its top [text, p] pairs and p(prediction)."""
    from gptkit.serving.inspection import DIGITS

    def text(token: int) -> str:
        return state.tokenizer.decode([token])

    layers = [
        {"top": [[text(t), round(p, DIGITS)] for t, p in top], "prediction_p": round(q, DIGITS)}
        for top, q in zip(row.top, row.prediction_probs)
    ]
    return {
        "position": row.position,
        "token": text(row.token),
        "prediction": text(row.prediction),
        "decided_at": row.decided_at,
        "layers": layers,
    }


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
