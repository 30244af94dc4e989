"""The fast decode paths: a compiled decode step, and bf16 inference against fp32."""

from __future__ import annotations

import pytest
import torch
from helpers import TINY, VARIANTS

from gptkit.config import ModelConfig
from gptkit.decoding.api import complete, generate_ids
from gptkit.decoding.batch import BatchEngine
from gptkit.decoding.options import DecodeOptions
from gptkit.decoding.sampling import SamplingParams
from gptkit.decoding.step import COMPILE_CACHE_MULTIPLE, cache_len
from gptkit.model import GPT


def sharpened(config: ModelConfig, scale: float = 20.0, device: torch.device | str = "cpu") -> GPT:
    """A random pre-norm model with logits scaled up, so that greedy choices are mostly far from ties."""
    model = GPT(config).eval().to(device)
    with torch.no_grad():
        model.norm_f.weight.mul_(scale)
    return model


def test_compiled_decode_matches_eager_and_is_reused(device):
    """On CUDA the compiled step runs as a CUDA graph (mode reduce-overhead)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    model = sharpened(ModelConfig(**dict(VARIANTS["llama-gqa"], n_layer=1, block_size=512)), device=device)
    prompts = [[5, 6, 7], [9, 1]]
    params = SamplingParams(max_new_tokens=8, temperature=0)
    eager = complete(model, prompts, params)
    compiled = complete(model, prompts, params, options=DecodeOptions(compile=True))
    assert [[c.ids for c in r] for r in compiled.completions] == [[c.ids for c in r] for r in eager.completions]
    assert compiled.timing.compile_seconds is not None and eager.timing.compile_seconds is None
    assert "compile_seconds" in compiled.timing.to_dict()
    graphs = counters["stats"]["unique_graphs"]
    assert graphs >= 1
    # A second request of another length within the same cache bucket reuses the compiled step.
    again = complete(
        model, [[4, 4, 4, 4], [2]], SamplingParams(max_new_tokens=5, temperature=0), options=DecodeOptions(compile=True)
    )
    assert counters["stats"]["unique_graphs"] == graphs
    assert [len(c.ids) for r in again.completions for c in r] == [5, 5]


def test_compiled_cache_length_is_bucketed():
    model = GPT(ModelConfig(**dict(VARIANTS["llama-gqa"], block_size=2048)))
    assert cache_len(model, 15) == 15
    assert cache_len(model, 15, compile=True) == COMPILE_CACHE_MULTIPLE
    learned = GPT(ModelConfig(**TINY))  # block_size 16 caps the window
    assert cache_len(learned, 15, compile=True) == 16


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["gpt2", "mqa-no-position"])
def test_compiled_decode_matches_eager_more_variants(variant):
    model = sharpened(ModelConfig(**dict(VARIANTS[variant], block_size=512)))
    prompts = [[5, 6, 7]]
    params = SamplingParams(max_new_tokens=10, temperature=0)
    compiled = complete(model, prompts, params, options=DecodeOptions(compile=True))
    assert compiled.completions == complete(model, prompts, params).completions


def _agreeing_prefix(model: GPT, prompt: list[int], tokens: list[int], margin: float) -> int:
    """How many leading greedy tokens have an fp32 top-1 logit ahead of the runner-up by at least margin."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens], device=model.lm_head.weight.device))[0, len(prompt) - 1 :]
    logits = logits.float()
    top2 = logits.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1] >= margin).tolist()
    return next((i for i, ok in enumerate(clear[: len(tokens)]) if not ok), len(tokens))


@pytest.mark.parametrize("variant", ["untied-head-bias", "llama-gqa"])  # a tied random model just repeats
def test_bf16_greedy_tokens_match_fp32_where_clear(variant, device):
    config = ModelConfig(**dict(VARIANTS[variant], block_size=64, n_embd=64))
    model = sharpened(config, device=device)
    prompt = [3, 14, 15, 9, 26]
    fp32 = generate_ids(model, prompt, max_new_tokens=16, temperature=0)
    clear = _agreeing_prefix(model, prompt, fp32, margin=0.2)
    assert clear >= 3  # enough clear-cut tokens for the comparison to mean something
    bf16_model = model.to(torch.bfloat16)
    engine = BatchEngine(bf16_model, 1, 32)
    assert engine.cache.keys[0].dtype == torch.bfloat16  # the cache follows the weights
    bf16 = generate_ids(bf16_model, prompt, max_new_tokens=16, temperature=0)
    assert bf16[:clear] == fp32[:clear]
    result = complete(bf16_model, [prompt], SamplingParams(max_new_tokens=4, temperature=0.7, seed=1))
    assert len(result.completions[0][0].ids) == 4  # sampling works on bf16 logits (cast to fp32 first)
