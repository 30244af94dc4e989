"""gptkit.positions: RoPE frequencies and their scaling rules against transformers' ROPE_INIT_FUNCTIONS."""

import math

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from gptkit.config import ModelConfig, RopeScaling
from gptkit.errors import ConfigError
from gptkit.positions import (
    apply_rope,
    attention_factor,
    document_positions,
    inv_frequencies,
    rope_cos_sin,
    rope_tables,
)

HEAD_DIM, THETA, CONTEXT = 64, 500000.0, 16384
LONGROPE = dict(
    short_factor=[1.0 + i / 16 for i in range(16)],  # rotary_dim 32 below: 16 frequencies
    long_factor=[1.0 + i for i in range(16)],
    original_max_position_embeddings=4096,
)
RULES = {
    "linear": dict(rope_type="linear", factor=4.0),
    "dynamic": dict(rope_type="dynamic", factor=2.0),
    "llama3": dict(
        rope_type="llama3",
        factor=32.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    ),
    "yarn": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=4096),
    "yarn-betas-untruncated": dict(
        rope_type="yarn",
        factor=8.0,
        original_max_position_embeddings=2048,
        beta_fast=16.0,
        beta_slow=2.0,
        truncate=False,
    ),
    "yarn-deepseek-mscale": dict(
        rope_type="yarn", factor=40.0, original_max_position_embeddings=4096, mscale=1.0, mscale_all_dim=0.707
    ),
    "yarn-attention-factor": dict(
        rope_type="yarn", factor=4.0, original_max_position_embeddings=4096, attention_factor=1.5
    ),
    "longrope": dict(rope_type="longrope", factor=4.0, **LONGROPE),
    "longrope-factor-from-context": dict(rope_type="longrope", **LONGROPE),
}


def configs(rule: dict, rotary_dim: int) -> tuple[LlamaConfig, ModelConfig]:
    """The same RoPE as transformers 5 takes it (rope_parameters holding rope_theta, partial_rotary_factor) and as
    gptkit does (block_size standing for max_position_embeddings)."""
    hf = LlamaConfig(
        hidden_size=4 * HEAD_DIM,
        num_attention_heads=4,
        head_dim=HEAD_DIM,
        max_position_embeddings=CONTEXT,
        rope_parameters=dict(rule, rope_theta=THETA, partial_rotary_factor=rotary_dim / HEAD_DIM),
    )
    ours = ModelConfig(
        n_embd=4 * HEAD_DIM,
        n_head=4,
        position="rope",
        rope_theta=THETA,
        block_size=CONTEXT,
        rotary_dim=rotary_dim,
        rope_scaling=rule,
    )
    return hf, ours


@pytest.mark.parametrize("name", list(RULES), ids=list(RULES))
@pytest.mark.parametrize("seq_len", [None, 1000, 20000])  # dynamic and longrope choose by the pass's length
def test_scaled_frequencies_equal_transformers(name, seq_len):
    rotary_dim = 32 if name.startswith("longrope") else HEAD_DIM
    hf, ours = configs(RULES[name], rotary_dim)
    want, want_factor = ROPE_INIT_FUNCTIONS[RULES[name]["rope_type"]](hf, "cpu", seq_len=seq_len)
    got = inv_frequencies(ours, 0, seq_len=seq_len)
    assert torch.equal(got, want)  # the same float32 operations in the same order
    assert attention_factor(ours, 0) == pytest.approx(want_factor, rel=1e-12)


@pytest.mark.parametrize("rotary_dim", [16, 48])
def test_partial_rotary_frequencies_equal_transformers(rotary_dim):
    hf, ours = configs(RULES["llama3"], rotary_dim)
    assert torch.equal(inv_frequencies(ours, 0), ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")[0])
    assert inv_frequencies(ours, 0).shape == (rotary_dim // 2,)


def test_unscaled_frequencies_and_tables_by_hand():
    config = ModelConfig(n_embd=32, n_head=4, position="rope", rope_theta=100.0)
    assert inv_frequencies(config, 0).tolist() == pytest.approx([100.0 ** (-2 * i / 8) for i in range(4)])
    cos, sin = rope_tables(config, torch.arange(3)[None])[0]
    assert cos.shape == (1, 3, 8)
    assert cos[0, 2, 5].item() == pytest.approx(math.cos(2 * 100.0 ** (-2 * 1 / 8)))
    torch.testing.assert_close((cos, sin), rope_cos_sin(torch.arange(3)[None], 8, 100.0))


def test_yarn_scales_cos_and_sin_by_its_attention_factor():
    rule = dict(RULES["yarn"], original_max_position_embeddings=8)
    config = ModelConfig(n_embd=32, n_head=4, position="rope", block_size=64, rope_scaling=rule)
    cos, sin = rope_tables(config, torch.arange(5)[None])[0]
    factor = 0.1 * math.log(4.0) + 1.0  # YaRN's sqrt(1/t) = 0.1 ln(s) + 1 (Peng et al. 2023, eq. 22)
    assert attention_factor(config, 0) == pytest.approx(factor)
    torch.testing.assert_close(cos[0, 0], torch.full((8,), factor))  # cos 0 = 1
    torch.testing.assert_close(cos.square() + sin.square(), torch.full_like(cos, factor**2))


def test_tables_are_shared_per_base_and_none_where_no_rope():
    config = ModelConfig(
        n_layer=4,
        n_embd=32,
        n_head=4,
        position="rope",
        sliding_window=4,
        nope_layers=[3],
        layer_types=["sliding", "full", "sliding", "full"],
        rope_local_theta=10.0,
    )
    tables = rope_tables(config, torch.arange(6)[None])
    assert tables[0] is tables[2] and tables[1] is not tables[0] and tables[3] is None
    assert rope_tables(ModelConfig(n_embd=32, n_head=4, n_layer=2), torch.arange(3)[None]) == [None, None]


def test_dynamic_keeps_the_base_within_the_trained_context_and_grows_it_past():
    config = ModelConfig(
        n_embd=32, n_head=4, position="rope", block_size=16, rope_scaling=dict(rope_type="dynamic", factor=2.0)
    )
    plain = ModelConfig(n_embd=32, n_head=4, position="rope", block_size=16)
    inside = rope_tables(config, torch.arange(16)[None])[0]
    torch.testing.assert_close(inside, rope_tables(plain, torch.arange(16)[None])[0], atol=0, rtol=0)
    grown = 10000.0 * (2.0 * 32 / 16 - 1) ** (8 / 6)  # base (s L' / L - (s - 1))^(d / (d - 2)) at L' = 32
    torch.testing.assert_close(
        inv_frequencies(config, 0, seq_len=32),
        inv_frequencies(ModelConfig(n_embd=32, n_head=4, position="rope", rope_theta=grown), 0),
    )


def test_apply_rope_rotates_pairs_half_apart():
    x = torch.randn(1, 1, 3, 8)
    cos, sin = rope_cos_sin(torch.arange(3)[None], 8, 10000.0)
    out = apply_rope(x, cos, sin)
    i, p = 1, 2
    angle = p * 10000.0 ** (-2 * i / 8)
    a, b = x[0, 0, p, i], x[0, 0, p, i + 4]
    assert out[0, 0, p, i].item() == pytest.approx((a * math.cos(angle) - b * math.sin(angle)).item(), abs=1e-6)
    assert out[0, 0, p, i + 4].item() == pytest.approx((b * math.cos(angle) + a * math.sin(angle)).item(), abs=1e-6)


def test_document_positions_restart_per_document():
    ids = torch.tensor([[7, 7, 7, 2, 2, 9]])
    assert document_positions(ids).tolist() == [[0, 1, 2, 0, 1, 0]]


def test_rope_scaling_round_trips_as_hf_dict():
    rule = RopeScaling.from_dict(dict(RULES["llama3"], factor=32))
    assert rule.factor == 32.0 and isinstance(rule.factor, float)
    assert rule.to_dict() == dict(RULES["llama3"])
    longrope = RopeScaling.from_dict(RULES["longrope"])
    assert longrope.to_dict()["short_factor"] == LONGROPE["short_factor"]
    with pytest.raises(ConfigError, match="original_max_position_embeddings"):
        RopeScaling.from_dict(dict(rope_type="yarn", factor=2.0))
    with pytest.raises(ConfigError, match="truncate"):
        RopeScaling.from_dict(dict(RULES["yarn"], truncate="no"))
