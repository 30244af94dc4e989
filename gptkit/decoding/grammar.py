"""Structured outputs: a JSON schema compiled into a token mask that keeps a request's output valid JSON.

The grammar library is llguidance: benchmarks/bench_structured.py measured it against xgrammar and outlines-core
on this CPU (compile time per schema and mask time per token; figures in docs/benchmarks.md), and it needs no per-schema
precomputation over the vocabulary, so a new schema costs milliseconds. One Grammar per (tokenizer, schema) maps
the schema onto the tokenizer's tokens; each request gets its own Constraint (a matcher that follows the tokens
the request accepts) from Grammar.start().
"""

from __future__ import annotations

import json
import threading
from typing import Any, Callable

import numpy as np
import torch
from torch import Tensor

from gptkit.errors import ConfigError, InputError
from gptkit.tokenizer import Tokenizer

ANY_OBJECT = '{"type": "object"}'  # OpenAI's JSON mode ("json_object"): any JSON object
# The deepest nesting of objects and arrays a schema may have. Hand-written and generated schemas stay far below it
# (repeated parts nest through "$defs"); Python's JSON parser and encoder recurse once per level (a schema 2,000
# levels deep exhausts the stack), and llguidance's own JSON parser stops at 128 levels.
MAX_SCHEMA_DEPTH = 100


class SchemaError(InputError):
    """A JSON schema that cannot be compiled into a grammar; the message names the problem."""


def schema_text(schema: str | dict[str, Any]) -> str:
    """A JSON schema given as a dict or as JSON text, as compact JSON text; a SchemaError if it is not an object or
    nests deeper than MAX_SCHEMA_DEPTH. The one check every schema passes (CLI, Python API, server)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as err:
            raise SchemaError(f"the JSON schema is not valid JSON: {err}") from None
        except RecursionError:  # the parser recurses per level: this one is thousands deep
            raise SchemaError(_too_deep()) from None
    if not isinstance(schema, dict):
        raise SchemaError(f"a JSON schema must be a JSON object, got {type(schema).__name__}")
    if _depth(schema, MAX_SCHEMA_DEPTH) > MAX_SCHEMA_DEPTH:
        raise SchemaError(_too_deep())
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)


def _too_deep() -> str:
    return (
        f"the JSON schema nests objects and arrays more than {MAX_SCHEMA_DEPTH} levels deep; flatten it (a part "
        'that repeats can be named once under "$defs" and referred to with "$ref")'
    )


def _depth(value: Any, limit: int) -> int:
    """How deep objects and arrays nest in value, counted without recursion and only up to limit + 1 (a dict that
    contains itself ends there too)."""
    deepest, pending = 0, [(value, 1)]
    while pending:
        item, depth = pending.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            if depth > limit:
                return depth
            pending.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def read_schema_file(path: str) -> str:
    """The JSON schema in a file, as compact JSON text (for --json-schema FILE)."""
    try:
        with open(path, encoding="utf-8") as file:
            text = file.read()
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"cannot read the JSON schema file {path}: {err}") from None
    try:
        return schema_text(text)
    except SchemaError as err:
        raise ValueError(f"{path}: {err}") from None


class _TokenTable:
    """What llguidance needs to know about a tokenizer: each id's bytes, the end ids, and how to encode."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_id: int) -> None:
        count = tokenizer.vocab_size
        # Ids past the tokenizer's (a model's padded vocabulary) stand for no text: the mask never allows them.
        self.tokens = [tokenizer.token_bytes(i) for i in range(count)] + [b""] * (vocab_size - count)
        self.eos_token_id = eos_id
        self.bos_token_id = None
        self.special_token_ids = sorted(set(tokenizer.special_tokens.values()) | {eos_id})
        self._encode = tokenizer.encode

    def __call__(self, data: bytes | str) -> list[int]:
        # A character outside a char tokenizer's alphabet raises: the matcher then stops in its error state (no
        # token can write that text), rather than follow a tokenization that leaves the character out.
        return self._encode(data.decode("utf-8", errors="replace") if isinstance(data, bytes) else data)


_TOKENIZERS: dict[tuple[int, int], tuple[Any, Any]] = {}  # (id(tokenizer), vocab) -> (tokenizer, LLTokenizer)
_TOKENIZERS_LOCK = threading.Lock()
_TOKENIZERS_KEPT = 4


def _ll_tokenizer(tokenizer: Tokenizer, vocab_size: int) -> Any:
    """llguidance's view of tokenizer over a model vocabulary of vocab_size ids (built once, ~0.3 s for 50k ids);
    its end id, allowed once the JSON is complete, is the tokenizer's own or an id past the vocabulary."""
    import llguidance

    eos_ids = tuple(tokenizer.eos_ids)
    # Without an end-of-text token the grammar still needs one: an id no model row has, never sampled.
    eos = eos_ids[0] if eos_ids else vocab_size
    size = vocab_size if eos_ids else vocab_size + 1
    key = (id(tokenizer), size)
    with _TOKENIZERS_LOCK:
        cached = _TOKENIZERS.get(key)
        if cached is None or cached[0] is not tokenizer:
            wrapper = llguidance.TokenizerWrapper(_TokenTable(tokenizer, size, eos))
            cached = (tokenizer, llguidance.LLTokenizer(wrapper, n_vocab=size, eos_token=list(eos_ids) or eos))
            _TOKENIZERS[key] = cached
            while len(_TOKENIZERS) > _TOKENIZERS_KEPT:  # the oldest first: a server has one tokenizer
                _TOKENIZERS.pop(next(iter(_TOKENIZERS)))
    return cached[1]


# How every grammar lays JSON out. Whitespace between JSON items only where the schema's own options ask for it: a
# model free to write spaces and newlines may write nothing else until max_tokens runs out.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def json_rule(schema: str | dict[str, Any]) -> str:
    """The body of a Lark rule (llguidance's dialect) matching JSON valid against schema, laid out as JSON_LAYOUT."""
    value = json.loads(schema_text(schema))
    return "%json " + json.dumps({**value, "x-guidance": JSON_LAYOUT})


def lark_literal(text: str) -> str:
    """text as a Lark string literal."""
    return json.dumps(text)


class Grammar:
    """A JSON schema (or a Lark grammar over JSON) compiled for one tokenizer and model vocabulary; start() gives a
    request its Constraint.

    lead: text allowed (not required) before the JSON, such as the space a chat template's replies begin with: a
    model trained on that template writes it first, and forcing `{` in its place starts the reply off the model's
    distribution."""

    def __init__(self, tokenizer: Tokenizer, schema: str, vocab_size: int, lead: str = "") -> None:
        schema = schema_text(schema)  # checked here too for callers that build a Grammar without SamplingParams
        # Compiled without the lead first: a schema whose JSON no token can begin is refused here, not found at the
        # first token past the lead.
        self._compile(
            tokenizer, vocab_size, lambda ll: ll.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)
        )
        if lead:
            self._compile(
                tokenizer,
                vocab_size,
                lambda ll: ll.LLMatcher.grammar_from_lark(
                    f"start: {lark_literal(lead)}? value\nvalue: {json_rule(schema)}\n"
                ),
            )

    @classmethod
    def from_lark(cls, tokenizer: Tokenizer, lark: str, vocab_size: int) -> Grammar:
        """A grammar written in llguidance's Lark dialect (json_rule gives its JSON parts)."""
        grammar = cls.__new__(cls)
        grammar._compile(tokenizer, vocab_size, lambda ll: ll.LLMatcher.grammar_from_lark(lark))
        return grammar

    def _compile(self, tokenizer: Tokenizer, vocab_size: int, build: Callable[[Any], str]) -> None:
        try:
            import llguidance
        except ImportError:
            raise ConfigError("structured outputs need llguidance: pip install llguidance") from None
        if tokenizer.vocab_size > vocab_size:
            raise ConfigError(f"the tokenizer has {tokenizer.vocab_size} ids, more than the model's {vocab_size}")
        self.vocab_size = vocab_size
        self.tokenizer = _ll_tokenizer(tokenizer, vocab_size)
        try:
            self.grammar = build(llguidance)
        except ValueError as err:
            raise SchemaError(f"cannot compile the JSON schema: {err}") from None
        if not self.start().can_continue:  # a schema the library cannot compile fails in start(), before any request
            raise SchemaError("this model's tokenizer has no token that can begin JSON valid against the schema")

    def start(self) -> Constraint:
        """A fresh matcher at the start of the output."""
        import llguidance

        matcher = llguidance.LLMatcher(self.tokenizer, self.grammar, log_level=0)
        if matcher.is_error():
            raise SchemaError(f"cannot compile the JSON schema: {matcher.get_error()}")
        return Constraint(matcher, self.vocab_size)


class Constraint:
    """One request's place in the grammar: the mask of tokens allowed next, advanced by each accepted token."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self.matcher, self.vocab_size = matcher, vocab_size
        self._allowed = self._compute()

    def _compute(self) -> np.ndarray:
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        return np.unpackbits(bits, bitorder="little")[: self.vocab_size].view(bool)

    @property
    def complete(self) -> bool:
        """Whether the output is whole: nothing but the end may follow."""
        return self.matcher.is_stopped() and not self.matcher.is_error()

    @property
    def can_continue(self) -> bool:
        """Whether some token of the vocabulary may follow (false at a dead end: the text the grammar needs next
        has no token in this tokenizer, such as a character outside a char tokenizer's alphabet)."""
        return not self.matcher.is_error() and bool(self._allowed.any())

    def mask(self, logits: Tensor) -> Tensor:
        """logits (V,) with every token the grammar does not allow next set to -inf."""
        allowed = torch.from_numpy(self._allowed).to(logits.device)
        return logits.masked_fill(~allowed, float("-inf"))

    def advance(self, token: int) -> None:
        """Follow an accepted token (a token the mask allowed)."""
        self.matcher.consume_token(token)
        self._allowed = self._compute() if not self.matcher.is_stopped() else np.zeros(self.vocab_size, dtype=bool)
