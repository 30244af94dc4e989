"""Continuous batching: one thread decodes every active request together, one token per step.

A request joins the running batch at the next step (its prompt is prefilled into a free row of one shared
KVCache) and leaves it the step it finishes or is cancelled. Active requests always occupy rows 0..k-1 of the
cache: when a row frees up, the last active row's keys and values are moved into it, so each decode step runs
the model on exactly k rows and attends over only the positions in use.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import Tensor

from gptkit.errors import GptkitError
from gptkit.generation import decode_one_token, prefill, visible_end
from gptkit.kv_cache import KVCache
from gptkit.model import GPT
from gptkit.sampling import SamplingParams, sample

log = logging.getLogger("gptkit.serve")


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


@dataclass(eq=False)
class Sequence:
    """One request being generated: its prompt, decoding rules, progress and where its output goes."""

    prompt: list[int]
    params: SamplingParams
    emit: Callable[[Chunk], None]
    top_logprobs: int | None = None  # None: no logprobs; k: the chosen token's and the k most likely
    generated: list[int] = field(default_factory=list)
    sent: int = 0  # characters of the decoded output already emitted
    pending: list[TokenInfo] = field(default_factory=list)
    cancelled: bool = False
    generator: torch.Generator | None = None
    seen: Tensor | None = None  # (1, V) tokens in prompt or output, for the repetition penalty

    @property
    def position(self) -> int:
        """Cache position of the last generated token, the one the next decode step feeds."""
        return len(self.prompt) + len(self.generated) - 1


def _row_view(cache: KVCache, rows: slice, length: int) -> KVCache:
    """A KVCache sharing cache's storage, restricted to some rows and the first length positions."""
    view = KVCache.__new__(KVCache)
    view.keys = [k[rows, :, :length] for k in cache.keys]
    view.values = [v[rows, :, :length] for v in cache.values]
    return view


class Engine:
    """Owns the model and one KVCache of max_batch_size rows; a background thread runs the decode loop."""

    def __init__(self, model: GPT, tokenizer: Any, max_batch_size: int = 8, max_queue: int = 64) -> None:
        if max_batch_size < 1:
            raise GptkitError(f"--max-batch-size must be >= 1, got {max_batch_size}")
        if max_queue < 0:
            raise GptkitError(f"--max-queue must be >= 0, got {max_queue}")
        self.model, self.tokenizer = model.eval(), tokenizer
        self.max_batch_size, self.max_queue = max_batch_size, max_queue
        self.block_size = model.config.block_size
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.cache = KVCache(model.config, max_batch_size, self.block_size, device=self.device, dtype=self.dtype)
        self.active: list[Sequence] = []  # row i of the cache belongs to active[i]
        self.waiting: deque[Sequence] = deque()
        self.jobs: deque[tuple[Callable[[], Any], concurrent.futures.Future]] = deque()
        self.wakeup = threading.Condition()
        self.running = False
        self.thread: threading.Thread | None = None
        self.steps = 0  # decode steps run, for tests and stats
        self.max_rows_seen = 0  # the largest batch one decode step ran
        self.cancelled = 0  # requests dropped because their client went away

    # ----- called from other threads -----

    def start(self) -> None:
        """Start the decode loop in a daemon thread."""
        self.running = True
        self.thread = threading.Thread(target=self._loop, name="gptkit-engine", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        """Finish the decode loop; waiting and active requests end with finish_reason "cancelled"."""
        with self.wakeup:
            self.running = False
            self.wakeup.notify()
        if self.thread is not None:
            self.thread.join(timeout=10)

    def submit(self, sequences: list[Sequence]) -> None:
        """Queue sequences (all or none); raise QueueFull when the queue cannot take them all."""
        for seq in sequences:
            if seq.params.seed is not None:
                seq.generator = torch.Generator(self.device).manual_seed(seq.params.seed)
        with self.wakeup:
            free_rows = self.max_batch_size - len(self.active)
            if len(self.waiting) + len(sequences) > self.max_queue + max(free_rows, 0):
                raise QueueFull(f"the server is busy ({len(self.waiting)} requests queued); retry shortly")
            self.waiting.extend(sequences)
            self.wakeup.notify()

    def cancel(self, sequences: list[Sequence]) -> None:
        """Free these requests' rows at the next step (a client went away)."""
        with self.wakeup:
            for seq in sequences:
                seq.cancelled = True
            self.wakeup.notify()

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run fn on the engine thread between two steps (the model is never used by two threads at once)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self.wakeup:
            self.jobs.append((fn, future))
            self.wakeup.notify()
        return future

    def stats(self) -> dict[str, int]:
        """Rows in use, requests waiting and decode steps run so far."""
        return {"active": len(self.active), "waiting": len(self.waiting), "steps": self.steps,
                "cancelled": self.cancelled, "max_batch_size": self.max_batch_size}  # fmt: skip

    # ----- the engine thread -----

    def _loop(self) -> None:
        with torch.inference_mode():
            while True:
                with self.wakeup:
                    while self.running and not (self.waiting or self.active or self.jobs):
                        self.wakeup.wait()
                    if not self.running:
                        break
                    jobs = list(self.jobs)
                    self.jobs.clear()
                for fn, future in jobs:
                    self._run_job(fn, future)
                try:
                    self._step()
                except Exception:  # keep serving: fail the requests in flight, not the server
                    log.exception("decode step failed")
                    for seq in self.active:
                        seq.emit(Chunk("", [], "error", len(seq.prompt), len(seq.generated)))
                    self.active.clear()
        for seq in self.active + list(self.waiting):
            seq.emit(Chunk("", [], "cancelled", len(seq.prompt), len(seq.generated)))
        self.active.clear()
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
            future.set_result(fn())
        except Exception as err:  # handed to the caller, who turns it into an HTTP error
            future.set_exception(err)

    def _step(self) -> None:
        """Drop cancelled requests, admit waiting ones into free rows, then decode one token for every row."""
        for row in reversed(range(len(self.active))):
            if self.active[row].cancelled:
                self.cancelled += 1
                self._release(row)
        while len(self.active) < self.max_batch_size:
            with self.wakeup:
                if not self.waiting:
                    break
                seq = self.waiting.popleft()
            if seq.cancelled:
                self.cancelled += 1
                continue
            try:
                self._prefill(seq)
            except Exception:  # this request fails alone; the rows already decoding carry on
                log.exception("prefill failed")
                if self.active and self.active[-1] is seq:
                    self.active.pop()
                seq.emit(Chunk("", [], "error", len(seq.prompt), len(seq.generated)))
        if self.active:
            self._decode()

    def _prefill(self, seq: Sequence) -> None:
        """Run seq's prompt into the next free row and choose its first token."""
        row = len(self.active)
        ids = torch.tensor([seq.prompt], device=self.device)
        view = _row_view(self.cache, slice(row, row + 1), len(seq.prompt))
        logits = prefill(self.model, ids, view, torch.tensor([len(seq.prompt)], device=self.device))
        self.active.append(seq)
        seq.seen = torch.zeros(1, self.model.config.vocab_size, dtype=torch.bool, device=self.device)
        seq.seen[0, ids[0]] = True
        self._advance([seq], logits)

    def _decode(self) -> None:
        """One token for every active row, in one forward pass over rows 0..k-1."""
        k = len(self.active)
        self.max_rows_seen = max(self.max_rows_seen, k)
        positions = torch.tensor([seq.position for seq in self.active], device=self.device)
        last = torch.tensor([[seq.generated[-1]] for seq in self.active], device=self.device)
        view = _row_view(self.cache, slice(0, k), int(positions.max()) + 1)
        logits = decode_one_token(self.model, last, view, positions)
        self.steps += 1
        self._advance(list(self.active), logits)

    def _advance(self, sequences: list[Sequence], logits: Tensor) -> None:
        """Choose each sequence's next token from its logits row, emit new text, retire finished rows."""
        logits = logits.float()
        want_logprobs = any(seq.top_logprobs is not None for seq in sequences)
        logprobs = logits.log_softmax(dim=-1) if want_logprobs else None
        finished = []
        for i, seq in enumerate(sequences):
            token = int(sample(logits[i : i + 1], seq.generator, seq.params, seq.seen)[0])
            seq.generated.append(token)
            seq.seen[0, token] = True
            if seq.top_logprobs is not None:
                seq.pending.append(self._token_info(token, logprobs[i], seq.top_logprobs))
            reason = self._emit_progress(seq)
            if reason is not None:
                finished.append(seq)
        for seq in finished:
            self._release(self.active.index(seq))

    def _token_info(self, token: int, logprobs: Tensor, top: int) -> TokenInfo:
        """The token's text and log-probability, with the top most likely alternatives."""
        alternatives = []
        if top > 0:
            values, ids = logprobs.topk(min(top, logprobs.numel()))
            alternatives = [self._info(int(t), float(v)) for v, t in zip(values, ids)]
        return self._info(token, float(logprobs[token]), alternatives)

    def _info(self, token: int, logprob: float | None, top: list[TokenInfo] | None = None) -> TokenInfo:
        return TokenInfo(token, self.tokenizer.decode([token]), self.tokenizer.token_bytes(token), logprob, top or [])

    def _emit_progress(self, seq: Sequence) -> str | None:
        """Send seq's new text (holding back what might start a stop string); return its finish reason, if any."""
        hit_eos = seq.generated[-1] in self.tokenizer.eos_ids
        ids = seq.generated[:-1] if hit_eos else seq.generated
        text = self.tokenizer.decode(ids)
        reason = "stop" if hit_eos else None
        cut = min((i for i in (text.find(s, max(seq.sent - len(s), 0)) for s in seq.params.stop) if i >= 0),
                  default=-1)  # fmt: skip
        if cut >= 0:
            text, reason = text[:cut], "stop"
        if reason is None and len(seq.generated) >= seq.params.max_new_tokens:
            reason = "length"
        if reason is None and len(seq.prompt) + len(seq.generated) >= self.block_size:
            reason = "length"  # the context is full (only reachable when max_new_tokens was not checked)
        end = len(text) if reason else visible_end(text, seq.params.stop)
        if end > seq.sent or reason:
            new = text[seq.sent : max(end, seq.sent)]
            seq.sent = max(end, seq.sent)
            tokens = self._pending_tokens(seq, ids, len(text), cut, reason)
            seq.emit(Chunk(new, tokens, reason, len(seq.prompt), len(seq.generated)))
        return reason

    def _pending_tokens(self, seq: Sequence, ids: list[int], text_len: int, cut: int,
                        reason: str | None) -> list[TokenInfo]:  # fmt: skip
        """Take the logprobs of the tokens whose text has been sent: they hold back and drop the text of a stop
        string as the text does (a finishing sequence sends them all, but for those past a stop string's start).

        text_len is the length of ids' text, which the caller has decoded already."""
        if not seq.pending:
            return []
        if reason is None:  # the most tokens whose text is all sent
            count, length = len(ids), text_len
            while count > 0 and length > seq.sent:
                count -= 1
                length = len(self.tokenizer.decode(ids[:count]))
        elif cut >= 0:  # the fewest tokens that reach the stop string
            count = len(ids)
            while count > 0 and len(self.tokenizer.decode(ids[: count - 1])) >= cut:
                count -= 1
        else:
            count = len(seq.generated)
        take = max(count - (len(seq.generated) - len(seq.pending)), 0)  # pending[0] is generated[-len(pending)]
        tokens, seq.pending = seq.pending[:take], seq.pending[take:]
        return tokens

    def _release(self, row: int) -> None:
        """Free a row; the last active row moves into it so that rows 0..k-1 stay in use."""
        last = len(self.active) - 1
        if row != last:
            moved = self.active[last]
            length = moved.position + 1
            for tensors in (self.cache.keys, self.cache.values):
                for t in tensors:
                    t[row, :, :length] = t[last, :, :length]
            self.active[row] = moved
        self.active.pop()

    # ----- jobs run through call() -----

    def score(self, prompt: list[int], top: int) -> list[TokenInfo]:
        """Each prompt token with its log-probability given the tokens before it (None for the first)."""
        ids = torch.tensor([prompt], device=self.device)
        logprobs = self.model(ids)[0].float().log_softmax(dim=-1)  # (T, V): row t predicts token t+1
        infos = [self._info(prompt[0], None)]
        for t in range(1, len(prompt)):
            infos.append(self._token_info(prompt[t], logprobs[t - 1], top))
        return infos
