"""The server's decoding thread: a queue of requests in front of the batch engine (gptkit.decoding.batch).

Requests wait in a queue; between two decode steps the thread admits as many as the batch has free rows (their
prompts prefilled together), runs one step for every request in the batch, and sends each request's new text and
log-probabilities to its caller as a Chunk. A request leaves the batch the step it finishes or is cancelled. All
decoding, context handling and text hold-back is the batch engine's and the request's, as in `gptkit generate`.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch

from gptkit.accounting import DTYPE_BYTES, kv_cache_bytes
from gptkit.decoding.batch import BatchEngine
from gptkit.decoding.lookup import Lookup
from gptkit.decoding.prefix_cache import PrefixCache, available_memory
from gptkit.decoding.request import Request, TokenLogprob
from gptkit.errors import GptkitError
from gptkit.model import GPT
from gptkit.multi_lora import rows_using
from gptkit.tokenizer import Tokenizer

if TYPE_CHECKING:
    from gptkit.serving.metrics import Metrics
    from gptkit.serving.threads import ThreadGovernor

log = logging.getLogger("gptkit.serve")
CONTEXT_BLOCKS = 4  # default longest request, in block_size units (a learned-position window slides past one)
# The default batch, measured (`benchmarks/bench_serve.py --n-layer 12 --n-embd 768 --block-size 1024
# --max-batch-sizes 8,16,32 --concurrency 1 8 32`, 2-core AVX2 EPYC, docs/benchmarks.md): 32 rows served 32 clients
# 1.23x as fast as 8 rows (156.7 against 127.7 tokens/s) and 1 or 8 clients no slower. Its KV cache is allocated up
# front, so the default halves while 32 rows' cache would take more than a quarter of the memory free at start-up,
# down to the former default of 8 rows.
DEFAULT_MAX_BATCH, SMALLEST_DEFAULT_BATCH = 32, 8
DEFAULT_BATCH_MEMORY_SHARE = 0.25


def default_max_batch(model: GPT, length: int, kv_dtype: torch.dtype | None) -> int:
    """The batch rows a server decodes together when not told: DEFAULT_MAX_BATCH, fewer where their cache of length
    positions a row would not fit DEFAULT_BATCH_MEMORY_SHARE of the memory free now (never under 8)."""
    dtype = str(kv_dtype or next(model.parameters()).dtype).removeprefix("torch.")
    per_row = kv_cache_bytes(model.config, 1, length, dtype if dtype in DTYPE_BYTES else "float32")
    device = next(model.parameters()).device
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else available_memory()
    rows = DEFAULT_MAX_BATCH
    while rows > SMALLEST_DEFAULT_BATCH and rows * per_row > DEFAULT_BATCH_MEMORY_SHARE * free:
        rows //= 2
    return rows


class QueueFull(GptkitError):
    """More requests are waiting than the queue holds; the client should retry later."""


@dataclass
class TokenInfo:
    """One generated (or scored) token with its log-probability under the model and the most likely others."""

    id: int
    text: str
    data: bytes  # the token's own bytes: its text may be U+FFFD where it holds part of a character
    logprob: float | None
    top: list[TokenInfo] = field(default_factory=list)  # the alternatives, most likely first


@dataclass
class Chunk:
    """What one request produced since its last chunk; finish_reason is set on its last chunk only."""

    text: str
    tokens: list[TokenInfo]
    finish_reason: str | None = None  # "stop", "length", "cancelled" or "error"
    prompt_tokens: int = 0
    completion_tokens: int = 0


Emit = Callable[[Chunk], None]
_FINISH = {"eos": "stop", "stop": "stop", "length": "length"}  # OpenAI's names


class Engine:
    """Owns the model and its batch engine; a background thread admits queued requests and steps the batch."""

    def __init__(
        self,
        model: GPT,
        tokenizer: Tokenizer,
        max_batch_size: int | None = None,
        max_queue: int = 64,
        compile: bool = False,
        max_context: int | None = None,
        kv_dtype: torch.dtype | None = None,
        prefix_cache: PrefixCache | None = None,
        lookup: Lookup | None = None,
        lookup_by_default: bool = False,
    ) -> None:
        """max_batch_size: rows decoded together (None: default_max_batch); lookup: the prompt lookup requests
        speculate with (its k the most they may ask for); lookup_by_default: whether requests that do not say
        speculate."""
        if max_batch_size is not None and max_batch_size < 1:
            raise GptkitError(f"--max-batch-size must be >= 1, got {max_batch_size}")
        if max_queue < 0:
            raise GptkitError(f"--max-queue must be >= 0, got {max_queue}")
        block_size = model.config.block_size
        if max_context is not None and max_context < 1:
            raise GptkitError(f"--max-context must be >= 1, got {max_context}")
        self.model, self.tokenizer = model.eval(), tokenizer
        self.max_context = max_context or CONTEXT_BLOCKS * block_size
        # Compiled: the whole context up front, so that the shapes compiled at start-up are the only ones.
        length = self.max_context if compile else min(block_size, self.max_context)
        max_batch_size = max_batch_size or default_max_batch(self.model, length, kv_dtype)
        self.max_batch_size, self.max_queue = max_batch_size, max_queue
        self.lookup, self.lookup_by_default = lookup or Lookup(), lookup_by_default
        # A request may ask for lookup whatever the default, up to lookup_k tokens a pass; but a sliding-window model
        # keeps spare ring slots for it, which its fused step cannot read: there only when the server was asked to.
        windowed = any(model.config.layer_window(i) for i in range(model.config.n_layer))
        self.lookup_k = 0 if windowed and not lookup_by_default else self.lookup.k
        self.batch = BatchEngine(
            self.model,
            max_batch_size,
            length,
            compile=compile,
            max_context=self.max_context,
            buckets=True,
            kv_dtype=kv_dtype,
            prefix_cache=prefix_cache,
            lookup_k=self.lookup_k,
        )
        self.emits: dict[Request, Emit] = {}
        self.at_end: set[Request] = set()  # requests whose caller wants one chunk, at the end
        self.waiting: deque[Request] = deque()
        self.to_cancel: set[Request] = set()
        self.jobs: deque[tuple[Callable[[], Any], concurrent.futures.Future]] = deque()
        self.wakeup = threading.Condition()
        self.running = False
        self.thread: threading.Thread | None = None
        self.cancelled = 0  # requests dropped because their client went away
        self.metrics: Metrics | None = None  # where latencies and token counts go (the server's /metrics)
        self.queued_at: dict[Request, float] = {}  # time.monotonic() when each request was submitted
        self.first_token_at: dict[Request, float] = {}
        # Set by `gptkit serve` without --threads: the decode threads follow the cores other programs leave free.
        self.governor: ThreadGovernor | None = None

    @property
    def active(self) -> list[Request]:
        """The requests in the batch now."""
        return self.batch.rows

    @property
    def steps(self) -> int:
        """Decode steps run so far."""
        return self.batch.steps

    @property
    def max_rows_seen(self) -> int:
        """The largest batch one decode step ran."""
        return self.batch.max_rows_seen

    @max_rows_seen.setter
    def max_rows_seen(self, value: int) -> None:
        self.batch.max_rows_seen = value

    def warm_up(self) -> float:
        """Compile (when compiled) and run the decode step of every batch shape; returns the seconds taken."""
        return self.batch.warm_up()

    # ----- called from other threads -----

    def start(self) -> None:
        """Run the decode loop in a daemon thread of its own, unless it runs already (see run)."""
        with self.wakeup:
            if self.running:
                return
            self.running = True
            self.thread = threading.Thread(target=self._loop, name="gptkit-engine", daemon=True)
        self.thread.start()

    def run(self, ready: Callable[[], None] = lambda: None) -> None:
        """Run the decode loop in the calling thread until stop(); ready() is called once it counts as started.

        `gptkit serve` runs it on the thread that loaded the model, so that one thread does all the model's work:
        each thread that runs OpenMP code keeps a pool of OpenMP threads, and once a process holds more of them than
        it has cores, libgomp's barriers stop spinning and sleep, which cost a third of the fused step's speed (GPT-2
        small, 2-core EPYC: 70 tokens/s from one thread, 53 from a second one)."""
        with self.wakeup:
            if self.running:
                raise GptkitError("the engine's decode loop runs already")
            self.running, self.thread = True, threading.current_thread()
        ready()
        self._loop()

    def stop(self) -> None:
        """Finish the decode loop; waiting and active requests end with finish_reason "cancelled"."""
        with self.wakeup:
            self.running = False
            self.wakeup.notify()
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(timeout=10)
        if self.batch.prefix_cache is not None:
            self.batch.prefix_cache.close()

    def submit(self, requests: list[tuple[Request, Emit]], stream: bool = True) -> None:
        """Queue requests with where their chunks go (all or none); raise QueueFull when the queue is full.
        stream=False sends each request's chunk once, when it ends: no text is decoded or handed over per token."""
        with self.wakeup:
            free_rows = self.max_batch_size - len(self.active)
            if len(self.waiting) + len(requests) > self.max_queue + max(free_rows, 0):
                raise QueueFull(f"the server is busy ({len(self.waiting)} requests queued); retry shortly")
            now = time.monotonic()
            for request, emit in requests:
                self.emits[request] = emit
                self.queued_at[request] = now
                self.waiting.append(request)
                if not stream:
                    self.at_end.add(request)
            self.wakeup.notify()

    def cancel(self, requests: list[Request]) -> None:
        """Free these requests' rows at the next step (a client went away); finished ones are ignored."""
        with self.wakeup:
            self.to_cancel.update(r for r in requests if r in self.emits)
            self.wakeup.notify()

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run fn on the engine thread between two steps (the model is never used by two threads at once)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self.wakeup:
            self.jobs.append((fn, future))
            self.wakeup.notify()
        return future

    def uses_adapter(self, index: int) -> bool:
        """Whether a request decoding or waiting uses LoRA adapter number `index`."""
        with self.wakeup:
            return any(request.adapter == index for request in [*self.active, *self.waiting])

    def stats(self) -> dict[str, Any]:
        """Rows in use, requests waiting, decode steps run so far and what the prefix cache holds and has saved."""
        stats: dict[str, Any] = {
            "active": len(self.active),
            "waiting": len(self.waiting),
            "steps": self.steps,
            "cancelled": self.cancelled,
            "max_batch_size": self.max_batch_size,
            "speculative": self.batch.speculative.to_dict(),
        }
        if self.batch.prefix_cache is not None:
            stats["prefix_cache"] = self.batch.prefix_cache.report()
        return stats

    # ----- the engine thread -----

    def _loop(self) -> None:
        while True:
            with self.wakeup:
                waited = False
                while self.running and not (self.waiting or self.active or self.jobs):
                    waited = True
                    self.wakeup.wait()
                if not self.running:
                    break
                jobs = list(self.jobs)
                self.jobs.clear()
            for fn, future in jobs:
                self._run_job(fn, future)
            if self.governor is not None:
                if waited:
                    self.governor.resume()
                self.governor.adjust()
            self._step()
        for request in self.active + list(self.waiting):
            self._end(request, "cancelled")
        self.waiting.clear()
        with self.wakeup:
            for _, future in self.jobs:
                future.cancel()
            self.jobs.clear()

    @staticmethod
    def _run_job(fn: Callable[[], Any], future: concurrent.futures.Future) -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            with torch.no_grad():
                future.set_result(fn())
        except Exception as err:  # handed to the caller, who turns it into an HTTP error
            future.set_exception(err)

    def _step(self) -> None:
        """Drop cancelled requests, admit waiting ones into free rows, then decode one token for every row."""
        with self.wakeup:
            cancelled, self.to_cancel = self.to_cancel, set()
            admitted = []
            while self.waiting and len(admitted) < self.batch.free_rows + len(cancelled & set(self.active)):
                request = self.waiting.popleft()
                if request in cancelled:
                    self.cancelled += 1
                    self._forget(request)
                    continue
                admitted.append(request)
        for request in cancelled & set(self.active):
            self.batch.cancel(request)
            self.cancelled += 1
            self._forget(request)
        if admitted:
            try:
                self._send(self.batch.add(admitted) + admitted)
            except Exception:  # these requests fail alone; the rows already decoding carry on
                log.exception("prefill failed")
                for request in admitted:
                    self.batch.cancel(request)
                    self._end(request, "error")
        if self.active:
            try:
                self._decode()
            except Exception:  # keep serving: fail the requests in flight, not the server
                log.exception("decode step failed")
                for request in list(self.active):
                    self.batch.cancel(request)
                    self._end(request, "error")

    def _decode(self) -> None:
        """One token for every request in the batch; send what each produced."""
        rows = list(self.active)
        finished = self.batch.step()
        self._send(rows + [r for r in finished if r not in rows])

    def _send(self, requests: list[Request]) -> None:
        """Emit each request's new text and log-probabilities (once per request; finished ones for the last time)."""
        for request in dict.fromkeys(requests):
            if request not in self.emits:
                continue
            self._time(request)
            if request in self.at_end and not request.done:
                continue
            delta = request.take()
            if delta.text or delta.tokens or delta.finish_reason:
                tokens = [self._token_info(t) for t in delta.tokens]
                reason = _FINISH[delta.finish_reason] if delta.finish_reason else None
                self.emits[request](Chunk(delta.text, tokens, reason, len(request.prompt), _count(request)))
            if request.done:
                self._forget(request)

    def _time(self, request: Request) -> None:
        """Record a request's first-token and end times for the metrics."""
        if self.metrics is None or request not in self.queued_at:
            return
        now = time.monotonic()
        if request.generated and request not in self.first_token_at:
            self.first_token_at[request] = now
            self.metrics.first_token(now - self.queued_at[request])
        if request.done:
            first = self.first_token_at.get(request, now)
            self.metrics.sequence_done(len(request.prompt), _count(request), now - self.queued_at[request], now - first)

    def _end(self, request: Request, reason: str) -> None:
        """Tell a request's caller that it ended without finishing ("cancelled" or "error")."""
        emit = self._forget(request)
        if emit is not None:
            emit(Chunk("", [], reason, len(request.prompt), _count(request)))

    def _forget(self, request: Request) -> Emit | None:
        """Drop what the engine keeps for a request's caller; returns where its chunks went."""
        self.at_end.discard(request)
        self.queued_at.pop(request, None)
        self.first_token_at.pop(request, None)
        return self.emits.pop(request, None)

    def _token_info(self, token: TokenLogprob) -> TokenInfo:
        return self._info(token.id, token.logprob, [self._info(i, v) for i, v in token.top])

    def _info(self, token: int, logprob: float | None, top: list[TokenInfo] | None = None) -> TokenInfo:
        return TokenInfo(token, self.tokenizer.decode([token]), self.tokenizer.token_bytes(token), logprob, top or [])

    @property
    def scoring_context(self) -> int:
        """The model's context as clients must respect it: block_size for learned positions (a generation slides
        its window past it, a score cannot: score() takes one token more, whose prediction it never needs),
        else the request limit."""
        if self.model.config.position == "learned":
            return min(self.model.config.block_size, self.max_context)
        return self.max_context

    # ----- jobs run through call() -----

    def score(self, prompt: list[int], top: int, adapter: int = 0) -> list[TokenInfo]:
        """Each prompt token with its log-probability given the tokens before it (None for the first).

        The last token is scored but never read, so a prompt one token longer than the model's context scores
        whole (as Hugging Face models score a window: lm-evaluation-harness's `hf` backend)."""
        infos = [self._info(prompt[0], None)]
        if len(prompt) < 2:
            return infos
        ids = torch.tensor([prompt[:-1]], device=self.batch.device)
        with rows_using(self.model, [adapter]):
            logprobs = self.model(ids)[0].float().log_softmax(dim=-1)  # (T - 1, V): row t predicts token t+1
        for t in range(1, len(prompt)):
            values, alternatives = logprobs[t - 1].topk(min(top, logprobs.size(-1))) if top > 0 else ([], [])
            top_infos = [self._info(int(i), float(v)) for v, i in zip(values, alternatives)]
            infos.append(self._info(prompt[t], float(logprobs[t - 1, prompt[t]]), top_infos))
        return infos


def _count(request: Request) -> int:
    """Completion tokens as OpenAI counts them: the end-of-text token too."""
    return len(request.generated) + (request.finish_reason == "eos")
