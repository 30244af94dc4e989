"""The probe that decides whether prompts admitted together may share a forward (gptkit.decoding.wave_probe): it
passes the block products that give a row the same bits beside other rows, fails one that does not (and then every
prompt prefills alone, answering as alone), and runs once per model and thread count."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from gptkit.config import ModelConfig
from gptkit.decoding import prefill_waves, wave_probe
from gptkit.decoding.batch import BatchEngine
from gptkit.decoding.prefill_waves import MAX_WAVE_ROWS, Prompt, prefill_whole_chunks, rows_per_forward
from gptkit.decoding.request import Request
from gptkit.decoding.sampling import SamplingParams
from gptkit.decoding.step import PREFILL_CHUNK, inference, new_cache
from gptkit.model import GPT
from gptkit.multi_lora import AdapterSet, serve_adapter

GPT2 = dict(vocab_size=256, block_size=512, n_layer=2, n_head=4, n_embd=64)


def make_model() -> GPT:
    torch.manual_seed(0)
    return GPT(ModelConfig(**GPT2)).eval()


def tokens(length: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def mix_rows(layer: torch.nn.Linear) -> None:
    """layer's output gains a trace of the mean over the forward's rows while they hold a whole chunk each: a product
    whose row bits depend on the neighbours (decode steps, one token a row, stay as they were)."""

    def forward(x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, layer.weight, layer.bias)  # (rows, T, out)
        return y + 1e-3 * y.mean(0, keepdim=True) if x.dim() == 3 and x.size(1) == PREFILL_CHUNK else y

    layer.forward = forward


@pytest.mark.skipif(
    torch.backends.cpu.get_cpu_capability() != "AVX2", reason="row independence was seen on AVX2 CPUs only"
)
def test_an_fp32_model_passes_the_probe_on_this_cpu():
    model = make_model()
    assert list(wave_probe.distinct_products(model)) == [
        "blocks.0.attn.qkv",
        "blocks.0.attn.proj",
        "blocks.0.mlp.fc",
        "blocks.0.mlp.proj",
    ]
    assert rows_per_forward(model) == MAX_WAVE_ROWS


@pytest.mark.skipif(
    torch.backends.cpu.get_cpu_capability() != "AVX2", reason="row independence was seen on AVX2 CPUs only"
)
def test_served_lora_adapters_are_probed_with_their_updates():
    model = make_model()
    generator = torch.Generator().manual_seed(1)
    state = {}
    for index in range(len(model.blocks)):
        for path, (out, width) in {"attn.qkv": (192, 64), "attn.proj": (64, 64)}.items():
            state[f"blocks.{index}.{path}.lora_A"] = torch.randn(4, width, generator=generator)
            state[f"blocks.{index}.{path}.lora_B"] = torch.randn(out, 4, generator=generator)
    serve_adapter(model, 1, state, {"rank": 4, "alpha": 8, "targets": "attention"}, "test")
    products = wave_probe.distinct_products(model)
    assert isinstance(products["blocks.0.attn.qkv"], AdapterSet)
    assert "blocks.0.attn.qkv.base" not in products  # probed within its wrapper
    assert rows_per_forward(model) == MAX_WAVE_ROWS


def test_a_product_that_mixes_rows_fails_the_probe_and_each_prompt_prefills_alone(monkeypatch, caplog):
    model = make_model()
    mix_rows(model.blocks[0].mlp.fc)
    prompts = [tokens(3 * PREFILL_CHUNK + 5, seed) for seed in range(4)] + [tokens(3 * PREFILL_CHUNK + 5, 0)]

    def cache_after(widest: int) -> list[torch.Tensor]:
        with monkeypatch.context() as patch:
            patch.setattr(prefill_waves, "rows_per_forward", lambda model: widest)
            cache = new_cache(model, len(prompts), 512)
            with inference(model):
                prefill_whole_chunks(model, cache, [Prompt(row, p, 0) for row, p in enumerate(prompts)])
        return cache.tensors

    # The patch has teeth: forced waves write other bits than one prompt a forward.
    assert not all(torch.equal(a, b) for a, b in zip(cache_after(1), cache_after(MAX_WAVE_ROWS)))
    with caplog.at_level(logging.INFO, logger="gptkit.decoding.wave_probe"):
        assert rows_per_forward(model) == 1
    assert "blocks.0.mlp.fc" in caplog.text

    rows: list[int] = []
    forward = prefill_waves._forward
    monkeypatch.setattr(prefill_waves, "_forward", lambda m, c, run, b: (rows.append(len(run)), forward(m, c, run, b)))
    params = SamplingParams(max_new_tokens=4, temperature=0.0)
    alone = [Request(list(p), params, seed=3, top_logprobs=2) for p in prompts]
    for req in alone:
        engine = BatchEngine(model, 1, 512)
        engine.add([req])
        while engine.rows:
            engine.step()
    rows.clear()
    together = [Request(list(p), params, seed=3, top_logprobs=2) for p in prompts]
    engine = BatchEngine(model, len(prompts), 512)
    engine.add(together)
    while engine.rows:
        engine.step()
    assert rows and max(rows) == 1  # one prompt's chunk a forward
    for a, b in zip(alone, together):
        assert a.generated == b.generated
        assert [t.logprob for t in a.logprobs] == [t.logprob for t in b.logprobs]  # exactly


def test_the_probe_runs_once_per_model_and_thread_count(monkeypatch):
    calls: list[str] = []
    probe = wave_probe._layer_independent

    def counted(layer, max_rows):
        calls.append(type(layer).__name__)
        return probe(layer, max_rows)

    monkeypatch.setattr(wave_probe, "_layer_independent", counted)
    model = make_model()
    verdict = rows_per_forward(model)
    assert len(calls) == 4  # qkv, attention's projection, fc, the MLP's projection
    for _ in range(3):
        assert rows_per_forward(model) == verdict
    engine = BatchEngine(model, 2, 512)
    engine.add([Request(tokens(2 * PREFILL_CHUNK + 3, 1), SamplingParams(max_new_tokens=2), seed=1)])
    assert len(calls) == 4  # the engine's admission read the stored answer
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        rows_per_forward(model)
        probed = len(calls)
        rows_per_forward(model)
    finally:
        torch.set_num_threads(threads)
    assert 4 < probed <= 8 and len(calls) == probed  # another thread count: probed again (up to a failing layer), once
    rows_per_forward(make_model())
    assert len(calls) == probed + 4  # another model


def test_the_engine_warm_up_runs_the_probe_before_the_first_admission(monkeypatch):
    calls: list[str] = []
    probe = wave_probe._layer_independent
    monkeypatch.setattr(wave_probe, "_layer_independent", lambda layer, rows: (calls.append(1), probe(layer, rows))[1])
    engine = BatchEngine(make_model(), 2, 512)
    engine.warm_up()
    probed = len(calls)
    assert probed >= 1
    engine.add([Request(tokens(2 * PREFILL_CHUNK + 3, 1), SamplingParams(max_new_tokens=2), seed=1)])
    assert len(calls) == probed  # the admission read the warm-up's answer
