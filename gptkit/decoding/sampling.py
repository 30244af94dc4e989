"""Decoding rules: their parameters (SamplingParams) and pure logits filters with Hugging Face's semantics.

Every filter maps logits (B, V) to logits (B, V) with the removed tokens set to -inf. They run in the order
Hugging Face's `generate` applies them: repetition penalty, temperature, top-k, top-p, min-p.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor

from gptkit.decoding.grammar import SchemaError, read_schema_file, schema_text
from gptkit.errors import ConfigError

EarlyStopping = Literal[True, False, "never"]
SEED_LIMIT = 2**64  # torch.Generator seeds are unsigned 64-bit; the seeds derived for rows wrap around here
_EARLY_STOPPING: dict[str, EarlyStopping] = {"true": True, "false": False, "never": "never"}
# Below this temperature decoding is greedy (vLLM's _SAMPLING_EPS): dividing logits by less overflows to inf.
GREEDY_BELOW = 1e-5
# Penalties outside this range overflow a logit or already make every seen token certain or impossible.
REPETITION_PENALTY_RANGE = (1e-2, 1e2)
PRESENCE_FREQUENCY_RANGE = (-2.0, 2.0)  # OpenAI's range for presence_penalty and frequency_penalty
LOGIT_BIAS_RANGE = (-100.0, 100.0)  # OpenAI's: -100 bans a token, 100 makes it all but certain


def parse_logit_bias(text: str) -> tuple[int, float]:
    """A (token id, bias) pair as a flag spells it: ID=BIAS."""
    token, sep, bias = text.partition("=")
    try:
        if not sep:
            raise ValueError
        return int(token), float(bias)
    except ValueError:
        raise ValueError(f"logit bias must be TOKEN_ID=BIAS (e.g. 50256=-100), got {text!r}") from None


def parse_early_stopping(text: str) -> EarlyStopping:
    """The early_stopping value a flag spells true, false or never."""
    try:
        return _EARLY_STOPPING[text.lower()]
    except KeyError:
        raise ValueError(f"early_stopping must be true, false or never, got {text!r}") from None


@dataclass(frozen=True)
class SamplingParams:
    """Every decoding parameter of one request; the defaults here are the only ones (CLI and server read them)."""

    max_new_tokens: int = field(default=128, metadata={"help": "tokens to generate at most"})
    temperature: float = field(
        default=1.0, metadata={"help": f"softmax temperature; 0 (or below {GREEDY_BELOW:g}) means greedy (argmax)"}
    )
    top_k: int | None = field(default=None, metadata={"help": "sample only from the k most likely tokens"})
    top_p: float | None = field(
        default=None, metadata={"help": "nucleus sampling: smallest set of tokens whose mass reaches p, in (0, 1]"}
    )
    min_p: float | None = field(
        default=None, metadata={"help": "drop tokens less likely than min_p times the top token's probability"}
    )
    repetition_penalty: float | None = field(
        default=None,
        metadata={
            "help": "divide (or multiply, if negative) the logits of seen tokens by this; > 1 discourages repeats"
        },
    )
    frequency_penalty: float = field(
        default=0.0,
        metadata={
            "help": "subtract this times the number of times a token was generated so far from "
            "its logit (OpenAI's; -2 to 2)"
        },
    )
    presence_penalty: float = field(
        default=0.0,
        metadata={"help": "subtract this from the logit of every token generated so far (OpenAI's; -2 to 2)"},
    )
    logit_bias: tuple[tuple[int, float], ...] = field(
        default=(),
        metadata={
            "help": "add BIAS to token ID's logit before sampling (-100 bans it, 100 forces it); repeatable",
            "repeatable": True,
            "parse": parse_logit_bias,
            "metavar": "ID=BIAS",
        },
    )
    stop: tuple[str, ...] = field(
        default=(),
        metadata={
            "help": "stop when the output contains this string (not returned); repeatable",
            "repeatable": True,
            "metavar": "S",
        },
    )
    json_schema: str | None = field(
        default=None,
        metadata={
            "help": "the output is JSON valid against the JSON schema in FILE (structured "
            'output); \'{"type": "object"}\' asks for any object',
            "parse": read_schema_file,
            "metavar": "FILE",
        },
    )
    seed: int | None = field(default=None, metadata={"help": "random seed; row i of a call uses seed + i"})
    num_samples: int = field(default=1, metadata={"help": "samples per prompt, sharing one prefill"})
    num_beams: int = field(default=1, metadata={"help": "beam search with this many beams (deterministic)"})
    length_penalty: float = field(
        default=1.0, metadata={"help": "beam search: score = log-prob / length**length_penalty"}
    )
    early_stopping: EarlyStopping = field(
        default=False,
        metadata={
            "help": "beam search: stop when num_beams hypotheses are done (true), on a heuristic (false) or never",
            "parse": parse_early_stopping,
            "metavar": "{true,false,never}",
        },
    )

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif self.stop is None:
            object.__setattr__(self, "stop", ())
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else (self.logit_bias or ())
        pairs = tuple(tuple(pair) if isinstance(pair, list) else pair for pair in bias)
        object.__setattr__(self, "logit_bias", pairs)
        if self.json_schema is not None:
            try:
                object.__setattr__(self, "json_schema", schema_text(self.json_schema))
            except SchemaError as err:
                raise ConfigError(f"json_schema: {err}") from None
        self.validate()

    @property
    def greedy(self) -> bool:
        """Whether the next token is the argmax (temperature 0, or too small to divide by) rather than a draw."""
        return self.temperature < GREEDY_BELOW

    @property
    def reshapes_logits(self) -> bool:
        """Whether OpenAI's penalties or a logit bias change the logits (beyond repetition_penalty)."""
        return bool(self.frequency_penalty or self.presence_penalty or self.logit_bias)

    def validate(self) -> None:
        """Raise ConfigError naming the first parameter whose value is invalid and what is allowed."""
        _check_int("max_new_tokens", self.max_new_tokens, low=1)
        _check_int("num_samples", self.num_samples, low=1)
        _check_int("num_beams", self.num_beams, low=1)
        _check_number("temperature", self.temperature)
        if self.temperature < 0:
            raise ConfigError(f"temperature must be >= 0 (0 is greedy), got {self.temperature}")
        if self.top_k is not None:
            _check_int("top_k", self.top_k, low=1)
        if self.top_p is not None:
            _check_number("top_p", self.top_p)
            if not 0 < self.top_p <= 1:
                raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.min_p is not None:
            _check_number("min_p", self.min_p)
            if not 0 <= self.min_p <= 1:
                raise ConfigError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty is not None:
            _check_number("repetition_penalty", self.repetition_penalty)
            low, high = REPETITION_PENALTY_RANGE
            if not low <= self.repetition_penalty <= high:
                raise ConfigError(
                    f"repetition_penalty must be in [{low:g}, {high:g}] (1 means none), got {self.repetition_penalty}"
                )
        for name in ("frequency_penalty", "presence_penalty"):
            _check_number(name, getattr(self, name))
            if not PRESENCE_FREQUENCY_RANGE[0] <= getattr(self, name) <= PRESENCE_FREQUENCY_RANGE[1]:
                raise ConfigError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        for pair in self.logit_bias:
            if not isinstance(pair, tuple) or len(pair) != 2:
                raise ConfigError(f"logit_bias takes (token id, bias) pairs, got {pair!r}")
            _check_int("logit_bias token id", pair[0], low=0)
            _check_number("logit_bias", pair[1])
            if not LOGIT_BIAS_RANGE[0] <= pair[1] <= LOGIT_BIAS_RANGE[1]:
                raise ConfigError(f"logit_bias values must be in [-100, 100], got {pair[1]} for token {pair[0]}")
        _check_number("length_penalty", self.length_penalty)
        if self.seed is not None:
            _check_int("seed", self.seed, low=0)
            if self.seed >= SEED_LIMIT:
                raise ConfigError(f"seed must be < 2**64, got {self.seed}")
        for stop in self.stop:
            if not isinstance(stop, str) or not stop:
                raise ConfigError(f"each stop string must be a non-empty string, got {stop!r}")
        if self.early_stopping not in (True, False, "never"):
            raise ConfigError(f"early_stopping must be true, false or 'never', got {self.early_stopping!r}")
        if self.num_beams > 1:
            for name in ("top_k", "top_p", "min_p"):
                if getattr(self, name) is not None:
                    raise ConfigError(f"beam search is deterministic: drop {name} or use num_beams=1")
            if self.reshapes_logits or self.json_schema is not None:
                raise ConfigError(
                    "beam search does not apply frequency_penalty, presence_penalty, logit_bias or "
                    "json_schema; drop them or use num_beams=1"
                )
            if self.num_samples > self.num_beams:
                raise ConfigError(
                    f"beam search returns at most num_beams ({self.num_beams}) sequences; got num_samples "
                    f"{self.num_samples}"
                )


def _check_int(name: str, value: object, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    if value < low:
        raise ConfigError(f"{name} must be >= {low}, got {value}")


def _check_number(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{name} must be a finite number, got {value!r}")


def row_seed(seed: int | None, row: int) -> int | None:
    """The seed of row `row` of a seeded call: seed + row, wrapped into the generator's 64-bit range."""
    return None if seed is None else (seed + row) % SEED_LIMIT


def apply_repetition_penalty(logits: Tensor, seen: Tensor, penalty: float) -> Tensor:
    """Divide positive (multiply negative) logits of every token marked in seen (B, V) by penalty, once each."""
    penalised = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(seen, penalised, logits)


def apply_temperature(logits: Tensor, temperature: float) -> Tensor:
    """Logits scaled by 1 / temperature (temperature >= GREEDY_BELOW)."""
    return logits / temperature


def top_k_filter(logits: Tensor, k: int) -> Tensor:
    """Keep the k largest logits of each row (and any tied with the k-th); the rest become -inf."""
    k = min(k, logits.size(-1))
    kth_largest = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth_largest, float("-inf"))


def top_p_filter(logits: Tensor, p: float) -> Tensor:
    """Keep the most likely tokens until their mass reaches p (always at least the top one)."""
    ascending, order = torch.sort(logits, dim=-1)
    tail_mass = ascending.softmax(dim=-1).cumsum(dim=-1)  # this token and every less likely one
    # A token goes when it and everything less likely fit in the 1 - p left over; the top token always stays.
    drop_sorted = tail_mass <= 1 - p
    drop_sorted[..., -1] = False
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def min_p_filter(logits: Tensor, min_p: float) -> Tensor:
    """Drop tokens whose probability is below min_p times the most likely token's (which always stays)."""
    probs = logits.softmax(dim=-1)
    threshold = min_p * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_logit_bias(logits: Tensor, bias: tuple[tuple[int, float], ...]) -> Tensor:
    """Logits with each (token id, value) pair's value added to that token's logit (OpenAI's logit_bias)."""
    ids = torch.tensor([token for token, _ in bias], device=logits.device)
    values = torch.tensor([value for _, value in bias], dtype=logits.dtype, device=logits.device)
    return logits.index_add(-1, ids, values.expand(*logits.shape[:-1], -1))


def apply_presence_frequency(logits: Tensor, counts: Tensor, frequency: float, presence: float) -> Tensor:
    """OpenAI's penalties: logit - count * frequency - (count > 0) * presence, counts (B, V) over generated tokens."""
    return logits - counts * frequency - (counts > 0).to(logits.dtype) * presence


def process_logits(
    logits: Tensor, params: SamplingParams, seen: Tensor | None = None, counts: Tensor | None = None
) -> Tensor:
    """Apply params' rules to fp32 logits (B, V): OpenAI's logit bias and penalties, then Hugging Face's order;
    greedy skips the sampling filters. counts (B, V) are the generated tokens' counts (for OpenAI's penalties)."""
    if params.logit_bias:
        logits = apply_logit_bias(logits, params.logit_bias)
    if params.frequency_penalty or params.presence_penalty:
        if counts is None:
            raise ValueError("frequency_penalty and presence_penalty need the counts of generated tokens")
        logits = apply_presence_frequency(logits, counts, params.frequency_penalty, params.presence_penalty)
    if params.repetition_penalty is not None and params.repetition_penalty != 1.0:
        if seen is None:
            raise ValueError("repetition_penalty needs the mask of seen tokens")
        logits = apply_repetition_penalty(logits, seen, params.repetition_penalty)
    if params.greedy:
        return logits
    if params.temperature != 1.0:
        logits = apply_temperature(logits, params.temperature)
    if params.top_k is not None:
        logits = top_k_filter(logits, params.top_k)
    if params.top_p is not None and params.top_p < 1.0:
        logits = top_p_filter(logits, params.top_p)
    if params.min_p is not None:
        logits = min_p_filter(logits, params.min_p)
    return logits


def sample(
    logits: Tensor,
    generator: torch.Generator | None,
    params: SamplingParams,
    seen: Tensor | None = None,
    counts: Tensor | None = None,
) -> Tensor:
    """The next token (B,) for logits (B, V): the argmax when greedy, else a draw from the filtered softmax."""
    logits = process_logits(logits.float(), params, seen, counts)
    if params.greedy:
        return logits.argmax(dim=-1)
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator).squeeze(-1)
