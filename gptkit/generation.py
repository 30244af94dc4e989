"""KV-cached generation: prefill, a fixed-shape decode step, sampling, beam search, batching and streaming.

The pieces, smallest first:
- prefill(model, ids, cache, lengths): right-padded prompts through the model at positions 0.., filling the cache.
- decode_one_token(model, tokens, cache, positions): one token per row at its own position (a (B,) tensor) over
  a static cache; the same shapes every step, so it can be compiled as it is.
- Engine: batch slots sharing one KVCache; add() prefills prompts into free slots and picks their first token,
  step() decodes one token for every unfinished row, free() releases a slot. generate_ids, generate and stream
  drive it; a continuous-batching server can drive it the same way.
- beam_search(): Hugging Face's beam search (length penalty, early stopping) for one prompt.

Context longer than the model can hold: a model with learned positions sees only the last block_size tokens
(once a row is full, each further token re-prefills that row's last block_size tokens, exactly as an uncached
model cropped to block_size would see them); RoPE, sinusoidal and position-free models continue to max_len.
Returned ids and text never include the end-of-text token or a stop string (at the id level the tokens up to the
one completing the stop string are kept).
"""

from __future__ import annotations

import logging
import math
import numbers
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch._dynamo.config
import torch._inductor.config
from torch import Tensor

from gptkit import cpu_kernels
from gptkit.errors import ConfigError, InputError
from gptkit.kv_cache import KVCache
from gptkit.model import GPT
from gptkit.quantization import is_quantized
from gptkit.sampling import EarlyStopping, SamplingParams, apply_repetition_penalty, row_seed, sample

FinishReason = Literal["eos", "stop", "length"]
Decode = Callable[[Sequence[int]], str]
log = logging.getLogger("gptkit.generation")
EosIds = int | Sequence[int] | None  # the token(s) that end a sequence: one id, several, or none


def end_ids(eos_id: EosIds) -> tuple[int, ...]:
    """eos_id as a tuple of ids (checked to be integers)."""
    ids = () if eos_id is None else (eos_id,) if isinstance(eos_id, numbers.Integral) else tuple(eos_id)
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, numbers.Integral):
            raise InputError(f"eos_id must be a token id or a list of them, got {eos_id!r}")
    return tuple(int(i) for i in ids)
_DEFAULTS = SamplingParams()
_FINISHED = -1.0e9  # Hugging Face's beam search marks impossible candidates with this score offset


# ----- the two model calls -----


def prefill(model: GPT, ids: Tensor, cache: KVCache, lengths: Tensor) -> Tensor:
    """Run right-padded prompts ids (B, T) at positions 0.. into cache; logits (B, V) at each row's last token."""
    return model(ids, cache=cache, start_pos=0, logits_at=lengths - 1)[:, 0]


def decode_one_token(model: GPT, tokens: Tensor, cache: KVCache, positions: Tensor | int) -> Tensor:
    """Logits (B, V) for tokens (B, 1), row b written at cache position positions[b]; fixed shapes every step.

    An int position (every row at the same place) lets eager attention read only the filled part of the cache
    instead of masking the whole of it; the shapes then change every step, so the compiled step never gets one.
    """
    return model(tokens, cache=cache, start_pos=positions)[:, -1]


# Compiled cache lengths are rounded up to a multiple of this, so requests of nearby lengths share one compiled
# step (a new shape means a new compile); attending over the few extra masked slots costs little.
COMPILE_CACHE_MULTIPLE = 256
COMPILED_VERSIONS = 64  # compiled decode steps (models x shapes) kept before dynamo falls back to eager
DRAFT_K = 4  # tokens a draft model proposes per target pass in speculative decoding


def compiled_decode_step(model: GPT) -> Callable[[GPT, Tensor, KVCache, Tensor], Tensor]:
    """decode_one_token compiled with torch.compile, made once per model and reused for every call of its shapes.

    On CPU inductor freezes the weights (constants it can prepack for its matmul kernels), so the model's weights
    must not change after the first compiled call; change them (or its dtype, or quantise it) before compiling.
    """
    base = _base(model)
    step = base.__dict__.get("_gptkit_decode_step")
    if step is None:
        compiled = torch.compile(decode_one_token, dynamic=False)
        device, dtype = _device_dtype(base)
        int8 = is_quantized(base)
        if device.type == "cpu" and (dtype == torch.bfloat16 or int8):
            cpu_kernels.load()  # built (or ruled out) now: a compiled graph only reads the answer

        def step(model: GPT, tokens: Tensor, cache: KVCache, positions: Tensor) -> Tensor:
            # Inductor reads its options from its global config when it compiles (torch.compile's options= does
            # not reach `freezing`), so they are set around each call rather than for the whole process. Every
            # model and shape is one more compiled version of the same function: past dynamo's default limit of 8
            # it would fall back to eager without a word.
            autotune = _autotune_decode(device, dtype, int8, tokens.size(0))
            # The autotuner writes a table of kernel timings to stderr per matrix shape unless told not to.
            inductor = dict(freezing=device.type == "cpu", max_autotune=autotune, autotune_num_choices_displayed=0,
                            max_autotune_report_choices_stats=False)  # fmt: skip
            with torch._inductor.config.patch(inductor), torch._dynamo.config.patch(recompile_limit=COMPILED_VERSIONS):
                return compiled(model, tokens, cache, positions)

        base.__dict__["_gptkit_decode_step"] = step  # a plain attribute: not a submodule, not saved
    return step


def _autotune_decode(device: torch.device, dtype: torch.dtype, int8: bool, batch: int) -> bool:
    """Whether a compiled decode step should let inductor time its own C++ GEMM kernels against the libraries'.

    Measured on a 2-core AVX-512 CPU (GPT-2 small, benchmarks/bench_generate.py): inductor's template beats MKL and
    oneDNN for fp32 and int8 weights at batch 1 and 8 (+15-60% tokens/s) and for bf16 at batch 1 (+9%), but loses
    to oneDNN's bf16 GEMM at batch 8 (-15%), which the autotuner, timing each matmul alone on warm caches, does not
    see. It roughly triples the one-off compile time. On CUDA the default kernels are kept (not measured here).
    (Where gptkit's own bf16 kernel runs, cpu_kernels, decoding's bf16 products bypass matmul and this choice.)
    """
    return device.type == "cpu" and (int8 or dtype != torch.bfloat16 or batch == 1)


# ----- helpers shared by the engine and beam search -----


def _base(model: GPT) -> GPT:
    return getattr(model, "_orig_mod", model)  # torch.compile wraps the module


def _device_dtype(model: GPT) -> tuple[torch.device, torch.dtype]:
    param = next(_base(model).parameters())
    return param.device, param.dtype


@contextmanager
def _inference(model: GPT) -> Iterator[None]:
    """Eval mode, no autograd, and no per-call input check (a device sync) for inputs validated here once."""
    base = _base(model)
    checked, training = base.check_inputs, base.training
    base.check_inputs = False
    if training:  # dropout off; toggling walks every module, so only when needed
        base.train(False)
    try:
        with torch.no_grad():
            yield
    finally:
        base.check_inputs = checked
        if training:
            base.train(True)


def _check_prompts(model: GPT, prompts: Sequence[Sequence[int]]) -> None:
    """Raise InputError for an empty prompt or a token id outside the model's vocabulary."""
    vocab = _base(model).config.vocab_size
    for i, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise InputError(f"prompt {i} is empty; a prompt needs at least one token")
        bad = [t for t in prompt if not (isinstance(t, numbers.Integral) and 0 <= t < vocab)]
        if bad:
            raise InputError(f"token id {bad[0]!r} in prompt {i} is outside the model's vocabulary [0, {vocab})")


def _window(model: GPT, max_len: int) -> int | None:
    """Tokens a learned-position model sees at most (None: the model has no such limit)."""
    config = _base(model).config
    return min(config.block_size, max_len) if config.position == "learned" else None


def _prefill_slots(
    model: GPT, cache: KVCache, slots: Sequence[int], seqs: Sequence[Sequence[int]], sources: Sequence[int]
) -> Tensor:
    """Prefill seqs in one right-padded forward and copy seq sources[i] into cache slot slots[i].

    Several slots may share one source (samples or beams of one prompt): the prompt runs once. Returns the
    logits (len(seqs), V) at each seq's last token.
    """
    device, dtype = _device_dtype(model)
    lengths = [len(s) for s in seqs]
    T = max(lengths)
    ids = torch.zeros(len(seqs), T, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
    scratch = KVCache(_base(model).config, len(seqs), T, device=device, dtype=dtype)
    logits = prefill(model, ids.to(device), scratch, torch.tensor(lengths, device=device))
    dst = torch.tensor(list(slots), device=device)
    src = torch.tensor(list(sources), device=device)
    for full, part in zip(cache.keys + cache.values, scratch.keys + scratch.values):
        full[dst, :, :T] = part[src]
    return logits


def _seeded(device: torch.device, seed: int | None) -> torch.Generator:
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()  # non-deterministic
    else:
        generator.manual_seed(seed)
    return generator


def _first_stop(text: str, stops: Sequence[str]) -> int:
    """Index of the earliest stop string in text, or -1."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits, default=-1)


# ----- the batch engine -----


@dataclass
class Row:
    """One sequence in a batch slot: its tokens, rules and progress."""

    tokens: list[int]  # the prompt, then each generated token (the end-of-text token is never appended)
    prompt_len: int
    params: SamplingParams
    generator: torch.Generator
    eos_ids: tuple[int, ...]  # any of them ends the row
    decode: Decode | None  # needed only to find stop strings
    position: int  # cache position the next fed token (tokens[-1]) is written at
    finish_reason: FinishReason | None = None

    @property
    def generated(self) -> list[int]:
        """The new tokens so far."""
        return self.tokens[self.prompt_len :]

    @property
    def done(self) -> bool:
        """Whether the row has finished."""
        return self.finish_reason is not None


class Engine:
    """Batch slots sharing one preallocated KVCache: add rows, step them one token at a time, free them.

    Rows advance together: step() runs one decode_one_token over every slot (free and finished slots ride along
    with a dummy token, so the shapes never change) and samples each unfinished row with its own rules and seeded
    generator. Finished rows keep their results until free(slot).
    """

    def __init__(self, model: GPT, batch_size: int, max_len: int, compile: bool = False) -> None:
        self.model = model
        self.device, dtype = _device_dtype(model)
        config = _base(model).config
        self.decode_step = compiled_decode_step(model) if compile else decode_one_token
        self.cache = KVCache(config, batch_size, max_len, device=self.device, dtype=dtype)
        self.window = _window(model, max_len)
        self.rows: list[Row | None] = [None] * batch_size
        self.seen = torch.zeros(batch_size, config.vocab_size, dtype=torch.bool, device=self.device)

    @property
    def max_len(self) -> int:
        """Cache positions per slot."""
        return self.cache.max_len

    @torch.no_grad()
    def warm_up(self) -> float:
        """Run the decode step once on this engine's shapes (compiling it if needed); returns the seconds taken.

        The dummy tokens go to the last cache slot of every row, which each row overwrites before it attends to it.
        """
        start = time.perf_counter()
        B = len(self.rows)
        with _inference(self.model):
            self.decode_step(self.model, torch.zeros(B, 1, dtype=torch.long, device=self.device), self.cache,
                             torch.full((B,), self.max_len - 1, device=self.device))  # fmt: skip
        _sync(self.device)
        return time.perf_counter() - start

    def free_slots(self) -> list[int]:
        """Slots that hold no row."""
        return [slot for slot, row in enumerate(self.rows) if row is None]

    def active_slots(self) -> list[int]:
        """Slots whose row is still generating."""
        return [slot for slot, row in enumerate(self.rows) if row is not None and not row.done]

    def free(self, slot: int) -> None:
        """Release a slot (finished or not) for a new row."""
        self.rows[slot] = None

    @torch.no_grad()
    def add(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        eos_id: EosIds = None,
        decode: Decode | None = None,
    ) -> list[int]:
        """Prefill prompts (num_samples rows each, one shared prefill) into free slots and pick their first tokens.

        Returns the slots, prompt-major. Row r of the call draws with seed + r when params.seed is set.
        """
        eos_ids = end_ids(eos_id)
        if params.num_beams > 1:
            raise ConfigError("the batch engine samples; use beam_search() for num_beams > 1")
        if params.stop and decode is None:
            raise ConfigError("stop strings need a decode function (a tokenizer) to find them in the output")
        _check_prompts(self.model, prompts)
        free = self.free_slots()
        need = len(prompts) * params.num_samples
        if need > len(free):
            raise InputError(f"{need} rows do not fit: only {len(free)} of {len(self.rows)} batch slots are free")
        seqs = [list(p[-self.window :]) if self.window else list(p) for p in prompts]
        for prompt in seqs:
            if len(prompt) > self.max_len:
                raise InputError(f"a prompt of {len(prompt)} tokens does not fit the cache of {self.max_len} positions")
        slots = free[:need]
        sources = [i for i in range(len(prompts)) for _ in range(params.num_samples)]
        with _inference(self.model):
            logits = _prefill_slots(self.model, self.cache, slots, seqs, sources)
        for r, (slot, i) in enumerate(zip(slots, sources)):
            seed = row_seed(params.seed, r)
            self.rows[slot] = Row(list(prompts[i]), len(prompts[i]), params, _seeded(self.device, seed), eos_ids,
                                  decode, position=len(seqs[i]))  # fmt: skip
            self.seen[slot] = False
            self.seen[slot, torch.tensor(list(prompts[i]), device=self.device)] = True
        self._choose(slots, logits[torch.tensor(sources, device=self.device)])
        return slots

    @torch.no_grad()
    def step(self) -> list[int]:
        """Decode one token for every unfinished row; returns the slots that advanced."""
        active = self.active_slots()
        cached, windowed = [], []
        for slot in active:
            row = self.rows[slot]
            if row.position < self.max_len:
                cached.append(slot)
            elif self.window is not None:
                windowed.append(slot)
            else:
                row.finish_reason = "length"  # the cache is full
        if not cached and not windowed:
            return []
        logits = None
        with _inference(self.model):
            if cached:
                tokens = [0] * len(self.rows)
                positions = [0] * len(self.rows)
                for slot in cached:
                    tokens[slot], positions[slot] = self.rows[slot].tokens[-1], self.rows[slot].position
                    self.rows[slot].position += 1
                eager = self.decode_step is decode_one_token
                shared = eager and len(cached) == len(self.rows) and len(set(positions)) == 1
                logits = self.decode_step(
                    self.model,
                    torch.tensor(tokens, device=self.device)[:, None],
                    self.cache,
                    positions[0] if shared else torch.tensor(positions, device=self.device),
                ).float()
            if windowed:
                if logits is None:
                    logits = torch.empty(len(self.rows), self.seen.size(1), device=self.device)
                # A full learned-position row: recompute its last `window` tokens at positions 0.. (after the
                # batched step, which wrote a dummy token into this row).
                seqs = [self.rows[slot].tokens[-self.window :] for slot in windowed]
                logits[torch.tensor(windowed, device=self.device)] = _prefill_slots(
                    self.model, self.cache, windowed, seqs, range(len(windowed))
                ).float()
                for slot in windowed:
                    self.rows[slot].position = self.window
        advanced = cached + windowed
        self._choose(advanced, logits[torch.tensor(advanced, device=self.device)])
        return advanced

    def _choose(self, slots: list[int], logits: Tensor) -> None:
        """Sample each slot's next token from its logits row (one host sync for all), then record it."""
        tokens = torch.cat([
            sample(logits[i : i + 1], self.rows[slot].generator, self.rows[slot].params, self.seen[slot : slot + 1])
            for i, slot in enumerate(slots)
        ])  # fmt: skip
        self.seen[torch.tensor(slots, device=self.device), tokens] = True
        for slot, token in zip(slots, tokens.tolist()):
            self._accept(self.rows[slot], token)

    @staticmethod
    def _accept(row: Row, token: int) -> None:
        """Append token to row, or finish the row at the end-of-text token, a stop string or max_new_tokens."""
        if token in row.eos_ids:
            row.finish_reason = "eos"
            return
        row.tokens.append(token)
        if row.params.stop and _first_stop(row.decode(row.generated), row.params.stop) >= 0:
            row.finish_reason = "stop"
        elif len(row.generated) >= row.params.max_new_tokens:
            row.finish_reason = "length"


# ----- beam search -----


@torch.no_grad()
def beam_search(
    model: GPT, prompt: Sequence[int], params: SamplingParams, eos_id: EosIds = None, decode: Decode | None = None
) -> list[tuple[list[int], FinishReason]]:
    """Hugging Face's beam search for one prompt: the best params.num_samples (new ids, finish reason), best first.

    Candidates are scored by summed log-probability; a finished hypothesis by that sum / generated_length **
    length_penalty. Each step keeps the 2 * num_beams best continuations so num_beams stay open even when some end.
    """
    _check_prompts(model, [prompt])
    if params.stop and decode is None:
        raise ConfigError("stop strings need a decode function (a tokenizer) to find them in the output")
    eos_ids = end_ids(eos_id)
    n, keep, lp = params.num_beams, 2 * params.num_beams, params.length_penalty
    prompt_len = len(prompt)
    total_len = prompt_len + params.max_new_tokens
    window = _window(model, total_len)
    device, dtype = _device_dtype(model)
    cache = KVCache(_base(model).config, n, window or total_len, device=device, dtype=dtype)
    seqs = torch.full((n, total_len), 0, dtype=torch.long, device=device)
    seqs[:, :prompt_len] = torch.tensor(list(prompt), device=device)
    scores = torch.full((n,), _FINISHED, device=device)
    scores[0] = 0.0  # only the first beam is live at the start, so the beams do not all pick the same tokens
    done_seqs, done_scores = seqs.clone(), torch.full((n,), _FINISHED, device=device)
    done_lens = torch.zeros(n, dtype=torch.long, device=device)
    done_flags = torch.zeros(n, dtype=torch.bool, device=device)
    improvable = True
    seen = torch.zeros(n, _base(model).config.vocab_size, dtype=torch.bool, device=device)
    seen[:, seqs[0, :prompt_len]] = True
    in_top = torch.arange(keep, device=device) < n

    with _inference(model):
        start = list(prompt[-window:]) if window else list(prompt)
        logits = _prefill_slots(model, cache, range(n), [start], [0] * n).expand(n, -1)
        cur = prompt_len
        while True:
            logprobs = logits.float().log_softmax(dim=-1)
            if params.repetition_penalty is not None and params.repetition_penalty != 1.0:
                logprobs = apply_repetition_penalty(logprobs, seen, params.repetition_penalty)
            vocab = logprobs.size(-1)
            top_scores, top_index = torch.topk((logprobs + scores[:, None]).view(-1), keep)
            parents, tokens = top_index // vocab, top_index % vocab
            cand = seqs[parents]
            cand[:, cur] = tokens
            ends = _candidate_ends(cand, tokens, prompt_len, cur, total_len, eos_ids, params.stop, decode)

            # the num_beams best candidates that go on
            live_scores = top_scores + ends.float() * _FINISHED
            chosen = torch.topk(live_scores, n).indices
            seqs, scores, parent_of = cand[chosen], live_scores[chosen], parents[chosen]

            # the candidates among the top num_beams that just ended join the finished hypotheses
            just_done = ends & in_top
            new_scores = top_scores / float(cur + 1 - prompt_len) ** lp
            if bool(done_flags.all()) and params.early_stopping is True:
                new_scores = new_scores + _FINISHED
            if not improvable:
                new_scores = new_scores + _FINISHED
            new_scores = new_scores + (~just_done).float() * _FINISHED
            best = torch.topk(torch.cat([done_scores, new_scores]), n).indices
            done_seqs = torch.cat([done_seqs, cand])[best]
            done_scores = torch.cat([done_scores, new_scores])[best]
            done_lens = torch.cat([done_lens, torch.full((keep,), cur + 1 - prompt_len, device=device)])[best]
            done_flags = torch.cat([done_flags, just_done])[best]

            cur += 1
            improvable = improvable and _can_improve(scores, done_scores, done_flags, cur, total_len, prompt_len,
                                                     params.early_stopping, lp)  # fmt: skip
            if not improvable or bool(ends.all()) or (bool(done_flags.all()) and params.early_stopping is True):
                break
            seen = seen[parent_of]
            seen[torch.arange(n, device=device), seqs[:, cur - 1]] = True
            for t in cache.keys + cache.values:
                t.copy_(t[parent_of])
            if window is not None and cur > window:
                logits = _prefill_slots(model, cache, range(n), seqs[:, cur - window : cur].tolist(), range(n))
            else:
                positions = torch.full((n,), cur - 1, device=device)
                logits = decode_one_token(model, seqs[:, cur - 1 : cur], cache, positions)

    results: list[tuple[list[int], FinishReason]] = []
    for row, length in zip(done_seqs[: params.num_samples].tolist(), done_lens[: params.num_samples].tolist()):
        new = row[prompt_len : prompt_len + length]
        if new and new[-1] in eos_ids:
            results.append((new[:-1], "eos"))
        elif params.stop and _first_stop(decode(new), params.stop) >= 0:
            results.append((new, "stop"))
        else:
            results.append((new, "length"))
    return results


def _candidate_ends(
    cand: Tensor, tokens: Tensor, prompt_len: int, cur: int, total_len: int, eos_ids: tuple[int, ...],
    stops: Sequence[str], decode: Decode | None,
) -> Tensor:  # fmt: skip
    """Which candidates end here: at the end-of-text token, a stop string or the length limit."""
    if cur + 1 >= total_len:
        return torch.ones_like(tokens, dtype=torch.bool)
    ends = torch.isin(tokens, torch.tensor(eos_ids, dtype=tokens.dtype, device=tokens.device))
    if stops:
        rows = cand[:, prompt_len : cur + 1].tolist()
        hits = [_first_stop(decode(r), stops) >= 0 for r in rows]
        ends = ends | torch.tensor(hits, device=tokens.device)
    return ends


def _can_improve(
    scores: Tensor, done_scores: Tensor, done_flags: Tensor, cur: int, total_len: int, prompt_len: int,
    early_stopping: EarlyStopping, length_penalty: float,
) -> bool:  # fmt: skip
    """Hugging Face's test: could the best open beam still beat the worst kept finished hypothesis?"""
    if early_stopping == "never" and length_penalty > 0.0:
        best_length = total_len - prompt_len
    else:
        best_length = cur - prompt_len
    best_possible = scores[0] / float(best_length) ** length_penalty
    worst_done = torch.where(done_flags, done_scores.min(), torch.full_like(done_scores, _FINISHED))
    return bool((best_possible > worst_done).any())


# ----- whole requests -----


@dataclass
class Completion:
    """One generated sequence: its new token ids (no end-of-text token) and why it ended."""

    ids: list[int]
    finish_reason: FinishReason


@dataclass
class Timing:
    """Token counts and wall-clock seconds of the prefill and decode phases."""

    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    compile_seconds: float | None = None  # the one-off compile (and first step) when compile=True
    speculative: Any = None  # a SpeculativeStats when a draft model proposed tokens

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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _cache_len(model: GPT, prompts: Sequence[Sequence[int]], params: SamplingParams, compile: bool = False) -> int:
    """Positions a call needs: the longest prompt plus every new token (a learned-position model: its window).

    For a compiled step the length is rounded up to COMPILE_CACHE_MULTIPLE so that later calls reuse its shapes.
    """
    need = max(len(p) for p in prompts) + params.max_new_tokens
    if compile:
        need = COMPILE_CACHE_MULTIPLE * math.ceil(need / COMPILE_CACHE_MULTIPLE)
    window = _window(model, need)
    return min(need, window) if window else need


def complete(
    model: GPT,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    eos_id: EosIds = None,
    decode: Decode | None = None,
    compile: bool = False,
    draft: GPT | None = None,
    draft_k: int = DRAFT_K,
) -> Result:
    """Generate for a batch of token-id prompts under params; the engine behind generate_ids and generate.

    compile: decode with compiled_decode_step (its one-off cost is timing.compile_seconds). draft: a smaller model
    of the same tokenizer proposing draft_k tokens per target pass (speculative decoding, one row at a time).
    """
    _check_prompts(model, prompts)
    device, _ = _device_dtype(model)
    timing = Timing(prefill_tokens=sum(len(p) for p in prompts))
    if draft is not None:
        return _complete_speculative(model, draft, draft_k, prompts, params, eos_id, decode, timing)
    if params.num_beams > 1:
        start = time.perf_counter()
        completions = [[Completion(ids, reason) for ids, reason in beam_search(model, p, params, eos_id, decode)]
                       for p in prompts]  # fmt: skip
        timing.decode_seconds = time.perf_counter() - start
        timing.decode_tokens = sum(len(c.ids) for row in completions for c in row)
        return Result(completions, timing)
    engine = Engine(model, len(prompts) * params.num_samples, _cache_len(model, prompts, params, compile), compile)
    if compile:
        timing.compile_seconds = engine.warm_up()
    start = time.perf_counter()
    slots = engine.add(prompts, params, eos_id, decode)
    _sync(device)
    timing.prefill_seconds = time.perf_counter() - start
    start = time.perf_counter()
    while engine.step():
        pass
    _sync(device)
    timing.decode_seconds = time.perf_counter() - start
    rows = [engine.rows[slot] for slot in slots]
    timing.decode_tokens = sum(max(len(row.generated) - 1, 0) for row in rows)  # the first came with the prefill
    S = params.num_samples
    completions = [[Completion(row.generated, row.finish_reason) for row in rows[i * S : (i + 1) * S]]
                   for i in range(len(prompts))]  # fmt: skip
    return Result(completions, timing)


def _complete_speculative(
    model: GPT, draft: GPT, k: int, prompts: Sequence[Sequence[int]], params: SamplingParams, eos_id: EosIds,
    decode: Decode | None, timing: Timing,
) -> Result:  # fmt: skip
    """complete() with a draft model: each row decoded speculatively, one after another."""
    from gptkit.speculative import SpeculativeStats, check_draft, fits, speculative_generate

    check_draft(model, draft, params, k)
    need = max(len(p) for p in prompts) + params.max_new_tokens + k
    if not fits(model, draft, need):  # a learned-position window would have to slide: decode without the draft
        log.warning("decoding without the draft: speculative decoding needs prompt + max_new_tokens + draft_k "
                    "(%d) positions, more than a learned-position model's block_size holds", need)  # fmt: skip
        return complete(model, prompts, params, eos_id, decode)
    device, _ = _device_dtype(model)
    timing.speculative = SpeculativeStats()
    completions = []
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        row = []
        for j in range(params.num_samples):
            seed = row_seed(params.seed, i * params.num_samples + j)
            completion, stats = speculative_generate(model, draft, prompt, params, k, eos_id, decode, seed)
            timing.speculative.add(stats)
            row.append(completion)
        completions.append(row)
    _sync(device)
    # Speculation interleaves the phases: everything counts as decoding.
    timing.decode_seconds = time.perf_counter() - start
    timing.decode_tokens = sum(len(c.ids) for row in completions for c in row)
    return Result(completions, timing)


def _shape(per_prompt: list[list[Any]], batched: bool, num_samples: int) -> Any:
    """Unwrap the result to the caller's shape: one item, or a list, per prompt and per sample."""
    items = [row if num_samples > 1 else row[0] for row in per_prompt]
    return items if batched else items[0]


def generate_ids(
    model: GPT,
    prompt_ids: list[int] | list[list[int]],
    max_new_tokens: int = _DEFAULTS.max_new_tokens,
    temperature: float = _DEFAULTS.temperature,
    top_k: int | None = _DEFAULTS.top_k,
    top_p: float | None = _DEFAULTS.top_p,
    min_p: float | None = _DEFAULTS.min_p,
    repetition_penalty: float | None = _DEFAULTS.repetition_penalty,
    stop: str | Sequence[str] | None = None,
    seed: int | None = _DEFAULTS.seed,
    num_beams: int = _DEFAULTS.num_beams,
    num_samples: int = _DEFAULTS.num_samples,
    length_penalty: float = _DEFAULTS.length_penalty,
    early_stopping: EarlyStopping = _DEFAULTS.early_stopping,
    eos_id: EosIds = None,
    tokenizer: Any | None = None,
    compile: bool = False,
    draft: GPT | None = None,
    draft_k: int = DRAFT_K,
) -> list[int] | list[list[int]] | list[list[list[int]]]:
    """The new token ids for one prompt (a list of ids) or a batch (a list of such lists).

    With num_samples > 1 each prompt gives a list of samples. Generation stops at eos_id (an id or several; not
    returned) and at
    stop strings (found by decoding with tokenizer; the ids up to the one completing the string are returned).
    compile, draft and draft_k choose the fast paths of complete().
    """
    params = SamplingParams(
        max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
        repetition_penalty=repetition_penalty, stop=stop, seed=seed, num_beams=num_beams, num_samples=num_samples,
        length_penalty=length_penalty, early_stopping=early_stopping,
    )  # fmt: skip
    batched = bool(prompt_ids) and not isinstance(prompt_ids[0], numbers.Integral)
    prompts = [list(p) for p in prompt_ids] if batched else [list(prompt_ids)]
    if not prompts:
        raise InputError("no prompts given")
    decode = tokenizer.decode if tokenizer is not None else None
    result = complete(model, prompts, params, eos_id, decode, compile=compile, draft=draft, draft_k=draft_k)
    return _shape([[c.ids for c in row] for row in result.completions], batched, params.num_samples)


def encode_prompt(tokenizer: Any, prompt: str) -> list[int]:
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


def completion_text(tokenizer: Any, completion: Completion, stops: Sequence[str]) -> str:
    """The decoded text of a completion, cut before the first stop string."""
    text = tokenizer.decode(completion.ids)
    cut = _first_stop(text, stops)
    return text if cut < 0 else text[:cut]


def generate_text(
    model: GPT,
    tokenizer: Any,
    prompts: Sequence[str],
    params: SamplingParams,
    compile: bool = False,
    draft: GPT | None = None,
    draft_k: int = DRAFT_K,
) -> tuple[list[list[str]], Result]:
    """Texts per prompt (num_samples each) and the full result (ids, finish reasons, timing)."""
    if not prompts:
        raise InputError("no prompts given")
    ids = [encode_prompt(tokenizer, p) for p in prompts]
    result = complete(model, ids, params, tokenizer.eos_ids, tokenizer.decode, compile=compile, draft=draft,
                      draft_k=draft_k)  # fmt: skip
    texts = [[completion_text(tokenizer, c, params.stop) for c in row] for row in result.completions]
    return texts, result


def generate(
    model: GPT,
    tokenizer: Any,
    prompt: str | list[str],
    max_new_tokens: int = _DEFAULTS.max_new_tokens,
    temperature: float = _DEFAULTS.temperature,
    top_k: int | None = _DEFAULTS.top_k,
    top_p: float | None = _DEFAULTS.top_p,
    min_p: float | None = _DEFAULTS.min_p,
    repetition_penalty: float | None = _DEFAULTS.repetition_penalty,
    stop: str | Sequence[str] | None = None,
    seed: int | None = _DEFAULTS.seed,
    num_beams: int = _DEFAULTS.num_beams,
    num_samples: int = _DEFAULTS.num_samples,
    length_penalty: float = _DEFAULTS.length_penalty,
    early_stopping: EarlyStopping = _DEFAULTS.early_stopping,
    compile: bool = False,
    draft: GPT | None = None,
    draft_k: int = DRAFT_K,
) -> str | list[str] | list[list[str]]:
    """The generated text (without the prompt) for a prompt, or a list for a list of prompts.

    With num_samples > 1 each prompt gives a list of samples. Neither the end-of-text token nor a stop string is
    part of the text. compile: a compiled decode step; draft: a small model for speculative decoding (draft_k
    tokens proposed per pass).
    """
    params = SamplingParams(
        max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
        repetition_penalty=repetition_penalty, stop=stop, seed=seed, num_beams=num_beams, num_samples=num_samples,
        length_penalty=length_penalty, early_stopping=early_stopping,
    )  # fmt: skip
    batched = not isinstance(prompt, str)
    texts, _ = generate_text(model, tokenizer, list(prompt) if batched else [prompt], params, compile, draft, draft_k)
    return _shape(texts, batched, params.num_samples)


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


def stream_text(
    model: GPT, tokenizer: Any, prompt: str, params: SamplingParams, compile: bool = False
) -> Iterator[str]:
    """Text pieces as tokens decode (single prompt, one sample, no beams); they join to generate()'s text."""
    if params.num_beams > 1 or params.num_samples > 1:
        raise ConfigError("streaming produces one sequence: use num_beams=1 and num_samples=1")
    ids = encode_prompt(tokenizer, prompt)
    engine = Engine(model, 1, _cache_len(model, [ids], params, compile), compile)
    [slot] = engine.add([ids], params, tokenizer.eos_ids, tokenizer.decode)
    row = engine.rows[slot]
    sent = 0
    while True:
        text = tokenizer.decode(row.generated)
        cut = _first_stop(text, params.stop)
        if cut >= 0:
            text = text[:cut]
        end = len(text) if row.done else visible_end(text, params.stop)
        if end > sent:
            yield text[sent:end]
            sent = end
        if row.done:
            return
        engine.step()


def stream(
    model: GPT,
    tokenizer: Any,
    prompt: str,
    max_new_tokens: int = _DEFAULTS.max_new_tokens,
    temperature: float = _DEFAULTS.temperature,
    top_k: int | None = _DEFAULTS.top_k,
    top_p: float | None = _DEFAULTS.top_p,
    min_p: float | None = _DEFAULTS.min_p,
    repetition_penalty: float | None = _DEFAULTS.repetition_penalty,
    stop: str | Sequence[str] | None = None,
    seed: int | None = _DEFAULTS.seed,
) -> Iterator[str]:
    """Yield the generated text in pieces as it decodes, never splitting a character or showing a stop string."""
    params = SamplingParams(
        max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
        repetition_penalty=repetition_penalty, stop=stop, seed=seed,
    )  # fmt: skip
    return stream_text(model, tokenizer, prompt, params)
