"""The fused CPU decode step (gptkit.decoding.fused): the eager step's logits and tokens on every variant it covers,
in every weight and cache format, and the eager step wherever it does not apply."""

from __future__ import annotations

import logging

import pytest
import torch

from gptkit import cpu_kernels
from gptkit.config import ModelConfig
from gptkit.decoding import fused
from gptkit.decoding.api import complete, generate_ids
from gptkit.decoding.sampling import SamplingParams
from gptkit.decoding.step import decode_one_token, inference, prefill
from gptkit.kv_cache import KVCache, quantize_rows
from gptkit.model import GPT
from gptkit.quantization import quantize

from conftest import TINY, VARIANTS

needs_kernels = pytest.mark.skipif(not cpu_kernels.load(), reason="this CPU has neither AVX2 nor AVX-512")


@pytest.fixture(autouse=True)
def fused_chosen(monkeypatch):
    """The fused step as if measured faster here (it is chosen per machine; these tests check what it computes)."""
    if cpu_kernels.load():
        monkeypatch.setitem(cpu_kernels._STATE, "choices", dict(cpu_kernels.choices(), fused_step=True))
COVERED = {name: v for name, v in VARIANTS.items()
           if v.get("norm_position", "pre") == "pre" and v.get("position") != "sinusoidal"}  # fmt: skip
COVERED["relu"] = dict(TINY, activation="relu", n_kv_head=2, position="rope")
UNCOVERED = {"post-norm": dict(TINY, norm_position="post"), "sinusoidal": dict(TINY, position="sinusoidal")}


def sharpened(config: ModelConfig, scale: float = 8.0) -> GPT:
    """A random model whose logits are far apart (greedy choices not near ties), in eval mode."""
    model = GPT(config).eval()
    with torch.no_grad():
        model.norm_f.weight.mul_(scale)
    return model


def steps(model: GPT, kv_dtype: torch.dtype | None = None, rows: int = 3, length: int = 10):
    """(eager logits, fused logits, eager cache, fused cache) over `length` steps of `rows` rows at their own
    positions, each path on its own cache."""
    config = model.config
    dtype = model.tok_emb.weight.dtype
    caches = [KVCache(config, rows, config.block_size, dtype=dtype, kv_dtype=kv_dtype) for _ in range(2)]
    step = fused.step_for(model)
    assert step is not None
    g = torch.Generator().manual_seed(0)
    eager, native = [], []
    with inference(model):
        for t in range(length):
            tokens = torch.randint(0, config.vocab_size, (rows, 1), generator=g)
            positions = torch.tensor([t, t // 2, max(t - 3, 0)])[:rows]
            eager.append(decode_one_token(model, tokens, caches[0], positions).float())
            native.append(step(model, tokens, caches[1], positions).float())
    return torch.stack(eager), torch.stack(native), caches[0], caches[1]


@needs_kernels
@pytest.mark.parametrize("name", list(COVERED))
def test_the_fused_step_gives_the_eager_steps_logits_and_cache(name):
    model = GPT(ModelConfig(**COVERED[name])).eval()
    assert fused.uncovered(model) is None
    eager, native, eager_cache, native_cache = steps(model)
    torch.testing.assert_close(native, eager, atol=1e-4, rtol=0)
    for a, b in zip(eager_cache.tensors, native_cache.tensors):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=0)


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
    """bf16: the fused step keeps fp32 activations where the eager one rounds them to bf16 after each operator; int8
    and int4 products round activations to int8 per block of 32 on both paths, so a value on a rounding boundary can
    differ by one step. The logits agree to a small fraction of their spread, and greedy tokens agree."""
    config = ModelConfig(**dict(VARIANTS["llama-gqa"], block_size=64))
    model = sharpened(config)
    if form == "bf16":
        model = model.to(torch.bfloat16)
    elif form.startswith("int"):
        model = quantize(model, form[:4])
    kv_dtype = torch.int8 if "cache" in form else None
    eager, native, eager_cache, native_cache = steps(model, kv_dtype)
    spread = eager.abs().max()
    assert (native - eager).abs().max() <= 0.03 * spread
    assert (native.argmax(-1) == eager.argmax(-1)).float().mean() >= 0.95
    if kv_dtype is not None:
        assert native_cache.keys[0].dtype == torch.int8 and len(native_cache.key_scales) == config.n_layer
        for a, b in zip(eager_cache.keys + eager_cache.values, native_cache.keys + native_cache.values):
            assert (a.int() - b.int()).abs().max() <= 1  # one rounding step at most


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
def test_more_rows_than_a_fused_step_takes_decode_eagerly():
    model = sharpened(ModelConfig(**dict(VARIANTS["gpt2"], block_size=64)))
    prompts = [[i, i + 1] for i in range(fused.MAX_ROWS + 1)]
    batched = generate_ids(model, prompts, max_new_tokens=6, temperature=0)
    assert batched == [generate_ids(model, p, max_new_tokens=6, temperature=0) for p in prompts]


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


def test_a_first_decode_does_not_wait_for_the_kernels_to_build(monkeypatch):
    import threading

    from torch.utils import cpp_extension

    release = threading.Event()

    def slow_build(**_):
        release.wait(30)  # a build that takes as long as the test needs
        raise RuntimeError("stop here")

    monkeypatch.setattr(cpu_kernels, "_STATE", {})
    monkeypatch.setattr(cpu_kernels, "_built", lambda: False)
    monkeypatch.delenv(cpu_kernels.DISABLE_VARIABLE, raising=False)
    monkeypatch.setenv(cpu_kernels.UPCAST_VARIABLE, "0")
    monkeypatch.setattr(cpp_extension, "load", slow_build)
    model = sharpened(ModelConfig(**TINY))
    try:
        out = generate_ids(model, [1, 2, 3], max_new_tokens=4, temperature=0)  # decodes while the build runs
        assert len(out) == 4 and cpu_kernels.building()
    finally:
        release.set()
        cpu_kernels.prepare()
    assert not cpu_kernels.building() and cpu_kernels._STATE["library"] is False


# What the C++ step does not compute: each is refused by name, and decoding falls back to the eager step.
NOT_NATIVE = {"qk_norm": dict(TINY, norm="rmsnorm", position="rope", qk_norm=True),
              "relu2": dict(TINY, activation="relu2"),
              "logit_softcap": dict(TINY, logit_softcap=0.5)}  # fmt: skip


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
    eager, native, _, _ = steps(model)
    assert native.shape[-1] == model.config.vocab_size
    torch.testing.assert_close(native, eager, atol=1e-4, rtol=0)
    prompt = [3, 1, 4, 1, 5]
    greedy = generate_ids(model, prompt, max_new_tokens=8, temperature=0)
    assert greedy == greedy_by_forward(model, prompt, 8)
    sampled = generate_ids(model, [prompt] * 4, max_new_tokens=16, temperature=2.0, seed=0)
    assert max(max(row) for row in sampled) < model.config.vocab_size
