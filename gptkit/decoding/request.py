"""One sequence being decoded: its prompt, rules, generator, tokens, text, log-probabilities and why it ended.

Every entry point decodes through Request: the batch engine feeds it one token at a time (accept), and readers
take what is new since their last look (take): text that is final (never a piece of a character, never the
start of what may become a stop string) and the log-probabilities of the tokens behind that text.

Returned ids never include the end-of-text token; at the id level the tokens up to the one completing a stop
string are kept, and the text is cut before the stop string.
"""

from __future__ import annotations

import logging
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor

from gptkit.decoding.grammar import Constraint
from gptkit.decoding.sampling import SamplingParams
from gptkit.errors import ConfigError, InputError

log = logging.getLogger("gptkit.decoding")

FinishReason = Literal["eos", "stop", "length"]
Decode = Callable[[Sequence[int]], str]
EosIds = int | Sequence[int] | None  # the token(s) that end a sequence: one id, several, or none


def end_ids(eos_id: EosIds) -> tuple[int, ...]:
    """eos_id as a tuple of ids (checked to be integers)."""
    ids = () if eos_id is None else (eos_id,) if isinstance(eos_id, numbers.Integral) else tuple(eos_id)
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, numbers.Integral):
            raise InputError(f"eos_id must be a token id or a list of them, got {eos_id!r}")
    return tuple(int(i) for i in ids)


def first_stop(text: str, stops: Sequence[str], start: int = 0) -> int:
    """Index of the earliest stop string in text (beginning at or after start), or -1."""
    hits = [i for i in (text.find(s, start) for s in stops) if i >= 0]
    return min(hits, default=-1)


def visible_end(text: str, stops: Sequence[str]) -> int:
    """How much of unfinished text may be shown: not an incomplete UTF-8 character (a trailing U+FFFD), nor a
    tail that a stop string might begin with."""
    end = len(text.rstrip("\ufffd"))
    hold = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, end), hold, -1):
            if text.startswith(stop[:size], end - size):
                hold = size
                break
    return end - hold


def seeded(device: torch.device, seed: int | None) -> torch.Generator:
    """A generator on device: seeded, or from the system's entropy when seed is None."""
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


@dataclass
class TokenLogprob:
    """A generated token's log-probability under the model and the most likely alternatives (id, logprob)."""

    id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class Delta:
    """What a request produced since the last take(): final text, the tokens behind it, and its end if it ended."""

    text: str
    tokens: list[TokenLogprob]
    finish_reason: FinishReason | None


@dataclass(eq=False)
class Request:
    """One sequence to decode; the batch engine sets generator (from seed) and position when it admits it."""

    prompt: list[int]
    params: SamplingParams
    eos_ids: tuple[int, ...] = ()
    decode: Decode | None = None  # needed for stop strings and for take()
    seed: int | None = None
    top_logprobs: int | None = None  # None: no log-probabilities; k: the chosen token's and the k most likely
    constraint: Constraint | None = None  # a grammar the output must follow (structured outputs)
    adapter: int = 0  # which of the model's served LoRA adapters decodes it (gptkit.multi_lora; 0: the base)
    adapter_name: str = ""  # what keeps its prefix-cache blocks apart from another adapter's
    lookup_k: int = 0  # tokens a prompt lookup may propose per pass (gptkit.decoding.lookup; 0: no lookup)
    lookup_ngram: int = 0  # the longest match that lookup looks for
    generated: list[int] = field(default_factory=list)  # the new tokens (never the end-of-text token)
    finish_reason: FinishReason | None = None
    end_id: int | None = None  # the end-of-text id that ended it (None: it ended otherwise, or a grammar ended it)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per sampled token (the end token's included)
    generator: torch.Generator | None = None
    seen: Tensor | None = None  # (V,) tokens of prompt and output, kept only for a repetition penalty
    counts: Tensor | None = None  # (V,) how often each token was generated, kept only for OpenAI's penalties
    position: int = 0  # cache position the next fed token (tokens[-1]) is written at
    _text: str = ""  # the decoded output, cut before a stop string (valid for _text_len tokens)
    _text_len: int = -1
    _stop_at: int = -1  # where the first stop string begins in the decoded output (-1: none yet)
    _sent: int = 0  # characters take() has returned
    _sent_logprobs: int = 0  # log-probabilities take() has returned

    def __post_init__(self) -> None:
        if self.params.stop and self.decode is None:
            raise ConfigError("stop strings need a decode function (a tokenizer) to find them in the output")

    @property
    def tokens(self) -> list[int]:
        """The prompt, then every generated token."""
        return self.prompt + self.generated

    @property
    def last_token(self) -> int:
        """The token the next decode step feeds."""
        return self.generated[-1] if self.generated else self.prompt[-1]

    @property
    def done(self) -> bool:
        """Whether the request has finished."""
        return self.finish_reason is not None

    @property
    def plain_greedy(self) -> bool:
        """Whether its next token is the bare argmax of the logits (no penalty, grammar or log-probabilities)."""
        return (
            self.params.greedy
            and self.constraint is None
            and self.top_logprobs is None
            and self.params.repetition_penalty in (None, 1.0)
            and not self.params.reshapes_logits
        )

    def accept(self, token: int, logprob: TokenLogprob | None = None) -> None:
        """Record the next token: end at an end-of-text token, a stop string, a complete structured output or
        max_new_tokens."""
        if logprob is not None:
            self.logprobs.append(logprob)
        if token in self.eos_ids:
            self.finish_reason, self.end_id = "eos", token
            return
        self.generated.append(token)
        if self.seen is not None:
            self.seen[token] = True
        if self.counts is not None:
            self.counts[token] += 1
        if self.constraint is not None:
            self.constraint.advance(token)
        if self.params.stop and self._stopped():
            self.finish_reason = "stop"
        elif self.constraint is not None and self.constraint.complete:
            self.finish_reason = "eos"  # the JSON is whole: nothing but the end-of-text token may follow
        elif self.constraint is not None and not self.constraint.can_continue:
            log.warning("structured output cut short: no token of this tokenizer can continue it validly")
            self.finish_reason = "length"  # unfinished, as when max_new_tokens runs out
        elif len(self.generated) >= self.params.max_new_tokens:
            self.finish_reason = "length"

    def finish(self, reason: FinishReason) -> None:
        """End the request early (its context is full)."""
        self.finish_reason = reason

    def text_so_far(self) -> str:
        """The decoded output, cut before the first stop string (decoded once per new token)."""
        if self._text_len != len(self.generated):
            if self.decode is None:
                raise ConfigError("the request's text needs a decode function (a tokenizer)")
            text = self.decode(self.generated)
            self._stop_at = self._stop_index(text) if self.params.stop else -1
            self._text = text if self._stop_at < 0 else text[: self._stop_at]
            self._text_len = len(self.generated)
        return self._text

    def _stopped(self) -> bool:
        self.text_so_far()
        return self._stop_at >= 0

    def _stop_index(self, text: str) -> int:
        # A stop string found before cannot move: search only from where a new one could begin.
        longest = max((len(s) for s in self.params.stop), default=0)
        return first_stop(text, self.params.stop, max(self._sent - longest, 0))

    def take(self) -> Delta:
        """The text that became final since the last take, the log-probabilities of its tokens, and the end."""
        text = self.text_so_far()
        end = len(text) if self.done else visible_end(text, self.params.stop)
        new = text[self._sent : max(end, self._sent)]
        self._sent = max(end, self._sent)
        count = self._tokens_sent(text) if self.top_logprobs is not None else 0
        tokens = self.logprobs[self._sent_logprobs : max(count, self._sent_logprobs)]
        self._sent_logprobs = max(count, self._sent_logprobs)
        return Delta(new, tokens, self.finish_reason)

    def _tokens_sent(self, text: str) -> int:
        """How many leading tokens' text has all been sent (all of them once done, but for those past a stop)."""
        ids = self.generated
        if self.finish_reason == "stop":  # the fewest tokens that reach the stop string
            count = len(ids)
            while count > 0 and len(self.decode(ids[: count - 1])) >= len(text):
                count -= 1
            return count
        if self.done:
            return len(self.logprobs)  # the end-of-text token's log-probability too
        count, length = len(ids), len(text)
        while count > 0 and length > self._sent:
            count -= 1
            length = len(self.decode(ids[:count]))
        return count
