"""The one response wrapper every endpoint answers in: its id and creation time, the JSON body or the event stream."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi.responses import StreamingResponse


@dataclass
class Envelope:
    """One response's identity (OpenAI's `id`, `object`, `created`, `model`) around its choices and usage."""

    kind: str  # the `object` of a whole answer: "text_completion", "chat.completion"
    model: str
    prefix: str  # the id's prefix: "cmpl", "chatcmpl"
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.id = self.id or f"{self.prefix}-{uuid.uuid4().hex}"

    def body(
        self, choices: list[dict[str, Any]], usage: dict[str, int] | None = None, kind: str | None = None
    ) -> dict[str, Any]:
        """The answer (or, with kind, one event of its stream) holding these choices and, if given, the usage."""
        out = {
            "id": self.id,
            "object": kind or self.kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if usage is not None:
            out["usage"] = usage
        return out


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """OpenAI's usage object."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def finish(reason: str | None) -> str | None:
    """OpenAI's finish reasons; a cancelled or failed sequence reports what it has as "length"."""
    return reason if reason in (None, "stop", "length") else "length"


def sse(event: dict[str, Any], name: str | None = None) -> str:
    """One server-sent event (with an `event:` line when named, as the Responses API streams)."""
    head = f"event: {name}\n" if name else ""
    return f"{head}data: {json.dumps(event, ensure_ascii=False)}\n\n"


DONE = "data: [DONE]\n\n"


def sse_response(events: AsyncIterator[str]) -> StreamingResponse:
    """An event stream that proxies must not buffer or cache."""
    return StreamingResponse(
        events, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )


async def one_shot(event: dict[str, Any]) -> AsyncIterator[str]:
    """A stream of one event and the end mark."""
    yield sse(event)
    yield DONE
