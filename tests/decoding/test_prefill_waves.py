"""Prompts admitted together prefill their whole chunks in waves (gptkit.decoding.prefill_waves): several rows a
forward, shared prefixes once, and every answer bit for bit what the prompt alone gives."""

from __future__ import annotations

import pytest
import torch

from gptkit.config import ModelConfig
from gptkit.decoding import prefill_waves
from gptkit.decoding.batch import BatchEngine
from gptkit.decoding.prefill_waves import Prompt, prefill_whole_chunks, rows_per_forward
from gptkit.decoding.prefix_cache import PrefixCache
from gptkit.decoding.request import Request
from gptkit.decoding.sampling import SamplingParams
from gptkit.decoding.step import PREFILL_CHUNK, inference, new_cache
from gptkit.model import GPT
from gptkit.native import library
from gptkit.quantization import quantize

GPT2 = dict(vocab_size=256, block_size=512, n_layer=2, n_head=4, n_embd=64)
LLAMA = dict(GPT2, norm="rmsnorm", activation="swiglu", position="rope", n_kv_head=2, attn_bias=False, mlp_bias=False)


@pytest.fixture(autouse=True)
def fused_chosen(monkeypatch):
    """The fused step as if measured faster here: batch invariance is promised where it decodes."""
    if library.load():
        monkeypatch.setitem(library.STATE, "choices", dict(library.choices(), fused_step=True))


def make_model(style: dict) -> GPT:
    torch.manual_seed(0)
    model = GPT(ModelConfig(**style)).eval()
    with torch.no_grad():
        model.norm_f.weight.mul_(4.0)  # logits far apart: greedy choices away from ties
    return model


def waves_here(model: GPT) -> None:
    """Skip a test that needs several prompts a forward where the probe found this machine's products mix rows."""
    if rows_per_forward(model) == 1:
        pytest.skip("wave_probe: a row's product bits depend on its neighbours on this CPU/thread count; waves are off")


def tokens(length: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def request(prompt: list[int], greedy: bool = True) -> Request:
    params = SamplingParams(max_new_tokens=6, temperature=0.0 if greedy else 1.0, seed=3)
    return Request(list(prompt), params, seed=3, top_logprobs=2)


def answer(req: Request) -> tuple[list[int], list[float], list[list[tuple[int, float]]]]:
    return req.generated, [t.logprob for t in req.logprobs], [t.top for t in req.logprobs]


def finish(engine: BatchEngine, requests: list[Request]) -> None:
    engine.add(requests)
    while engine.rows:
        engine.step()


class Forwards:
    """Counts the prompts of each wave's forward (a whole chunk of each)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.rows: list[int] = []
        forward = prefill_waves._forward

        def counted(model, cache, run, begin):
            self.rows.append(len(run))
            forward(model, cache, run, begin)

        monkeypatch.setattr(prefill_waves, "_forward", counted)


def mixed_prompts() -> list[list[int]]:
    """Prompts of 1 to 4 whole chunks, two sharing a 130-token prefix, one repeated; of one length: two ending on a
    chunk's end, two with a last chunk of one token, two of 170 tokens."""
    shared = tokens(130, 1)
    return [
        tokens(250, 2),
        shared + tokens(60, 3),
        tokens(40, 4),
        shared + tokens(100, 5),
        tokens(2 * PREFILL_CHUNK, 6),
        tokens(250, 2),
        tokens(170, 7),
        tokens(2 * PREFILL_CHUNK, 10),
        tokens(2 * PREFILL_CHUNK + 1, 11),
        tokens(170, 12),
        tokens(2 * PREFILL_CHUNK + 1, 13),
    ]


@pytest.mark.parametrize("style", [GPT2, LLAMA], ids=["gpt2", "llama"])
@pytest.mark.parametrize("cached", [False, True], ids=["no-cache", "prefix-cache"])
def test_prompts_admitted_together_answer_as_each_alone(style, cached, monkeypatch):
    model = make_model(style)
    waves_here(model)
    prompts = mixed_prompts()
    alone = [request(p, greedy=i % 3 != 1) for i, p in enumerate(prompts)]
    for req in alone:
        finish(BatchEngine(model, 1, 512), [req])
    together = [request(p, greedy=i % 3 != 1) for i, p in enumerate(prompts)]
    forwards = Forwards(monkeypatch)
    engine = BatchEngine(model, 12, 512, prefix_cache=PrefixCache(1 << 30) if cached else None)
    finish(engine, together)
    assert max(forwards.rows) > 1  # whole chunks of several prompts ran in one forward
    for a, b in zip(alone, together):
        assert answer(a) == answer(b)  # tokens, logprobs and alternatives, exactly


def test_a_prefix_shared_within_one_admission_runs_once_and_fills_the_prefix_cache(monkeypatch):
    model = make_model(GPT2)
    waves_here(model)
    system = tokens(3 * PREFILL_CHUNK + 10, 8)  # three whole chunks shared, then each prompt's own
    prompts = [system + tokens(70, 9 + i) for i in range(4)]
    forwards = Forwards(monkeypatch)
    cache = PrefixCache(1 << 30)
    engine = BatchEngine(model, 4, 512, prefix_cache=cache)
    together = [request(p) for p in prompts]
    finish(engine, together)
    # 3 shared chunks computed once, then the 4 prompts' fourth chunk (at 192..256) in one forward.
    assert forwards.rows == [1, 1, 1, 4]
    assert len(cache.blocks) == 3 + 4
    later = request(prompts[2])
    finish(engine, [later])
    assert cache.stats.hit_tokens == 4 * PREFILL_CHUNK  # the next request finds every block kept
    reference = request(prompts[2])
    finish(BatchEngine(model, 1, 512), [reference])
    assert answer(later) == answer(reference) == answer(together[2])


@pytest.mark.parametrize("style", [GPT2, LLAMA], ids=["gpt2", "llama"])
def test_waves_write_the_same_bits_as_one_row_a_forward(style, monkeypatch):
    model = make_model(style)
    waves_here(model)  # forced waves differ where the probe found that rows meet
    prompts = mixed_prompts()

    def cache_after(widest: int) -> list[torch.Tensor]:
        monkeypatch.setattr(prefill_waves, "rows_per_forward", lambda model: widest)
        cache = new_cache(model, len(prompts), 512)
        with inference(model):
            prefill_whole_chunks(model, cache, [Prompt(row, p, 0) for row, p in enumerate(prompts)])
        return cache.tensors

    for one, many in zip(cache_after(1), cache_after(32)):
        assert torch.equal(one, many)


def test_only_probed_fp32_weights_share_a_forward():
    assert rows_per_forward(make_model(GPT2).to(torch.bfloat16)) == 1
    assert rows_per_forward(quantize(make_model(GPT2), "int8")) == 1
    model = make_model(GPT2)
    waves_here(model)
    assert rows_per_forward(model) == prefill_waves.MAX_WAVE_ROWS


def test_runs_are_consecutive_rows_of_at_most_widest():
    prompts = [Prompt(row, [1, 2], 0) for row in (0, 1, 2, 4, 5, 7)]
    runs = prefill_waves._runs(prompts, widest=2)
    assert [[p.row for p in run] for run in runs] == [[0, 1], [2], [4, 5], [7]]


def test_last_chunks_of_one_length_in_consecutive_rows_share_a_forward():
    prompts = [
        Prompt(0, [1] * 170, 128),
        Prompt(1, [2] * 170, 128),
        Prompt(2, [3] * 129, 128),
        Prompt(3, [4] * 129, 128),
    ]
    prompts += [Prompt(4, [5] * 170, 128), Prompt(6, [6] * 170, 128)]
    runs = prefill_waves._same_length_runs(prompts, widest=32)
    assert runs == [[0, 1], [2], [3], [4], [5]]  # a one-token last chunk runs alone; row 5 is not row 4's neighbour


def test_short_last_chunks_of_one_length_run_alone(monkeypatch):
    # Alone, a last chunk of 5 tokens takes gptkit's GEMV kernel where it is chosen (at most GEMV_MAX_ROWS rows);
    # beside others the rows exceed it and take the GEMM, whose sums are ordered otherwise: it must run alone.
    if not library.load():
        pytest.skip("the native library (its GEMV kernel) is not built here")
    monkeypatch.setitem(library.STATE, "choices", dict(library.choices(), fp32=True))
    model = make_model(GPT2)
    prompts = [tokens(2 * PREFILL_CHUNK + 5, seed) for seed in range(4)]
    alone = [request(p) for p in prompts]
    for req in alone:
        finish(BatchEngine(model, 1, 512), [req])
    together = [request(p) for p in prompts]
    finish(BatchEngine(model, len(prompts), 512), together)
    for a, b in zip(alone, together):
        assert answer(a) == answer(b)
    runs = prefill_waves._same_length_runs([Prompt(row, p, 2 * PREFILL_CHUNK) for row, p in enumerate(prompts)], 32)
    assert runs == [[0], [1], [2], [3]]
