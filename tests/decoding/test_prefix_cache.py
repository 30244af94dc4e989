"""The prefix cache (gptkit.decoding.prefix_cache, kv_store): a hit never changes an answer, bit for bit, nor does
what shares the batch; eviction, the disk tier across a restart, damaged files and adapters kept apart."""

from __future__ import annotations

import logging

import pytest
import torch

from gptkit.config import ModelConfig
from gptkit.decoding.batch import BatchEngine
from gptkit.decoding.kv_store import KVStore
from gptkit.decoding.prefix_cache import PrefixCache, block_names, parse_size
from gptkit.decoding.request import Request
from gptkit.decoding.sampling import SamplingParams
from gptkit.decoding.step import PREFILL_CHUNK
from gptkit.model import GPT
from gptkit.native import library
from gptkit.quantization import quantize

GPT2 = dict(vocab_size=256, block_size=256, n_layer=2, n_head=4, n_embd=64)
LLAMA = dict(GPT2, norm="rmsnorm", activation="swiglu", position="rope", n_kv_head=2, attn_bias=False, mlp_bias=False)
WEIGHTS = {
    "fp32": (torch.float32, None),
    "bf16": (torch.bfloat16, None),
    "int8": (torch.float32, "int8"),
    "int4": (torch.float32, "int4"),
}
NEW_TOKENS = 12


@pytest.fixture(autouse=True)
def fused_chosen(monkeypatch):
    """The fused step as if measured faster here: batch invariance is promised where it decodes."""
    if library.load():
        monkeypatch.setitem(library.STATE, "choices", dict(library.choices(), fused_step=True))


def make_model(style: dict, weights: str, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    dtype, quantized = WEIGHTS[weights]
    model = GPT(ModelConfig(**style)).eval().to(dtype)
    with torch.no_grad():
        model.norm_f.weight.mul_(4.0)  # logits far apart: greedy choices away from ties
    return quantize(model, quantized) if quantized else model


def prompt(length: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def request(tokens: list[int], greedy: bool = True) -> Request:
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0 if greedy else 1.0, seed=7)
    return Request(list(tokens), params, seed=7, top_logprobs=2)


def run(engine: BatchEngine, batches: list[list[Request]]) -> None:
    """Add each list of requests at its own step (the first at once), then step until all finish."""
    pending = list(batches)
    while pending or engine.rows:
        if pending:
            engine.add(pending.pop(0))
        if engine.rows:
            engine.step()


def answer(req: Request) -> tuple[list[int], list[float], list[list[tuple[int, float]]]]:
    return req.generated, [t.logprob for t in req.logprobs], [t.top for t in req.logprobs]


def engine_for(model: GPT, cache: PrefixCache | None, kv_dtype=None, rows: int = 4, adapter: str = "") -> BatchEngine:
    return BatchEngine(model, rows, model.config.block_size, kv_dtype=kv_dtype, prefix_cache=cache, adapter=adapter)


@pytest.mark.parametrize("weights", list(WEIGHTS))
@pytest.mark.parametrize("style", ["gpt2", "llama"])
def test_a_cache_hit_and_batch_neighbours_change_no_bit(style, weights):
    model = make_model(GPT2 if style == "gpt2" else LLAMA, weights)
    shared = prompt(150, 1)
    target = shared + prompt(30, 2)  # 180 tokens: two whole blocks can come from the cache
    alone = request(target)
    run(engine_for(model, None), [[alone]])  # computed whole, alone

    cache = PrefixCache(1 << 30)
    engine = engine_for(model, cache)
    run(engine, [[request(shared + prompt(20, 3))]])  # leaves blocks 0-1 of `shared`
    hit = request(target)
    crowd = [request(prompt(40, 4), greedy=False), request(shared[:70] + prompt(5, 5))]
    run(engine, [[hit, crowd[0]], [crowd[1]], [request(prompt(90, 6))]])  # neighbours come and go
    assert cache.stats.hit_tokens >= 2 * PREFILL_CHUNK
    assert answer(hit) == answer(alone)  # tokens, logprobs and alternatives, exactly


def test_an_int8_kv_cache_and_a_window_past_the_block_change_no_bit():
    """Learned positions sliding past block_size re-prefill a window every step; an int8 cache quantises each block."""
    model = make_model(dict(GPT2, block_size=96), "fp32")
    for kv_dtype in (None, torch.int8):
        target = prompt(90, 11)  # 90 + 12 new tokens: the window slides past the block of 96
        alone = request(target)
        run(engine_for(model, None, kv_dtype), [[alone]])
        cache = PrefixCache(1 << 30)
        engine = engine_for(model, cache, kv_dtype)
        run(engine, [[request(target[:80])]])
        hit = request(target)
        run(engine, [[hit, request(prompt(30, 12))]])
        assert cache.stats.hit_tokens == PREFILL_CHUNK
        assert answer(hit) == answer(alone)


def test_eviction_under_a_tiny_budget_keeps_answers_right():
    model = make_model(GPT2, "fp32")
    block_bytes = 2 * 2 * GPT2["n_embd"] * PREFILL_CHUNK * 4  # keys and values, 2 layers, fp32
    cache = PrefixCache(3 * block_bytes)  # three blocks
    engine = engine_for(model, cache)
    prompts = [prompt(200, s) for s in range(4)]  # three blocks each
    references = []
    for p in prompts:
        ref = request(p)
        run(engine_for(model, None), [[ref]])
        references.append(answer(ref))
    for _ in range(2):
        for p, expected in zip(prompts, references):
            req = request(p)
            run(engine, [[req]])
            assert answer(req) == expected
    assert cache.stats.evicted > 0 and cache.used_bytes <= 3 * block_bytes
    # Most recent chain's head is kept before its tail: a lookup of the last prompt finds its first blocks.
    assert cache.match(engine.namespace(), prompts[-1])


def test_a_restarted_server_reads_its_blocks_from_disk(tmp_path, caplog):
    model = make_model(LLAMA, "fp32")
    target = prompt(200, 21)
    reference = request(target)
    run(engine_for(model, None), [[reference]])

    first = PrefixCache(1 << 30, KVStore(tmp_path, 1 << 30))
    engine = engine_for(model, first)
    run(engine, [[request(target)]])
    first.close()  # the writes finish
    files = [first.store.path(engine.namespace(), name) for name in block_names(engine.namespace(), target, 3)]
    assert sorted(tmp_path.glob("*/*.safetensors")) == sorted(files)  # 200 tokens: three whole blocks

    again = PrefixCache(1 << 30, KVStore(tmp_path, 1 << 30))  # a new process: nothing in RAM
    req = request(target)
    run(engine_for(model, again), [[req]])
    assert again.stats.disk_hits == 3 and again.stats.hit_tokens == 3 * PREFILL_CHUNK
    assert answer(req) == answer(reference)

    # A damaged file (one byte of its data flipped) is ignored with one warning, removed, and recomputed.
    data = bytearray(files[1].read_bytes())
    data[-5] ^= 0xFF
    files[1].write_bytes(bytes(data))
    third = PrefixCache(1 << 30, KVStore(tmp_path, 1 << 30))
    req = request(target)
    with caplog.at_level(logging.WARNING, logger="gptkit.decoding"):
        run(engine_for(model, third), [[req]])
    warnings = [r for r in caplog.records if "prefix cache" in r.getMessage()]
    assert len(warnings) == 1 and "checksum" in warnings[0].getMessage()
    assert third.stats.disk_hits == 1 and third.stats.hit_tokens == PREFILL_CHUNK
    assert answer(req) == answer(reference)
    third.close()
    assert files[1].exists()  # written again, whole, after its recomputation


def test_a_foreign_or_truncated_file_is_never_loaded(tmp_path, caplog):
    model = make_model(GPT2, "fp32")
    target = prompt(100, 31)
    first = PrefixCache(1 << 30, KVStore(tmp_path, 1 << 30))
    run(engine_for(model, first), [[request(target)]])
    first.close()
    (path,) = tmp_path.glob("*/*.safetensors")
    path.write_bytes(path.read_bytes()[:100])
    cache = PrefixCache(1 << 30, KVStore(tmp_path, 1 << 30))
    with caplog.at_level(logging.WARNING, logger="gptkit.decoding"):
        assert cache.match(engine_for(model, cache).namespace(), target) == []
    assert "unreadable" in caplog.text and not path.exists()


def test_the_disk_tier_stays_within_its_budget(tmp_path):
    model = make_model(GPT2, "fp32")
    cache = PrefixCache(0, KVStore(tmp_path, 2 * 40_000))  # RAM off; about two block files
    engine = engine_for(model, cache)
    for s in range(3):
        run(engine, [[request(prompt(130, 40 + s))]])
        cache.store.flush()
    assert 0 < cache.store.used_bytes <= 2 * 40_000
    assert sum(p.stat().st_size for p in tmp_path.glob("*/*.safetensors")) == cache.store.used_bytes


def test_two_adapters_or_two_models_never_share_a_block():
    base = make_model(GPT2, "fp32")
    other = make_model(GPT2, "fp32")
    with torch.no_grad():
        other.blocks[1].mlp.proj.weight[0, 0] += 1e-3  # one weight apart: a different model
    cache = PrefixCache(1 << 30)
    target = prompt(150, 51)
    run(engine_for(base, cache, adapter="a"), [[request(target)]])
    for engine in (engine_for(base, cache, adapter="b"), engine_for(other, cache, adapter="a")):
        assert cache.match(engine.namespace(), target) == []
    assert len(cache.match(engine_for(base, cache, adapter="a").namespace(), target)) == 2


def test_sizes_read_from_flags():
    assert parse_size("4G") == 4 << 30 and parse_size("512M") == 512 << 20 and parse_size("1000") == 1000
    assert parse_size("1.5GiB") == 3 << 29 and parse_size("0") == 0
    with pytest.raises(ValueError, match="invalid size"):
        parse_size("lots")


def test_the_server_reports_its_cache_and_finds_it_again_after_a_restart(tmp_path):
    from fastapi.testclient import TestClient

    from gptkit.serving.server import ServeOptions, build_app
    from tests.serving.servers import make_model_dir

    model_dir = make_model_dir(tmp_path / "model", block_size=256)
    options = ServeOptions(cache_ram=1 << 28, cache_dir=str(tmp_path / "kv"), allowed_host=("testserver",))
    body = {
        "model": "model",
        "prompt": "the cat sat on the mat. " * 8,
        "max_tokens": 8,
        "temperature": 0,
        "logprobs": 2,
    }  # 192 characters: three whole blocks kept, the first two usable (the last token's is computed)
    with TestClient(build_app(model_dir, options)) as http:
        first = http.post("/v1/completions", json=body).json()["choices"]
        again = http.post("/v1/completions", json=body).json()["choices"]
        cache = http.get("/health").json()["prefix_cache"]
    assert again == first
    assert cache["hits"] == 1 and cache["hit_tokens"] == 2 * PREFILL_CHUNK and cache["ram_bytes"] > 0
    with TestClient(build_app(model_dir, options)) as http:  # restarted: RAM is empty, the disk is not
        restarted = http.post("/v1/completions", json=body).json()["choices"]
        cache = http.get("/health").json()["prefix_cache"]
    assert restarted == first
    assert cache["disk_hits"] == 2 and cache["disk_blocks"] == 3
