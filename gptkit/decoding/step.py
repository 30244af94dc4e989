"""The model calls of decoding, the only code that runs the model with a KV cache: prefill, extend, decode.

- prefill(model, ids, cache, lengths): right-padded prompts through the model at positions 0.., filling the cache.
- prefill_chunks(model, cache, row, seq, start): one sequence into one cache row, PREFILL_CHUNK tokens per forward at
  positions that are multiples of PREFILL_CHUNK (what the batch engine and its prefix cache use).
- extend(model, tokens, cache, positions): T more tokens per row, row b's first at cache position positions[b]
  (speculative decoding's verification pass); decode_one_token is extend with T = 1.
- compiled(model, fn): such a step compiled with torch.compile, made once per model and step function.

Positions may be one int shared by every row (eager attention then reads only the filled part of the cache) or a
(B,) tensor (fixed shapes every step: what a compiled step takes). Nothing here reads a tensor back to the host.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor

from gptkit.errors import InputError
from gptkit.kv_cache import KVCache
from gptkit.model import GPT
from gptkit.native import library
from gptkit.quantization import is_quantized

Step = Callable[[GPT, Tensor, KVCache, Tensor], Tensor]

# Compiled cache lengths are rounded up to a multiple of this, so requests of nearby lengths share one compiled
# step (a new shape means a new compile); attending over the few extra masked slots costs little.
COMPILE_CACHE_MULTIPLE = 256
COMPILED_VERSIONS = 64  # compiled steps (models x shapes) kept before dynamo would fall back to eager
# Tokens per prefill forward of the batch engine, at positions that are multiples of it, and so the unit of its prefix
# cache: a chunk's keys and values depend only on the tokens up to its end, so a row whose first chunks were copied
# from an earlier request computes the rest exactly as it would have computed them all. Smaller chunks reuse more of
# a shared prefix, larger ones prefill faster: a 1,024-token prompt, GPT-2 small in fp32 on a 2-core AVX2 EPYC,
# prefilled at 355 tokens/s in chunks of 64, 414 in 128, 513 in 256 and 580 in one forward through F.linear. gptkit's
# many-row kernel (csrc/gemm.h) narrowed the gap: in a slower hour of the same machine, 342 tokens/s in chunks of 64
# and 417 in one forward, against F.linear's 225 and 407 (GPTKIT_CPU_KERNELS=0) in that hour.
PREFILL_CHUNK = 64


def base(model: GPT) -> GPT:
    """The model itself when torch.compile wrapped it."""
    return getattr(model, "_orig_mod", model)


def device_dtype(model: GPT) -> tuple[torch.device, torch.dtype]:
    """Where the model's weights live and their dtype (the KV cache follows both)."""
    param = next(base(model).parameters())
    return param.device, param.dtype


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (for timing only)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextmanager
def inference(*models: GPT) -> Iterator[None]:
    """Eval mode, no autograd, and no per-call input check (a device sync) for inputs validated here once."""
    saved = [(base(m), base(m).check_inputs, base(m).training) for m in models]
    for model, _, training in saved:
        model.check_inputs = False
        if training:  # dropout off; toggling walks every module, so only when needed
            model.train(False)
    try:
        with torch.no_grad():
            yield
    finally:
        for model, checked, training in saved:
            model.check_inputs = checked
            if training:
                model.train(True)


def check_prompts(model: GPT, prompts: Sequence[Sequence[int]]) -> None:
    """Raise InputError for no prompts, an empty prompt or a token id outside the model's vocabulary."""
    if not prompts:
        raise InputError("no prompts given")
    vocab = base(model).config.vocab_size
    for i, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise InputError(f"prompt {i} is empty; a prompt needs at least one token")
        bad = [t for t in prompt if isinstance(t, bool) or not (isinstance(t, numbers.Integral) and 0 <= t < vocab)]
        if bad:
            raise InputError(f"token id {bad[0]!r} in prompt {i} is outside the model's vocabulary [0, {vocab})")


def window(model: GPT) -> int | None:
    """Tokens a learned-position model sees at most (its block_size); None for a model without that limit."""
    config = base(model).config
    return config.block_size if config.position == "learned" else None


def cache_len(model: GPT, need: int, compile: bool = False) -> int:
    """Cache positions for sequences of `need` tokens: a learned-position model holds at most its window.

    For a compiled step the length is rounded up to COMPILE_CACHE_MULTIPLE so that later calls reuse its shapes.
    """
    if compile:
        need = COMPILE_CACHE_MULTIPLE * math.ceil(need / COMPILE_CACHE_MULTIPLE)
    limit = window(model)
    return min(need, limit) if limit else need


def new_cache(
    model: GPT, batch_size: int, max_len: int, kv_dtype: torch.dtype | None = None, spare: int = 0
) -> KVCache:
    """A zeroed KV cache for model, on its device and in its dtype (or storing kv_dtype: torch.int8); spare: ring
    slots beyond a window for tokens written and then taken back (gptkit.kv_cache)."""
    device, dtype = device_dtype(model)
    return KVCache(base(model).config, batch_size, max_len, device=device, dtype=dtype, kv_dtype=kv_dtype, spare=spare)


# ----- the model calls -----


def prefill(model: GPT, ids: Tensor, cache: KVCache, lengths: Tensor) -> Tensor:
    """Run right-padded prompts ids (B, T) at positions 0.. into cache; logits (B, V) at each row's last token."""
    return model(ids, cache=cache, start_pos=0, logits_at=lengths - 1)[:, 0]


def prefill_chunks(
    model: GPT,
    cache: KVCache,
    row: int,
    seq: Sequence[int],
    start: int = 0,
    on_block: Callable[[int], None] | None = None,
) -> Tensor:
    """Run seq[start:] into cache row `row` at positions start.., PREFILL_CHUNK tokens per forward; logits (V,) at
    seq's last token. start must be a multiple of PREFILL_CHUNK (positions before it are already in the row).
    on_block(b) runs right after each full chunk b is computed, while a windowed layer's ring still holds it.

    Each chunk runs alone (batch 1, its own positions) so that its result never depends on what else is prefilled
    or on where an earlier computation stopped: the keys, values and logits are the same bit for bit whether the
    first chunks were computed here or copied in.
    """
    if start % PREFILL_CHUNK or not 0 <= start < len(seq):
        raise ValueError(f"a chunked prefill starts at a multiple of {PREFILL_CHUNK} inside the sequence, got {start}")
    device, _ = device_dtype(model)
    last = (len(seq) - 1) // PREFILL_CHUNK * PREFILL_CHUNK  # where the chunk holding the last token begins
    for begin in range(start, last, PREFILL_CHUNK):  # keys and values only: no LM head
        ids = torch.tensor([seq[begin : begin + PREFILL_CHUNK]], device=device)
        base(model).hidden(ids, cache.row(row, begin + PREFILL_CHUNK), begin)
        if on_block is not None:
            on_block(begin // PREFILL_CHUNK)
    ids = torch.tensor([seq[last:]], device=device)
    at = torch.tensor([len(seq) - last - 1], device=device)
    logits = model(ids, cache=cache.row(row, len(seq)), start_pos=last, logits_at=at)[0, 0]
    if on_block is not None and len(seq) % PREFILL_CHUNK == 0:
        on_block(last // PREFILL_CHUNK)
    return logits


def extend(model: GPT, tokens: Tensor, cache: KVCache, positions: Tensor | int) -> Tensor:
    """Logits (B, T, V) for tokens (B, T) written into cache from positions (an int or a (B,) tensor) on."""
    return model(tokens, cache=cache, start_pos=positions)


def decode_one_token(model: GPT, tokens: Tensor, cache: KVCache, positions: Tensor | int) -> Tensor:
    """Logits (B, V) for tokens (B, 1), row b written at cache position positions[b]."""
    return model(tokens, cache=cache, start_pos=positions)[:, -1]


def prefill_rows(
    model: GPT, cache: KVCache, rows: Sequence[int], seqs: Sequence[Sequence[int]], sources: Sequence[int]
) -> Tensor:
    """Prefill seqs in one right-padded forward and copy seq sources[i] into cache row rows[i].

    Several rows may share one source (samples or beams of one prompt): the prompt runs once. Returns the logits
    (len(seqs), V) at each seq's last token.
    """
    device, _ = device_dtype(model)
    lengths = [len(s) for s in seqs]
    T = max(lengths)
    ids = torch.zeros(len(seqs), T, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
    scratch = new_cache(model, len(seqs), T, cache.kv_dtype)
    logits = prefill(model, ids.to(device), scratch, torch.tensor(lengths, device=device))
    index = lambda values: torch.tensor(list(values), device=device)  # noqa: E731
    cache.copy_rows(index(rows), scratch, index(sources), T)
    return logits


# ----- compiled steps -----


def compiled(model: GPT, step: Step = decode_one_token) -> Step:
    """step compiled with torch.compile, made once per model and step function and reused for all their shapes.

    On CPU inductor freezes the weights (constants it can prepack for its matmul kernels), so the model's weights
    must not change after the first compiled call; change them (or its dtype, or quantise it) before compiling.
    On CUDA the step runs as a CUDA graph (mode "reduce-overhead"): one launch per step instead of one per kernel;
    the cache tensors it writes are marked static (their addresses never change) and the logits are copied out of
    the graph's memory, which its next replay overwrites.
    """
    # Imported here, not at the top: torch._dynamo takes a second to import, which every command that never
    # compiles (a CPU training run, generate without --compile) would otherwise pay at start-up.
    import torch._dynamo.config
    import torch._inductor.config

    model_base = base(model)
    cached = model_base.__dict__.setdefault("_gptkit_compiled_steps", {})
    if step.__name__ in cached:
        return cached[step.__name__]
    device, dtype = device_dtype(model_base)
    cuda = device.type == "cuda"
    graph = torch.compile(step, dynamic=False, mode="reduce-overhead" if cuda else None)
    int8 = is_quantized(model_base)
    if device.type == "cpu":
        library.prepare()  # built, measured (or ruled out) now: a compiled graph only reads the answers

    def run(model: GPT, tokens: Tensor, cache: KVCache, positions: Tensor) -> Tensor:
        # Inductor reads its options from its global config when it compiles (torch.compile's options= does
        # not reach `freezing`), so they are set around each call rather than for the whole process. Every
        # model and shape is one more compiled version of the same function: past dynamo's default limit of 8
        # it would fall back to eager without a word.
        autotune = _autotune(device, dtype, int8, tokens.size(0))
        # The autotuner writes a table of kernel timings to stderr per matrix shape unless told not to.
        inductor = dict(
            freezing=device.type == "cpu",
            max_autotune=autotune,
            autotune_num_choices_displayed=0,
            max_autotune_report_choices_stats=False,
        )
        with torch._inductor.config.patch(inductor), torch._dynamo.config.patch(recompile_limit=COMPILED_VERSIONS):
            if cuda:
                for t in cache.tensors:
                    torch._dynamo.mark_static_address(t)
                torch.compiler.cudagraph_mark_step_begin()
                return graph(model, tokens, cache, positions).clone()
            return graph(model, tokens, cache, positions)

    cached[step.__name__] = run  # a plain attribute: not a submodule, not saved
    return run


def _autotune(device: torch.device, dtype: torch.dtype, int8: bool, batch: int) -> bool:
    """Whether a compiled step should let inductor time its own C++ GEMM kernels against the libraries'.

    Measured on a 2-core AVX-512 CPU (GPT-2 small, benchmarks/bench_generate.py): inductor's template beats MKL and
    oneDNN for fp32 and int8 weights at batch 1 and 8 (+15-60% tokens/s) and for bf16 at batch 1 (+9%), but loses
    to oneDNN's bf16 GEMM at batch 8 (-15%), which the autotuner, timing each matmul alone on warm caches, does not
    see. It roughly triples the one-off compile time. On CUDA the default kernels are kept (not measured here).
    (Where gptkit's own kernels run, gptkit.native, decoding's products bypass matmul and this choice.)
    """
    return device.type == "cpu" and (int8 or dtype != torch.bfloat16 or batch == 1)
