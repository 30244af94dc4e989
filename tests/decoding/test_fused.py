"""The fused CPU decode step (gptkit.decoding.fused): the eager step's logits and tokens on every variant it covers,
in every weight and cache format, and the eager step wherever it does not apply."""

from __future__ import annotations

import logging

import pytest
import torch
from helpers import TINY, VARIANTS
from torch import nn

from gptkit.adapters import add_lora
from gptkit.config import ModelConfig
from gptkit.decoding import batch, fused
from gptkit.decoding.api import complete, generate_ids
from gptkit.decoding.sampling import SamplingParams
from gptkit.decoding.step import decode_one_token, inference, prefill
from gptkit.errors import GptkitError
from gptkit.kv_cache import KVCache, quantize_rows
from gptkit.model import GPT, Linear
from gptkit.native import build, cache, choices, cpu, library
from gptkit.quantization import quantize

needs_kernels = pytest.mark.skipif(not library.load(), reason="this CPU has neither AVX2 nor AVX-512")


WIDE = {f"fused_step_{rows}_rows": True for rows in fused.WIDE_ROWS}


@pytest.fixture(autouse=True)
def fused_chosen(monkeypatch):
    """The fused step as if measured faster here, at one row and at every batch size (it is chosen per machine;
    these tests check what it computes)."""
    if library.load():
        monkeypatch.setitem(library.STATE, "choices", dict(library.choices(), fused_step=True, **WIDE))


COVERED = {
    name: v
    for name, v in VARIANTS.items()
    if v.get("norm_position", "pre") == "pre" and v.get("position") != "sinusoidal"
}
COVERED["relu"] = dict(TINY, activation="relu", n_kv_head=2, position="rope")
UNCOVERED = {"post-norm": dict(TINY, norm_position="post"), "sinusoidal": dict(TINY, position="sinusoidal")}


def sharpened(config: ModelConfig, scale: float = 8.0) -> GPT:
    """A random model whose logits are far apart (greedy choices not near ties), in eval mode."""
    model = GPT(config).eval()
    with torch.no_grad():
        model.norm_f.weight.mul_(scale)
    return model


def filled_caches(model: GPT, rows: int, kv_dtype: torch.dtype | None, seed: int = 0) -> list[KVCache]:
    """Two equal caches of `rows` rows whose every position holds random keys and values, as a long conversation
    leaves them (an int8 cache: random codes and scales)."""
    config = model.config
    caches = [
        KVCache(config, rows, config.block_size, dtype=model.tok_emb.weight.dtype, kv_dtype=kv_dtype) for _ in range(2)
    ]
    g = torch.Generator().manual_seed(seed)
    for first, second in zip(caches[0].tensors, caches[1].tensors):
        if first.dtype == torch.int8:
            fill = torch.randint(-127, 128, first.shape, generator=g, dtype=torch.int8)
        elif first.dim() == 3:  # an int8 cache's scales, (rows, heads, positions)
            fill = 0.001 + 0.02 * torch.rand(first.shape, generator=g)
        else:
            fill = 2.0 * torch.randn(first.shape, generator=g)
        first.copy_(fill)
        second.copy_(fill)
    return caches


def steps(model: GPT, kv_dtype: torch.dtype | None = None, rows: int = 3, length: int = 10, start: int | None = None):
    """(eager logits, fused logits, eager cache, fused cache, the (row, position) slots written) over `length` steps
    of `rows` rows, each path on its own cache: empty caches and rows at positions t, t // 2, t - 3; or, from `start`
    on, caches filled with random keys and values and row r at start + 3 r + t."""
    config = model.config
    if start is None:
        dtype = model.tok_emb.weight.dtype
        caches = [KVCache(config, rows, config.block_size, dtype=dtype, kv_dtype=kv_dtype) for _ in range(2)]
    else:
        caches = filled_caches(model, rows, kv_dtype)
    step = fused.step_for(model)
    assert step is not None
    g = torch.Generator().manual_seed(0)
    eager, native = [], []
    written = torch.zeros(rows, config.block_size, dtype=torch.bool)
    with inference(model):
        for t in range(length):
            tokens = torch.randint(0, config.vocab_size, (rows, 1), generator=g)
            if start is None:
                positions = torch.tensor([t, t // 2, max(t - 3, 0)])[:rows]
            else:
                positions = start + 3 * torch.arange(rows) + t
            written[torch.arange(rows), positions] = True
            eager.append(decode_one_token(model, tokens, caches[0], positions).float())
            native.append(step(model, tokens, caches[1], positions).float())
    return torch.stack(eager), torch.stack(native), caches[0], caches[1], written


def differences(
    eager: torch.Tensor, native: torch.Tensor, eager_cache: KVCache, native_cache: KVCache, written: torch.Tensor
) -> dict[str, float]:
    """How far the fused step's results lie from the eager step's: the logits, over their largest magnitude, and the
    fraction of greedy tokens that differ; over the cache slots the steps wrote, a float cache over its largest
    value, an int8 cache's codes (the most steps apart, and the fraction apart) and its scales (relative)."""
    found = {
        "logits": float((native - eager).abs().max() / eager.abs().max()),
        "tokens differ": float((native.argmax(-1) != eager.argmax(-1)).float().mean()),
        "cache": 0.0,
        "codes apart": 0.0,
        "fraction apart": 0.0,
        "scales": 0.0,
    }
    for a, b in zip(eager_cache.tensors, native_cache.tensors):
        a, b = a.transpose(1, 2)[written], b.transpose(1, 2)[written]  # (slots, heads[, head_dim])
        if a.dtype == torch.int8:
            apart = (a.int() - b.int()).abs()
            found["codes apart"] = max(found["codes apart"], float(apart.max()))
            found["fraction apart"] = max(found["fraction apart"], float((apart > 0).float().mean()))
        elif a.dim() == 2:  # an int8 cache's scales
            found["scales"] = max(found["scales"], float(((a - b).abs() / a.abs()).max()))
        else:
            found["cache"] = max(found["cache"], float((a.float() - b.float()).abs().max() / a.float().abs().max()))
    return found


# How far the fused step may lie from the eager one (differences() says what each measures), by weights. Measured
# over seeds 0-19 of every test below, on AVX-512 and AVX2 builds, at 1 to 3 threads:
# - fp32 weights: logits 1.9e-6 apart (the same sums in another order, and an int8 code one step apart moving the
#   attention), float caches 6.0e-7, int8 caches one step apart in at most 5.8e-4 of the codes written (where
#   v * 127 / max|v| lies within fp32's rounding of a half-integer) and scales 1.6e-6; greedy tokens always equal.
#   The limits are 3 to 5 times those.
# - int8 and int4 weights: the same, except where an activation's rounding to int8 (per block of 32, on both paths)
#   lands on either side of a boundary: it moves one step (1/127 of its block's largest), and with it (measured at 8
#   rows past position 1,900) the logits by up to 4.4e-3, a key's scale by 1.3e-3 and 5.5e-3 of the codes by one
#   step; greedy tokens always equal. The limits are 2 to 4 times those.
# - bf16 weights: the eager step rounds activations to bf16 after every operator (2^-8 = 3.9e-3 at most each time),
#   the fused one keeps fp32: logits 7.9e-3 apart, caches 7.7e-3, and 1 greedy token in 30 differs, where the top two
#   logits lie that close. The limits are about twice those.
TOLERANCE = {
    "fp32": {
        "logits": 1e-5,
        "tokens differ": 0,
        "cache": 2e-6,
        "codes apart": 1,
        "fraction apart": 2e-3,
        "scales": 5e-6,
    },
    "quantised": {
        "logits": 1e-2,
        "tokens differ": 0,
        "cache": 5e-3,
        "codes apart": 1,
        "fraction apart": 2e-2,
        "scales": 5e-3,
    },
    "bf16": {
        "logits": 1.5e-2,
        "tokens differ": 1 / 30,
        "cache": 1.5e-2,
        "codes apart": 0,
        "fraction apart": 0,
        "scales": 0,
    },
}


def assert_agree(
    eager: torch.Tensor,
    native: torch.Tensor,
    eager_cache: KVCache,
    native_cache: KVCache,
    written: torch.Tensor,
    weights: str,
) -> None:
    """The fused step's logits, tokens and cache lie within TOLERANCE[weights] of the eager step's."""
    found = differences(eager, native, eager_cache, native_cache, written)
    assert all(found[name] <= limit for name, limit in TOLERANCE[weights].items()), found


@needs_kernels
@pytest.mark.parametrize("name", list(COVERED))
def test_the_fused_step_gives_the_eager_steps_logits_and_cache(name):
    model = sharpened(ModelConfig(**COVERED[name]))
    assert fused.uncovered(model) is None
    assert_agree(*steps(model), "fp32")


# Shapes where the step's vector loops run whole and with remainders: llama-style grouped heads of 64 values, and
# heads of 36 (not a power of two: a remainder after 16- and 8-lane vectors); the other sizes small, so each case
# runs in well under a second.
LONG = {
    "llama-gqa, heads of 64": dict(VARIANTS["llama-gqa"], n_head=4, n_kv_head=2, n_embd=256, ffn_hidden=64),
    "gpt2, heads of 36": dict(VARIANTS["gpt2"], n_head=2, n_embd=72, ffn_hidden=64),
}


@needs_kernels
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("kv_dtype", [None, torch.int8], ids=["fp32 cache", "int8 cache"])
@pytest.mark.parametrize("name", list(LONG))
def test_the_fused_step_at_long_positions_and_full_rows_on_every_thread_count(name, kv_dtype, threads):
    """8 rows past position 1,900 over caches full of keys (the attention and softmax loops run whole vectors), with
    the step's OpenMP region split over 1, 2 and 3 threads (the suite itself runs on one)."""
    model = sharpened(ModelConfig(**dict(LONG[name], vocab_size=64, block_size=2048)))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        result = steps(model, kv_dtype, rows=fused.MAX_ROWS, length=3, start=1900)
    finally:
        torch.set_num_threads(before)
    assert_agree(*result, "fp32")


@needs_kernels
@pytest.mark.parametrize("name", ["gpt2", "llama-gqa"])
def test_greedy_tokens_are_the_eager_steps(name, monkeypatch):
    model = sharpened(ModelConfig(**dict(VARIANTS[name], block_size=64)))
    prompts = [[3, 1, 4], [1, 5, 9, 2, 6], [5]]
    params = SamplingParams(max_new_tokens=20, temperature=0)
    calls = []
    real = fused.step_for
    monkeypatch.setattr(fused, "step_for", lambda m: calls.append(1) or real(m))
    with_fused = complete(model, prompts, params).completions
    assert calls and real(model) is not None
    monkeypatch.setattr(fused, "step_for", lambda m: None)
    assert complete(model, prompts, params).completions == with_fused


@needs_kernels
@pytest.mark.parametrize("form", ["bf16", "int8", "int4", "int8 cache", "int4 + int8 cache"])
def test_every_weight_and_cache_format_decodes_as_the_eager_step(form):
    """Within TOLERANCE for the weights (why each differs: see there); "int8 cache" runs int8 weights too."""
    config = ModelConfig(**dict(VARIANTS["llama-gqa"], block_size=64))
    model = sharpened(config)
    weights = "bf16" if form == "bf16" else "quantised"
    model = model.to(torch.bfloat16) if form == "bf16" else quantize(model, form[:4])
    kv_dtype = torch.int8 if "cache" in form else None
    result = steps(model, kv_dtype)
    assert_agree(*result, weights)
    if kv_dtype is not None:
        assert result[3].keys[0].dtype == torch.int8 and len(result[3].key_scales) == config.n_layer


@needs_kernels
@pytest.mark.parametrize("name", list(UNCOVERED))
def test_what_the_fused_step_does_not_cover_decodes_eagerly_and_says_why_once(name, caplog):
    model = GPT(ModelConfig(**UNCOVERED[name])).eval()
    assert fused.uncovered(model) is not None
    fused._LOGGED.clear()
    with caplog.at_level(logging.WARNING, logger="gptkit.decoding"):
        first = generate_ids(model, [1, 2, 3], max_new_tokens=5, temperature=0)
        assert generate_ids(model, [1, 2, 3], max_new_tokens=5, temperature=0) == first
    said = [r.getMessage() for r in caplog.records if "fused CPU step does not cover" in r.getMessage()]
    assert len(said) == 1 and fused.uncovered(model) in said[0]


@needs_kernels
@pytest.mark.parametrize("rows, fused_steps", [(12, True), (20, False)])
def test_a_batch_decodes_fused_up_to_the_rows_measured_faster_and_eagerly_past_them(rows, fused_steps, monkeypatch):
    """Measured faster at 16 rows but not at 32: 12 rows decode fused (each row's tokens those it gets alone), 20
    eagerly."""
    choices = dict(library.choices(), fused_step_16_rows=True, fused_step_32_rows=False)
    monkeypatch.setitem(library.STATE, "choices", choices)
    assert [fused.covers(n) for n in (8, 9, 16, 17, 1000)] == [True, True, True, False, False]
    eager = []
    monkeypatch.setattr(batch, "decode_one_token", lambda *args: eager.append(1) or decode_one_token(*args))
    model = sharpened(ModelConfig(**dict(VARIANTS["gpt2"], block_size=64)))
    prompts = [[i % 50, (3 * i + 1) % 50] for i in range(rows)]
    batched = generate_ids(model, prompts, max_new_tokens=6, temperature=0)
    assert bool(eager) != fused_steps
    monkeypatch.setattr(batch, "decode_one_token", decode_one_token)
    assert batched == [generate_ids(model, p, max_new_tokens=6, temperature=0) for p in prompts]


def test_batches_past_max_rows_are_measured_once_per_size_in_turn(monkeypatch):
    """covers() times the fused step at each of WIDE_ROWS up to the batch's size, stopping at the first it loses."""
    timed = []
    faster_up_to = 32
    monkeypatch.setattr(fused, "_faster_than_eager", lambda rows: timed.append(rows) or rows <= faster_up_to)
    monkeypatch.setattr(choices, "record", lambda name, measure: measure())  # (not kept in choices.json)
    monkeypatch.delenv(build.DISABLE_VARIABLE, raising=False)  # =1 would choose without measuring
    monkeypatch.setitem(library.STATE, "library", True)
    monkeypatch.setitem(library.STATE, "choices", {"fused_step": True})
    assert fused.covers(fused.MAX_ROWS) and timed == []  # never measured up to MAX_ROWS
    assert fused.covers(20) and timed == [16, 32]
    assert fused.covers(32) and not fused.covers(33) and timed == [16, 32, 64]  # 64 lost: not timed again
    assert not fused.covers(500) and timed == [16, 32, 64]


# Formats whose wide products take different paths in csrc/kernels.h: fp32 in register tiles, the others in slices of
# 8 rows over each tile of 8 weight rows.
WIDE_FORMATS = ["fp32", "bf16", "int8", "int4", "int8 cache"]


@needs_kernels
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("form, rows", [(form, 19) for form in WIDE_FORMATS] + [("fp32", 7)])
def test_a_wide_batch_gives_each_row_the_logits_it_gets_alone(form, rows, threads):
    """19 rows (fp32's tiles of 2 or 4 rows and slices of 8 both end short; vocab 61 ends a tile of 6 weight rows short;
    fp32 also at 7 rows, which go through its tiles too, products.h's kTilesFromRows) at their
    own positions over caches of random keys: each row's logits and cache are the same to the bit as that row
    decoded alone (which the tests above hold to the eager step), and fp32's within TOLERANCE of the eager step's
    (past 8 rows the eager step's own int8 and bf16 products round activations to bf16, further from both)."""
    # fp32: rows of 72 and 40 values (the products' scalar tails run); the others: multiples of 32, as int4 needs.
    widths = dict(n_embd=72, ffn_hidden=40) if form == "fp32" else dict(n_embd=64, ffn_hidden=96)
    config = ModelConfig(**dict(VARIANTS["gpt2"], n_head=2, vocab_size=61, block_size=64, **widths))
    model = sharpened(config)
    model = model.to(torch.bfloat16) if form == "bf16" else quantize(model, form[:4]) if form != "fp32" else model
    kv_dtype = torch.int8 if "cache" in form else None
    eager_cache, wide_cache = filled_caches(model, rows, kv_dtype)
    alone_cache = filled_caches(model, rows, kv_dtype)[0]
    tokens = torch.randint(0, config.vocab_size, (rows, 1), generator=torch.Generator().manual_seed(0))
    positions = 5 + 2 * torch.arange(rows)
    step = fused.step_for(model)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with inference(model):
            wide = step(model, tokens, wide_cache, positions)
            alone = torch.cat(
                [step(model, tokens[i : i + 1], alone_cache.row(i, 64), positions[i : i + 1]) for i in range(rows)]
            )
            eager = decode_one_token(model, tokens, eager_cache, positions) if form == "fp32" else None
    finally:
        torch.set_num_threads(before)
    assert torch.equal(wide, alone)
    assert all(torch.equal(a, b) for a, b in zip(wide_cache.tensors, alone_cache.tensors))
    if form == "fp32":
        written = torch.zeros(rows, config.block_size, dtype=torch.bool)
        written[torch.arange(rows), positions] = True
        assert_agree(eager[None], wide[None], eager_cache, wide_cache, written, "fp32")


def test_an_int8_cache_stores_each_head_vector_with_its_own_scale():
    v = torch.randn(2, 3, 5, 16) * torch.logspace(-2, 1, 5)[None, None, :, None]  # positions of very different size
    q, scales = quantize_rows(v)
    assert q.dtype == torch.int8 and scales.shape == (2, 3, 5)
    assert int(q.abs().amax(-1).min()) == 127  # every vector uses the whole range
    error = (q.float() * scales[..., None] - v).abs()
    assert bool((error <= scales[..., None] / 2 + 1e-7).all())  # at most half a step of its own scale


def test_an_int8_cache_decodes_close_to_the_full_precision_one():
    config = ModelConfig(**dict(VARIANTS["llama-gqa"], block_size=64))
    model = sharpened(config)
    ids = torch.randint(0, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    results = []
    for kv_dtype in (None, torch.int8):
        cache = KVCache(config, 2, 64, kv_dtype=kv_dtype)
        with inference(model):
            logits = [prefill(model, ids[:, :6], cache, torch.tensor([6, 6]))]
            for t in range(6, 12):
                logits.append(decode_one_token(model, ids[:, t : t + 1], cache, t))
        results.append((torch.stack(logits), cache))
    (full, full_cache), (int8, int8_cache) = results
    vectors = 2 * config.n_layer * 2 * config.n_kv_head * 64  # keys and values, layers, rows, heads, positions
    assert int8_cache.nbytes == full_cache.nbytes // 4 + 4 * vectors  # a quarter of fp32, and a scale per vector
    assert (int8 - full).abs().max() <= 0.02 * full.abs().max()
    assert int8_cache.kv_dtype == torch.int8 and full_cache.kv_dtype is None


def test_a_first_decode_does_not_wait_for_the_kernels_to_build(monkeypatch, tmp_path):
    import threading

    release = threading.Event()

    class SlowBuilder:  # a builder process that runs as long as the test needs, then fails
        def __init__(self, *_) -> None:
            pass

        def poll(self) -> int | None:
            return 1 if release.is_set() else None

        returncode = property(poll)

        def wait(self) -> int | None:
            release.wait(30)
            return self.poll()

    monkeypatch.setattr(library, "STATE", {})
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # an empty kernel cache: the library is built
    monkeypatch.setattr(cpu, "cpu_flags", lambda: {"avx2", "fma", "f16c"})
    monkeypatch.delenv(cpu.ISA_VARIABLE, raising=False)
    monkeypatch.delenv(build.DISABLE_VARIABLE, raising=False)
    monkeypatch.setenv(choices.UPCAST_VARIABLE, "0")
    monkeypatch.setattr(cache, "spawn_build", SlowBuilder)
    model = sharpened(ModelConfig(**TINY))
    try:
        out = generate_ids(model, [1, 2, 3], max_new_tokens=4, temperature=0)  # decodes while the build runs
        assert len(out) == 4 and library.building()
    finally:
        release.set()
        library.prepare()
    assert not library.building() and library.STATE["library"] is False


# What the C++ step does not compute: each is refused by name, and decoding falls back to the eager step.
NOT_NATIVE = {
    "dynamic": dict(TINY, position="rope", rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
    "relu2": dict(TINY, activation="relu2"),
    "sinusoidal": dict(TINY, position="sinusoidal"),
}


def greedy_by_forward(model: GPT, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens from full forward passes (no cache, no decoding code)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt) :]


@pytest.mark.parametrize("name", list(NOT_NATIVE))
def test_options_the_native_step_does_not_compute_are_refused_and_decode_eagerly(name):
    model = sharpened(ModelConfig(**NOT_NATIVE[name]))
    reason = fused.uncovered(model)
    assert reason is not None and name in reason
    assert fused.step_for(model) is None
    prompt = [3, 1, 4, 1, 5]
    assert generate_ids(model, prompt, max_new_tokens=8, temperature=0) == greedy_by_forward(model, prompt, 8)


class PrefixTuning(nn.Module):
    """A module a method adds to a block (learned prefix vectors): the fused step knows nothing of it."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.prefix = nn.Parameter(torch.randn(4, width))


class Offset(nn.Module):
    """A layer wrapped from outside: its output shifted by a learned vector (the model's own forward changes)."""

    def __init__(self, inner: nn.Module, width: int) -> None:
        super().__init__()
        self.inner, self.shift = inner, nn.Parameter(torch.full((width,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) + self.shift


def _set(module: nn.Module, name: str, value: object) -> None:
    setattr(module, name, value)


WIDTH = TINY["n_embd"]
# How a method may change a model, and the reason the fused step gives for refusing it.
CHANGED = {
    "a module added to a block": (
        lambda m: _set(m.blocks[0].attn, "prefix", PrefixTuning(WIDTH)),
        "blocks.0.attn.prefix (PrefixTuning)",
    ),
    "attn.proj wrapped": (
        lambda m: _set(m.blocks[1].attn, "proj", Offset(m.blocks[1].attn.proj, WIDTH)),
        "blocks.1.attn.proj (Offset)",
    ),
    "a norm wrapped": (
        lambda m: _set(m.blocks[0], "norm2", Offset(m.blocks[0].norm2, WIDTH)),
        "blocks.0.norm2 (Offset)",
    ),
    "LoRA": (lambda m: add_lora(m, 2, 4.0, 0.0, "attention"), "blocks.0.attn.qkv (LoRALinear)"),
    "a parameter added to a block": (
        lambda m: _set(m.blocks[1], "gate", nn.Parameter(torch.ones(1))),
        "the parameter blocks.1.gate, which it does not read",
    ),
    "a buffer added to a layer": (
        lambda m: m.blocks[0].mlp.register_buffer("scale", torch.ones(1)),
        "the buffer blocks.0.mlp.scale, which it does not read",
    ),
    "a plain layer added to a block": (
        lambda m: _set(m.blocks[0].mlp, "extra", Linear(WIDTH, WIDTH)),
        "the parameter blocks.0.mlp.extra.weight, which it does not read",
    ),
}


@needs_kernels
@pytest.mark.parametrize("name", list(CHANGED))
def test_a_model_holding_what_the_step_does_not_compute_is_refused_by_path_and_decodes_eagerly(name):
    model = sharpened(ModelConfig(**dict(VARIANTS["gpt2"], block_size=64)))
    assert fused.uncovered(model) is None and fused.step_for(model) is not None
    change, reason = CHANGED[name]
    change(model)
    assert fused.uncovered(model) == reason
    assert fused.step_for(model) is None
    prompt = [3, 1, 4, 1, 5]
    assert generate_ids(model, prompt, max_new_tokens=8, temperature=0) == greedy_by_forward(model, prompt, 8)


def padded(config: ModelConfig, vocab_multiple: int = 16) -> GPT:
    """A sharpened model whose vocabulary is padded, its padded head rows pairs v, -v of large random directions:
    a padded logit that leaked out would win every argmax."""
    model = sharpened(ModelConfig(**dict(config.to_dict(), vocab_multiple=vocab_multiple)))
    vocab, extra = config.vocab_size, model.config.padded_vocab_size - config.vocab_size
    with torch.no_grad():
        directions = torch.randn(extra // 2 + 1, config.n_embd)
        model.lm_head.weight[vocab:] = 100.0 * torch.cat([directions, -directions])[:extra]
        leaked = model.lm_head(model.hidden(torch.arange(vocab)[:, None]))  # (V, 1, padded V)
        assert bool((leaked.argmax(-1) >= vocab).all())
    return model


@needs_kernels
@pytest.mark.parametrize("name", ["gpt2", "llama-gqa"])
def test_a_padded_vocabulary_decodes_fused_as_eager_and_never_yields_a_padded_id(name):
    model = padded(ModelConfig(**dict(VARIANTS[name], block_size=64)))
    assert fused.uncovered(model) is None  # the step computes the padded head; its extra logits are dropped
    eager, native, *_ = steps(model)
    assert native.shape[-1] == model.config.vocab_size
    torch.testing.assert_close(native, eager, atol=1e-4, rtol=0)
    prompt = [3, 1, 4, 1, 5]
    greedy = generate_ids(model, prompt, max_new_tokens=8, temperature=0)
    assert greedy == greedy_by_forward(model, prompt, 8)
    sampled = generate_ids(model, [prompt] * 4, max_new_tokens=16, temperature=2.0, seed=0)
    assert max(max(row) for row in sampled) < model.config.vocab_size


def _served(model: GPT, index: int, targets: str, rank: int, seed: int) -> None:
    """Adapter `index` with random A and B over model's `targets` layers, as `gptkit serve --lora` adds one."""
    from gptkit.adapters import target_paths
    from gptkit.multi_lora import serve_adapter

    generator, state = torch.Generator().manual_seed(seed), {}
    for name, module in model.named_modules():
        if any(name.endswith(path) for path in target_paths(targets)) and name.startswith("blocks."):
            layer = getattr(module, "base", module)
            state[f"{name}.lora_A"] = torch.randn(rank, layer.in_features, generator=generator) * 0.3
            state[f"{name}.lora_B"] = torch.randn(layer.out_features, rank, generator=generator) * 0.3
    serve_adapter(model, index, state, {"rank": rank, "alpha": 2.0 * rank, "targets": targets}, f"adapter {index}")


@needs_kernels
@pytest.mark.parametrize("activation, threads", [("gelu", 1), ("swiglu", 3)])
def test_served_adapters_decode_in_the_fused_step_each_row_its_own(activation, threads):
    """Rows of base, adapter 1 (all layers, rank 17: past one vector of the step's rank dots) and adapter 2
    (attention only) in one fused step, 40 wide (a vector tail): each row's logits and cache agree with the eager
    step's (AdapterSet layers) within the fp32 tolerance, and are the same to the bit as that row decoded alone; an
    adapter added, or removed and served again, after the step was made is used; an unknown one is an error."""
    from gptkit.multi_lora import remove_adapter, rows_using

    config = ModelConfig(**dict(TINY, n_embd=40, activation=activation, vocab_size=61, block_size=64))
    model = sharpened(config)
    _served(model, 1, "all", 17, seed=1)
    step = fused.step_for(model)
    assert step is not None
    _served(model, 2, "attention", 2, seed=2)  # after the step was made
    rows, choice = 7, [0, 1, 2, 1, 0, 2, 1]
    tokens = torch.randint(0, config.vocab_size, (rows, 1), generator=torch.Generator().manual_seed(0))
    positions = 5 + 2 * torch.arange(rows)
    written = torch.zeros(rows, config.block_size, dtype=torch.bool)
    written[torch.arange(rows), positions] = True

    def decode(adapters: list[int]) -> tuple[torch.Tensor, ...]:
        eager_cache, fused_cache = filled_caches(model, rows, None)
        alone_cache = filled_caches(model, rows, None)[0]
        with inference(model), rows_using(model, adapters):
            eager = decode_one_token(model, tokens, eager_cache, positions)
            together = step(model, tokens, fused_cache, positions)
        alone = []
        for i in range(rows):
            with inference(model), rows_using(model, [adapters[i]]):
                alone.append(step(model, tokens[i : i + 1], alone_cache.row(i, 64), positions[i : i + 1]))
        assert torch.equal(together, torch.cat(alone))
        assert_agree(eager[None], together[None], eager_cache, fused_cache, written, "fp32")
        return together

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        together, base_only = decode(choice), decode([0] * rows)
        changed = [not torch.equal(together[i], base_only[i]) for i in range(rows)]
        assert changed == [c != 0 for c in choice]  # the adapters' rows moved, the base's did not
        remove_adapter(model, 2)
        _served(model, 2, "attention", 2, seed=3)  # the same number, other weights
        again = decode(choice)
        assert [not torch.equal(again[i], together[i]) for i in range(rows)] == [c == 2 for c in choice]
        with pytest.raises(GptkitError, match="adapter 5 is not served"), rows_using(model, [0, 5]):
            pass
    finally:
        torch.set_num_threads(before)


def test_a_served_adapter_outside_the_block_layers_is_refused():
    from gptkit.multi_lora import AdapterSet

    model = sharpened(ModelConfig(**TINY))
    model.lm_head = AdapterSet(model.lm_head)
    assert fused.uncovered(model) == "an adapter on lm_head"
