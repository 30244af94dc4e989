"""GET /metrics: the server's counters and latency histograms in Prometheus' text format (version 0.0.4).

Names follow Prometheus' conventions (a `gptkit_` prefix, units in the name, `_total` on counters); docs/serve.md's
serving section lists them. The engine thread records tokens and latencies, an ASGI middleware records every
answered request by route and status, and the queue and cache figures are read when scraped.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections import Counter
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)  # seconds
# Routes counted under their own label; any other path (a 404 scan) is counted as "other", so that the number of
# series stays bounded whatever clients send.
ROUTES = (
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/responses",
    "/v1/embeddings",
    "/v1/models",
    "/health",
    "/metrics",
    "/props",
    "/tokenize",
    "/detokenize",
    "/tokenizer_info",
)


class Histogram:
    """Cumulative buckets, a sum and a count, as a Prometheus histogram reports them."""

    def __init__(self, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        self.buckets, self.counts, self.sum, self.count = buckets, [0] * len(buckets), 0.0, 0

    def observe(self, value: float) -> None:
        """Count one observation."""
        index = bisect.bisect_left(self.buckets, value)
        if index < len(self.counts):
            self.counts[index] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str) -> list[str]:
        """The histogram's sample lines."""
        out, running = [], 0
        for bound, count in zip(self.buckets, self.counts):
            running += count
            out.append(f'{name}_bucket{{le="{bound:g}"}} {running}')
        out += [f'{name}_bucket{{le="+Inf"}} {self.count}', f"{name}_sum {self.sum:.6f}", f"{name}_count {self.count}"]
        return out


class Metrics:
    """What /metrics reports; thread-safe (the engine thread and the event loop both record)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests: Counter[tuple[str, int]] = Counter()
        self.prompt_tokens = self.generation_tokens = self.sequences = 0
        self.time_to_first_token = Histogram()
        self.time_per_output_token = Histogram()
        self.request_latency = Histogram()
        self.started = time.time()

    def answered(self, route: str, status: int) -> None:
        """Count one answered HTTP request."""
        with self.lock:
            self.requests[(route if route in ROUTES else "other", status)] += 1

    def first_token(self, seconds: float) -> None:
        """A sequence's first token came `seconds` after it was queued."""
        with self.lock:
            self.time_to_first_token.observe(seconds)

    def sequence_done(self, prompt_tokens: int, completion_tokens: int, seconds: float, decode_seconds: float) -> None:
        """A sequence ended: its tokens, its time from queue to end, and its time after the first token."""
        with self.lock:
            self.sequences += 1
            self.prompt_tokens += prompt_tokens
            self.generation_tokens += completion_tokens
            self.request_latency.observe(seconds)
            if completion_tokens > 1:
                self.time_per_output_token.observe(decode_seconds / (completion_tokens - 1))

    def render(self, engine: dict[str, Any]) -> str:
        """The text a Prometheus scrape reads; engine: the engine's stats() now."""
        lines: list[str] = []

        def metric(name: str, kind: str, help_: str, samples: list[str]) -> None:
            lines.extend([f"# HELP {name} {help_}", f"# TYPE {name} {kind}", *samples])

        with self.lock:
            metric(
                "gptkit_requests_total",
                "counter",
                "HTTP requests answered, by route and status",
                [
                    f'gptkit_requests_total{{route="{route}",status="{status}"}} {count}'
                    for (route, status), count in sorted(self.requests.items())
                ],
            )
            metric(
                "gptkit_sequences_total",
                "counter",
                "sequences decoded to their end (one per choice)",
                [f"gptkit_sequences_total {self.sequences}"],
            )
            metric(
                "gptkit_prompt_tokens_total",
                "counter",
                "prompt tokens of finished sequences",
                [f"gptkit_prompt_tokens_total {self.prompt_tokens}"],
            )
            metric(
                "gptkit_generation_tokens_total",
                "counter",
                "tokens generated",
                [f"gptkit_generation_tokens_total {self.generation_tokens}"],
            )
            for name, histogram, help_ in (
                ("gptkit_time_to_first_token_seconds", self.time_to_first_token, "from queued to first token"),
                (
                    "gptkit_time_per_output_token_seconds",
                    self.time_per_output_token,
                    "mean gap between tokens after the first, per sequence",
                ),
                ("gptkit_request_latency_seconds", self.request_latency, "from queued to last token, per sequence"),
            ):
                metric(name, "histogram", help_, histogram.lines(name))
        metric(
            "gptkit_requests_running",
            "gauge",
            "sequences in the batch now",
            [f"gptkit_requests_running {engine['active']}"],
        )
        metric(
            "gptkit_requests_waiting",
            "gauge",
            "sequences queued for a batch row",
            [f"gptkit_requests_waiting {engine['waiting']}"],
        )
        metric(
            "gptkit_requests_cancelled_total",
            "counter",
            "sequences dropped because their client left",
            [f"gptkit_requests_cancelled_total {engine['cancelled']}"],
        )
        speculative = engine.get("speculative", {})
        for key, name, help_ in (
            ("draft_proposed", "draft_tokens", "tokens proposed for the model to check (prompt lookup)"),
            ("draft_accepted", "accepted_tokens", "proposed tokens the model's check accepted"),
            ("target_passes", "verify_passes", "forward passes that checked proposed tokens"),
        ):
            metric(
                f"gptkit_speculative_{name}_total",
                "counter",
                help_,
                [f"gptkit_speculative_{name}_total {speculative.get(key, 0)}"],
            )
        cache = engine.get("prefix_cache")
        if cache is not None:
            for key, help_ in (
                ("lookups", "prefills that consulted the prefix cache"),
                ("hits", "prefills that found a cached prefix"),
                ("hit_tokens", "prompt tokens not computed thanks to the prefix cache"),
                ("computed_tokens", "prompt tokens prefilled"),
            ):
                metric(
                    f"gptkit_prefix_cache_{key}_total",
                    "counter",
                    help_,
                    [f"gptkit_prefix_cache_{key}_total {cache[key]}"],
                )
        return "\n".join(lines) + "\n"


class RequestCounter:
    """ASGI middleware: counts each HTTP request by route and the status it was answered with."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.answered(scope["path"], message["status"])
            await send(message)

        await self.app(scope, receive, counted)
