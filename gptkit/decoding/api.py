"""The public decoding API: generate_ids, generate and stream, and complete(), which all of them call.

Each takes a SamplingParams (params=) and a DecodeOptions (options=: the fast paths, compile and draft, and the
KV cache's element type; gptkit.decoding.options); the public ones also take the fields of both as keywords
(overrides of params and options, or of the defaults). Every path decodes through the batch engine, beam search or
speculative decoding, on the same Request.
"""

from __future__ import annotations

import dataclasses
import logging
import numbers
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from gptkit.decoding.batch import BatchEngine, requests_for
from gptkit.decoding.beam import beam_search
from gptkit.decoding.grammar import Grammar
from gptkit.decoding.options import DecodeOptions, split_overrides
from gptkit.decoding.request import Decode, EosIds, FinishReason, Request, end_ids, first_stop
from gptkit.decoding.sampling import SamplingParams
from gptkit.decoding.speculative import check_draft, fits, speculate
from gptkit.decoding.step import base, cache_len, check_prompts, device_dtype, sync
from gptkit.decoding.verify import SpeculativeStats
from gptkit.errors import ConfigError, InputError
from gptkit.kv_cache import kv_dtype_of
from gptkit.model import GPT
from gptkit.tokenizer import Tokenizer

log = logging.getLogger("gptkit.decoding")
_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams))


def sampling_params(params: SamplingParams | None, overrides: dict[str, Any]) -> SamplingParams:
    """params (or the defaults) with the given fields replaced; an unknown keyword is a ConfigError naming it."""
    unknown = sorted(set(overrides) - set(_FIELDS))
    if unknown:
        raise ConfigError(f"unknown sampling parameter {unknown[0]!r}; the parameters are: {', '.join(_FIELDS)}")
    return dataclasses.replace(params or SamplingParams(), **overrides)


@dataclass
class Completion:
    """One generated sequence: its new token ids (no end-of-text token), why it ended, and the end-of-text id it
    chose when it ended on one."""

    ids: list[int]
    finish_reason: FinishReason
    end_id: int | None = None


@dataclass
class Timing:
    """Token counts and wall-clock seconds of the prefill and decode phases."""

    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    compile_seconds: float | None = None  # the one-off compile (and first step) when compile=True
    speculative: SpeculativeStats | None = None  # when a draft model or lookup proposed tokens

    def to_dict(self) -> dict[str, float | None]:
        """Counts, seconds and tokens per second of both phases (None where a phase was not timed apart)."""
        rate = lambda tokens, seconds: tokens / seconds if seconds > 0 else None  # noqa: E731
        extra: dict[str, Any] = {}
        if self.compile_seconds is not None:
            extra["compile_seconds"] = self.compile_seconds
        if self.speculative is not None:
            extra.update(self.speculative.to_dict())
        return extra | {
            "prefill_tokens": self.prefill_tokens,
            "prefill_seconds": self.prefill_seconds,
            "prefill_tokens_per_s": rate(self.prefill_tokens, self.prefill_seconds),
            "decode_tokens": self.decode_tokens,
            "decode_seconds": self.decode_seconds,
            "decode_tokens_per_s": rate(self.decode_tokens, self.decode_seconds),
        }


@dataclass
class Result:
    """Completions per prompt (params.num_samples each) and the timing of the whole call."""

    completions: list[list[Completion]]
    timing: Timing = field(default_factory=Timing)


def grammar_for(model: GPT, tokenizer: Tokenizer | None, params: SamplingParams) -> Grammar | None:
    """params.json_schema compiled for the tokenizer and model (None without a schema)."""
    if params.json_schema is None:
        return None
    if tokenizer is None:
        raise ConfigError("json_schema needs the tokenizer (tokenizer=...) to map the schema onto token ids")
    return Grammar(tokenizer, params.json_schema, base(model).config.vocab_size)


def _fits_draft(model: GPT, prompts: Sequence[Sequence[int]], params: SamplingParams, options: DecodeOptions) -> bool:
    """Whether to speculate: a draft given, checked, and room for it (else a warning, and plain decoding)."""
    draft, draft_k = options.draft, options.draft_k
    if draft is None:
        return False
    check_draft(model, draft, params, draft_k)
    need = max(len(p) for p in prompts) + params.max_new_tokens + draft_k
    if not fits(model, draft, need):  # a learned-position window would have to slide: decode without the draft
        log.warning(
            "decoding without the draft: speculative decoding needs prompt + max_new_tokens + draft_k "
            "(%d) positions, more than a learned-position model's block_size holds",
            need,
        )
        return False
    return True


def complete(
    model: GPT,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    eos_id: EosIds = None,
    decode: Decode | None = None,
    options: DecodeOptions | None = None,
    grammar: Grammar | None = None,
) -> Result:
    """Generate for a batch of token-id prompts under params; the engine behind generate_ids and generate.

    options: the decoding path (DecodeOptions; with compile its one-off cost is timing.compile_seconds; a draft
    decodes one request at a time). grammar: params.json_schema compiled by grammar_for (required with a schema).
    """
    options = options or DecodeOptions()
    compile = options.compile
    check_prompts(model, prompts)
    if (params.json_schema is None) != (grammar is None):
        raise ConfigError(
            "give a grammar (grammar_for(model, tokenizer, params)) exactly when params has a json_schema"
        )
    kv_dtype = _kv_dtype(options, params)
    lookup = options.lookup_proposer()
    device, _ = device_dtype(model)
    timing = Timing(prefill_tokens=sum(len(p) for p in prompts))
    requests = requests_for(prompts, params, end_ids(eos_id), decode, grammar, lookup)
    if _fits_draft(model, prompts, params, options):
        timing.speculative = SpeculativeStats()
        start = time.perf_counter()
        for request in requests:
            for _ in speculate(model, options.draft, request, timing.speculative, options.draft_k, compile):
                pass
        sync(device)
        timing.decode_seconds = time.perf_counter() - start  # speculation interleaves the phases
        timing.decode_tokens = sum(len(r.generated) for r in requests)
    elif params.num_beams > 1:
        start = time.perf_counter()
        beams = [beam_search(model, p, params, eos_id, decode, compile) for p in prompts]
        timing.decode_seconds = time.perf_counter() - start
        completions = [[Completion(ids, reason) for ids, reason in row] for row in beams]
        timing.decode_tokens = sum(len(c.ids) for row in completions for c in row)
        return Result(completions, timing)
    else:
        need = max(len(p) for p in prompts) + params.max_new_tokens
        length = cache_len(model, need, compile)
        engine = BatchEngine(
            model, len(requests), length, compile, kv_dtype=kv_dtype, lookup_k=lookup.k if lookup else 0
        )
        if lookup is not None:
            timing.speculative = engine.speculative
        if compile:
            timing.compile_seconds = engine.warm_up()
        start = time.perf_counter()
        engine.add(requests)
        sync(device)
        timing.prefill_seconds = time.perf_counter() - start
        start = time.perf_counter()
        while engine.rows:
            engine.step()
        sync(device)
        timing.decode_seconds = time.perf_counter() - start
        timing.decode_tokens = sum(max(len(r.generated) - 1, 0) for r in requests)  # the first came with prefill
    S = params.num_samples
    completions = [
        [Completion(r.generated, r.finish_reason, r.end_id) for r in requests[i * S : (i + 1) * S]]
        for i in range(len(prompts))
    ]
    return Result(completions, timing)


def _kv_dtype(options: DecodeOptions, params: SamplingParams) -> torch.dtype | None:
    """The cache's element type for options.kv_cache; a ConfigError where the decoding path keeps its own cache."""
    kv_dtype = kv_dtype_of(options.kv_cache)
    if kv_dtype is not None and (params.num_beams > 1 or options.draft is not None):
        raise ConfigError(
            f"kv_cache {options.kv_cache} works with greedy and sampled decoding; beam search and a draft "
            "model keep their caches in the model's dtype"
        )
    return kv_dtype


def _shape(per_prompt: list[list[Any]], batched: bool, num_samples: int) -> Any:
    """Unwrap the result to the caller's shape: one item, or a list, per prompt and per sample."""
    items = [row if num_samples > 1 else row[0] for row in per_prompt]
    return items if batched else items[0]


def generate_ids(
    model: GPT,
    prompt_ids: list[int] | list[list[int]],
    params: SamplingParams | None = None,
    *,
    eos_id: EosIds = None,
    tokenizer: Tokenizer | None = None,
    options: DecodeOptions | None = None,
    **overrides: Any,
) -> list[int] | list[list[int]] | list[list[list[int]]]:
    """The new token ids for one prompt (a list of ids) or a batch (a list of such lists).

    params and keyword overrides (SamplingParams' fields: max_new_tokens, temperature, top_k, ...) set the rules.
    With num_samples > 1 each prompt gives a list of samples. Generation stops at eos_id (an id or several; not
    returned) and at stop strings (found by decoding with tokenizer; the ids up to the one completing the string
    are returned). options and keyword overrides of its fields (compile, draft, ...) choose the decoding path.
    """
    params, options = split_overrides(params, options, overrides)
    batched = bool(prompt_ids) and not isinstance(prompt_ids[0], numbers.Integral)
    prompts = [list(p) for p in prompt_ids] if batched else [list(prompt_ids)]
    decode = tokenizer.decode if tokenizer is not None else None
    result = complete(model, prompts, params, eos_id, decode, options, grammar_for(model, tokenizer, params))
    return _shape([[c.ids for c in row] for row in result.completions], batched, params.num_samples)


def encode_prompt(tokenizer: Tokenizer, prompt: str) -> list[int]:
    """The prompt's ids (with a start token the tokenizer adds, such as Llama's <s>); an empty prompt starts from
    the end-of-text token (GPT-2's document separator) when the tokenizer adds none."""
    if not isinstance(prompt, str):
        raise InputError(f"a prompt must be a string, got {type(prompt).__name__}")
    ids = tokenizer.encode_prompt(prompt)
    if ids:
        return ids
    if tokenizer.eos_id is None:
        raise InputError(
            "the prompt is empty and this model's tokenizer has no start (end-of-text) token; give a prompt of at "
            "least one character"
        )
    return [tokenizer.eos_id]


def completion_text(tokenizer: Tokenizer, completion: Completion, stops: Sequence[str]) -> str:
    """The decoded text of a completion, cut before the first stop string."""
    text = tokenizer.decode(completion.ids)
    cut = first_stop(text, stops)
    return text if cut < 0 else text[:cut]


def generate_text(
    model: GPT,
    tokenizer: Tokenizer,
    prompts: Sequence[str],
    params: SamplingParams,
    options: DecodeOptions | None = None,
) -> tuple[list[list[str]], Result]:
    """Texts per prompt (num_samples each) and the full result (ids, finish reasons, timing)."""
    if not prompts:
        raise InputError("no prompts given")
    ids = [encode_prompt(tokenizer, p) for p in prompts]
    grammar = grammar_for(model, tokenizer, params)
    result = complete(model, ids, params, tokenizer.eos_ids, tokenizer.decode, options, grammar)
    texts = [[completion_text(tokenizer, c, params.stop) for c in row] for row in result.completions]
    return texts, result


def generate(
    model: GPT,
    tokenizer: Tokenizer,
    prompt: str | list[str],
    params: SamplingParams | None = None,
    *,
    options: DecodeOptions | None = None,
    **overrides: Any,
) -> str | list[str] | list[list[str]]:
    """The generated text (without the prompt) for a prompt, or a list for a list of prompts.

    params and keyword overrides (SamplingParams' fields) set the rules. With num_samples > 1 each prompt gives a
    list of samples. Neither the end-of-text token nor a stop string is part of the text. options and keyword
    overrides of its fields choose the decoding path: compile (a compiled decode step), draft and draft_k (a small
    model for speculative decoding), kv_cache ("int8" keeps the keys and values in int8).
    """
    params, options = split_overrides(params, options, overrides)
    batched = not isinstance(prompt, str)
    texts, _ = generate_text(model, tokenizer, list(prompt) if batched else [prompt], params, options)
    return _shape(texts, batched, params.num_samples)


def stream_text(
    model: GPT,
    tokenizer: Tokenizer,
    prompt: str,
    params: SamplingParams,
    options: DecodeOptions | None = None,
) -> Iterator[str]:
    """Text pieces as tokens decode (single prompt, one sample, no beams); they join to generate()'s text."""
    if params.num_beams > 1 or params.num_samples > 1:
        raise ConfigError("streaming produces one sequence: use num_beams=1 and num_samples=1")
    options = options or DecodeOptions()
    kv_dtype = _kv_dtype(options, params)
    lookup = options.lookup_proposer()
    ids = encode_prompt(tokenizer, prompt)
    grammar = grammar_for(model, tokenizer, params)
    [request] = requests_for([ids], params, tokenizer.eos_ids, tokenizer.decode, grammar, lookup)
    if _fits_draft(model, [ids], params, options):
        steps = speculate(model, options.draft, request, SpeculativeStats(), options.draft_k, options.compile)
    else:
        steps = _engine_steps(model, request, options, kv_dtype)
    for _ in steps:
        text = request.take().text
        if text:
            yield text


def _engine_steps(model: GPT, request: Request, options: DecodeOptions, kv_dtype: torch.dtype | None) -> Iterator[None]:
    """Decode one request on a batch engine of one row, pausing after the prefill and after each step."""
    need = len(request.prompt) + request.params.max_new_tokens
    length = cache_len(model, need, options.compile)
    lookup_k = options.lookup_k if options.lookup else 0
    engine = BatchEngine(model, 1, length, options.compile, kv_dtype=kv_dtype, lookup_k=lookup_k)
    engine.add([request])
    yield
    while engine.rows:
        engine.step()
        yield


def stream(
    model: GPT,
    tokenizer: Tokenizer,
    prompt: str,
    params: SamplingParams | None = None,
    *,
    options: DecodeOptions | None = None,
    **overrides: Any,
) -> Iterator[str]:
    """Yield the generated text in pieces as it decodes, never splitting a character or showing a stop string.

    Takes what generate() takes (for one prompt and one sample), and yields pieces that join to its text.
    """
    params, options = split_overrides(params, options, overrides)
    return stream_text(model, tokenizer, prompt, params, options)
