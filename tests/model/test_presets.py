"""The published families' presets: their shapes against the published config.json fields, their parameter counts
against the published counts and against a sum by hand."""

import json
import math
from pathlib import Path

import pytest
import torch

from gptkit.config import PRESETS, ModelConfig
from gptkit.model import GPT

PUBLISHED = json.loads((Path(__file__).parents[1] / "fixtures" / "published_configs.json").read_text())
MODELS = [name for name in PUBLISHED if not name.startswith("_")]


def parameter_count(config: ModelConfig) -> int:
    """Parameters of the GPT the config builds, on the meta device (no memory); tied weights counted once."""
    with torch.device("meta"):
        model = GPT(config)
    return sum(p.numel() for p in model.parameters())


def by_hand(entry: dict) -> int:
    """A Llama-style decoder's parameters from its config.json: embeddings (twice untied), per layer q, k, v, o, the
    gated MLP's three matrices, two norms (four for Gemma 3) and q/k norms (Qwen3, Gemma 3), and the final norm."""
    hf = entry["config"]
    d, layers, heads = hf["hidden_size"], hf["num_hidden_layers"], hf["num_attention_heads"]
    hd, kv = hf.get("head_dim", d // heads), hf["num_key_value_heads"]
    attention = d * heads * hd * 2 + d * kv * hd * 2
    mlp = 3 * d * hf["intermediate_size"]
    gemma = "query_pre_attn_scalar" in hf
    qk_norms = 2 * hd if gemma or entry["source"].startswith("Qwen/Qwen3") else 0
    norms = (4 if gemma else 2) * d + qk_norms
    embeddings = hf["vocab_size"] * d * (1 if hf["tie_word_embeddings"] else 2)
    return embeddings + layers * (attention + mlp + norms) + d


@pytest.mark.parametrize("name", MODELS)
def test_parameter_count_equals_the_published_count_and_the_sum_by_hand(name):
    entry = PUBLISHED[name]
    assert by_hand(entry) == entry["parameters"]
    assert parameter_count(ModelConfig.preset(name)) == entry["parameters"]


@pytest.mark.parametrize("name", MODELS)
def test_preset_shape_follows_the_published_config(name):
    hf, config = PUBLISHED[name]["config"], ModelConfig.preset(name)
    pairs = {
        "vocab_size": "vocab_size",
        "n_embd": "hidden_size",
        "ffn_hidden": "intermediate_size",
        "n_layer": "num_hidden_layers",
        "n_head": "num_attention_heads",
        "n_kv_head": "num_key_value_heads",
        "block_size": "max_position_embeddings",
        "norm_eps": "rms_norm_eps",
        "rope_theta": "rope_theta",
        "tie_embeddings": "tie_word_embeddings",
    }
    assert {ours: getattr(config, ours) for ours in pairs} == {ours: hf[theirs] for ours, theirs in pairs.items()}
    assert config.head_dim == hf.get("head_dim", hf["hidden_size"] // hf["num_attention_heads"])
    scaling = config.rope_scaling.to_dict() if config.rope_scaling is not None else None
    assert scaling == hf.get("rope_scaling")
    assert config.sliding_window == hf.get("sliding_window")
    if "sliding_window_pattern" in hf:  # Gemma 3: every pattern-th layer global, the others local
        pattern = hf["sliding_window_pattern"]
        assert config.layer_types == ["full" if (i + 1) % pattern == 0 else "sliding" for i in range(config.n_layer)]
        assert config.rope_local_theta == hf["rope_local_base_freq"]
        assert config.attn_scale == hf["query_pre_attn_scalar"] ** -0.5
        assert config.embedding_scale == math.sqrt(hf["hidden_size"])
        assert (config.activation, config.norm_position, config.norm_gain_offset) == ("geglu", "sandwich", 1.0)
    if "no_rope_layer_interval" in hf:  # SmolLM3: layer i has no RoPE where (i + 1) % interval == 0
        interval = hf["no_rope_layer_interval"]
        assert config.nope_layers == [i for i in range(config.n_layer) if (i + 1) % interval == 0]


def test_gpt3_small_is_the_papers_125m_with_alternating_bands():
    # Brown et al. 2020, table 2.1: GPT-3 Small, 125M parameters, 12 layers, d_model 768, 12 heads of 64, context 2048.
    config = ModelConfig.preset("gpt3-small")
    assert (config.n_layer, config.n_embd, config.n_head, config.head_dim, config.block_size) == (12, 768, 12, 64, 2048)
    count = parameter_count(config)
    assert count == 124439808 + (2048 - 1024) * 768  # GPT-2 small's count with 1024 more learned positions
    assert round(count / 1e6) == 125
    assert config.layer_types == ["full", "sliding"] * 6 and config.sliding_window == 256


def test_a_family_preset_builds_and_runs_at_a_small_width():
    # The real shapes are too large for a test to run; the same fields at a small width run forward.
    for name in MODELS + ["gpt3-small"]:
        fields = ModelConfig.preset(name).to_dict()
        fields.update(vocab_size=64, n_embd=32, ffn_hidden=48, head_dim=8, rotary_dim=8, block_size=64)
        fields.update(sliding_window=min(fields["sliding_window"] or 4, 4))
        if fields["rope_scaling"] is not None:
            fields["rope_scaling"]["original_max_position_embeddings"] = 16
        logits = GPT(ModelConfig.from_dict(fields))(torch.randint(0, 64, (1, 12)))
        assert logits.shape == (1, 12, 64) and logits.isfinite().all(), name


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_round_trips_through_json(name):
    # rope_scaling goes out as HF's dict and comes back as RopeScaling; layer lists stay lists.
    config = ModelConfig.preset(name)
    assert ModelConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
