import pytest
import torch

from gptkit.accounting import (
    forward_flops_per_token,
    kv_cache_bytes,
    matmul_params,
    param_breakdown,
    training_flops_per_token,
)
from gptkit.config import PRESETS, ModelConfig
from gptkit.model import GPT


def distinct_numel(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() yields a tied tensor once


def test_breakdown_equals_numel_for_every_variant(variant_config):
    model = GPT(variant_config)
    parts = param_breakdown(variant_config)
    assert parts.total == distinct_numel(model)
    blocks = model.blocks
    assert parts.attention == sum(p.numel() for b in blocks for p in b.attn.parameters())
    assert parts.mlp == sum(p.numel() for b in blocks for p in b.mlp.parameters())


@pytest.mark.parametrize("name", list(PRESETS))
def test_breakdown_equals_numel_for_every_preset(name):
    config = ModelConfig.preset(name)
    with torch.device("meta"):  # no memory: llama2-7b has 6.7B parameters
        model = GPT(config)
    assert param_breakdown(config).total == distinct_numel(model)


def test_gpt2_small_has_spec_parameter_count():
    assert param_breakdown(ModelConfig.preset("gpt2")).total == 124_439_808


def test_gpt3_is_about_175b():
    gpt3 = ModelConfig(vocab_size=50257, block_size=2048, n_layer=96, n_head=96, n_embd=12288)
    total = param_breakdown(gpt3).total
    approx = 50257 * 12288 + 96 * 12 * 12288**2  # docs/spec.md section 2.1: about 0.6B + 96 * 12 * d^2
    assert abs(total - approx) / approx < 0.01
    assert 174e9 < total < 176e9


def test_training_flops_are_6n_plus_attention_term():
    config = ModelConfig.preset("gpt2")
    n = matmul_params(config)
    assert n == 124_439_808 - 1024 * 768  # the position table is only looked up
    assert training_flops_per_token(config) == 6 * n + 12 * 12 * 1024 * 768
    assert forward_flops_per_token(config, context=1) == 2 * n + 4 * 12 * 768
    untied = config.__class__(**dict(config.to_dict(), tie_embeddings=False))
    assert matmul_params(untied) == n  # the head multiplies, the untied embedding is looked up


def test_kv_cache_spec_worked_number():
    config = ModelConfig.preset("llama2-7b")  # L 32, 32 heads, head size 128
    assert kv_cache_bytes(config, batch_size=1, context=2048, dtype="float16") == 1_073_741_824
    gqa = ModelConfig.preset("tinyllama-1.1b")  # 4 kv heads of 64
    assert kv_cache_bytes(gqa, batch_size=2, context=100, dtype="float32") == 2 * 22 * 2 * 100 * 4 * 64 * 4
    with pytest.raises(ValueError, match="dtype"):
        kv_cache_bytes(config, 1, 1, dtype="float64")
