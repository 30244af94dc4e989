"""Decoding a sliding-window model through its ring KV cache: the eager step against full recomputation without a
cache (the model's own windowed forward), the prefix cache bit for bit, and the batch engine fused and eager."""

from __future__ import annotations

import pytest
import torch

from gptkit.config import ModelConfig
from gptkit.decoding import speculative
from gptkit.decoding.batch import BatchEngine
from gptkit.decoding.prefix_cache import PrefixCache
from gptkit.decoding.request import Request
from gptkit.decoding.sampling import SamplingParams
from gptkit.decoding.step import PREFILL_CHUNK, extend, inference
from gptkit.kv_cache import KVCache
from gptkit.model import GPT
from gptkit.native import library

W = 7
MIXED = dict(
    vocab_size=96,
    block_size=256,
    n_layer=3,
    n_head=4,
    n_kv_head=2,
    n_embd=32,
    position="rope",
    norm="rmsnorm",
    activation="swiglu",
    attn_bias=False,
    mlp_bias=False,
    norm_bias=False,
    sliding_window=W,
    layer_types=["sliding", "full", "sliding"],
    rope_local_theta=100.0,
)
# The cached and uncached passes sum the same terms in other orders and shapes (fp32): measured within 2.5e-7 of the
# largest logit over these tests' chunkings and seeds 0-2; the limit is about 8 times that.
TOLERANCE = 2e-6


def windowed_model(settings: dict = MIXED, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    model = GPT(ModelConfig(**settings)).eval()
    with torch.no_grad():
        model.norm_f.weight.mul_(4.0)  # logits far apart: greedy choices away from ties
    return model


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("chunks", [[1] * 3 * W, [3, 1, W + 2, 1, 2 * W + 1, 1], [2 * W + 3, 1, 1, W - 1]])
def test_ring_cache_matches_recomputing_without_a_cache(chunks: list[int]) -> None:
    """One token at a time and extends that wrap the ring, up to 3W positions."""
    model = windowed_model()
    ids = torch.randint(0, 96, (2, sum(chunks)), generator=torch.Generator().manual_seed(1))
    cache = KVCache(model.config, 2, 64)
    start = 0
    with inference(model):
        full = model(ids)  # the model's own windowed forward
        for size in chunks:
            cached = model(ids[:, start : start + size], cache=cache, start_pos=start)
            assert relative(cached, full[:, start : start + size]) < TOLERANCE
            start += size


def test_per_row_positions_match_recomputing_each_row() -> None:
    """Rows at their own positions (a (B,) tensor) through a shared ring cache, past 3W."""
    model = windowed_model()
    g = torch.Generator().manual_seed(2)
    lengths = [3, 9, 16]
    seqs = [torch.randint(0, 96, (n + 3 * W,), generator=g) for n in lengths]
    cache = KVCache(model.config, 3, 64)
    with inference(model):
        for row, (seq, n) in enumerate(zip(seqs, lengths)):
            model(seq[None, :n], cache=cache.row(row, 64), start_pos=0)
        for t in range(0, 3 * W - 1, 2):  # extends of two tokens, every row at its own position
            positions = torch.tensor([n + t for n in lengths])
            tokens = torch.stack([seq[n + t : n + t + 2] for seq, n in zip(seqs, lengths)])
            cached = model(tokens, cache=cache, start_pos=positions)
            for row, (seq, n) in enumerate(zip(seqs, lengths)):
                full = model(seq[None, : n + t + 2])[0, -2:]
                assert relative(cached[row], full) < TOLERANCE


def test_int8_ring_cache_stays_near_recomputation() -> None:
    """An int8 ring: keys and values rounded to 1/127 of each vector's largest; the greedy tokens are unchanged."""
    model = windowed_model()
    ids = torch.randint(0, 96, (1, 3 * W + 2), generator=torch.Generator().manual_seed(3))
    cache = KVCache(model.config, 1, 64, kv_dtype=torch.int8)
    with inference(model):
        full = model(ids)
        cached = torch.cat(
            [model(ids[:, :5], cache=cache, start_pos=0)]
            + [model(ids[:, p : p + 1], cache=cache, start_pos=p) for p in range(5, ids.size(1))],
            1,
        )
    # Measured up to 9.0e-4 of the largest logit over seeds 0-4 (int8 rounding); the limit is about 5 times that.
    assert relative(cached, full) < 5e-3
    assert torch.equal(cached.argmax(-1), full.argmax(-1))


@pytest.fixture(params=["fused", "eager"])
def step_kind(request, monkeypatch):
    """Decode through the fused step (as if measured faster) or the eager one."""
    if library.load():
        choices = dict(library.choices(), fused_step=request.param == "fused")
        monkeypatch.setitem(library.STATE, "choices", choices)
    return request.param


def run(engine: BatchEngine, requests: list[Request]) -> None:
    engine.add(requests)
    while engine.rows:
        engine.step()


def request(tokens: list[int]) -> Request:
    return Request(list(tokens), SamplingParams(max_new_tokens=2 * W, temperature=0.0), seed=7, top_logprobs=2)


def answer(req: Request) -> tuple:
    return req.generated, [t.logprob for t in req.logprobs], [t.top for t in req.logprobs]


@pytest.mark.parametrize("window", [W, PREFILL_CHUNK + 9])
def test_prefix_cache_hit_on_a_windowed_model_is_bit_identical(window: int, step_kind: str) -> None:
    """A window shorter than a block and one longer than a block: the restored ring is the one a cold prefill left.
    Through the fused step a neighbour decodes beside the hit (a row's bits never depend on its neighbours there);
    the eager step runs other shapes with neighbours at other positions, so there the hit decodes alone."""
    model = windowed_model(dict(MIXED, sliding_window=window))
    g = torch.Generator().manual_seed(4)
    shared = torch.randint(0, 96, (2 * PREFILL_CHUNK + 20,), generator=g).tolist()
    target = shared + torch.randint(0, 96, (30,), generator=g).tolist()
    alone = request(target)
    run(BatchEngine(model, 2, 256), [alone])
    cache = PrefixCache(1 << 30)
    engine = BatchEngine(model, 2, 256, prefix_cache=cache)
    run(engine, [request(shared)])
    hit = request(target)
    fused = step_kind == "fused" and library.load()
    run(engine, [hit, request(target[:50])] if fused else [hit])
    assert cache.stats.hit_tokens == 2 * PREFILL_CHUNK
    assert answer(hit) == answer(alone)


def test_engine_decodes_past_the_window_as_recomputation(step_kind: str) -> None:
    """Greedy tokens through the batch engine (rows of different lengths, 3W new tokens) are the argmax of the
    model's uncached forward over each whole sequence."""
    model = windowed_model()
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (4, 11, 20)]
    reqs = [Request(p, SamplingParams(max_new_tokens=3 * W, temperature=0.0), seed=1) for p in prompts]
    run(BatchEngine(model, 3, 32, max_context=256), reqs)
    with inference(model):
        for req in reqs:
            seq = torch.tensor(req.prompt + req.generated)[None]
            want = model(seq)[0, len(req.prompt) - 1 : -1].argmax(-1).tolist()
            assert req.generated == want


@pytest.mark.parametrize("k", [2, 5])
def test_speculative_decoding_of_a_windowed_model_reads_an_intact_window(k: int, monkeypatch) -> None:
    """A draft that is always wrong: every target pass writes k rejected tokens into the rings, which the spare
    slots keep away from the window (without them this model's checked logits lie 7e-2 from recomputation)."""
    target = windowed_model()
    prompt = [3, 1, 4, 1, 5]
    draft = GPT(ModelConfig(**dict(MIXED, n_layer=1, layer_types=None, lm_head_bias=True))).eval()
    with torch.no_grad():  # always proposes token 95, which the target never picks here
        draft.lm_head.weight.zero_()
        draft.lm_head.bias.zero_()
        draft.lm_head.bias[95] = 10.0
    checks = []

    def recorded(model: GPT, tokens: torch.Tensor, cache: KVCache, position: int) -> torch.Tensor:
        logits = extend(model, tokens, cache, position)
        if model is target:
            checks.append((position, tokens[0].tolist(), logits[0]))
        return logits

    monkeypatch.setattr(speculative, "extend", recorded)
    req = Request(prompt, SamplingParams(max_new_tokens=3 * W, temperature=0.0))
    stats = speculative.speculative_generate(target, draft, req, k=k)
    assert stats.accepted == 0 and len(checks) > W
    seq = prompt + req.generated
    with inference(target):
        for position, tokens, logits in checks:  # the first checked token is the target's own: its logits count
            full = target(torch.tensor([seq[:position] + tokens]))[0, position]
            assert relative(logits[0], full) < TOLERANCE
