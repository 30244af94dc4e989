"""Hugging Face families against transformers' own classes: import, greedy generation, export back (tiny models).

Each family is one entry of FAMILIES: a tiny random model built from the family's own config class, with the setting
that family is known for switched on (a window shorter than the test sequence, a RoPE scaling rule, partial rotary,
softcaps, multipliers). Adding a family is one entry.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from gptkit.formats.hf import export_family, export_hf, gpt_from_hf_model, hf_model_from_gpt, load_hf
from gptkit.model import GPT
from gptkit.weights import model_state

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()
from transformers import AutoModelForCausalLM

WINDOW = 7  # shorter than half the test sequence, so that every windowed layer drops keys
SEQ = 24
TINY = {
    "vocab_size": 128,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "intermediate_size": 96,
    "max_position_embeddings": 64,
    "bos_token_id": None,
    "eos_token_id": None,
    "pad_token_id": None,
}
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
# family id -> (config class, model class, the config's arguments)
FAMILIES = {
    "llama-3.1": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(TINY, num_key_value_heads=2, num_hidden_layers=2, rope_parameters=LLAMA3_ROPE),
    ),
    "llama-3.2-tied": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(TINY, num_key_value_heads=1, num_hidden_layers=2, rope_parameters=LLAMA3_ROPE, tie_word_embeddings=True),
    ),
    "mistral-v0.1": (
        "MistralConfig",
        "MistralForCausalLM",
        dict(TINY, num_key_value_heads=2, num_hidden_layers=2, sliding_window=WINDOW),
    ),
    # v0.3 has no window; a head_dim apart from hidden_size / heads as in Mistral NeMo.
    "mistral-v0.3": (
        "MistralConfig",
        "MistralForCausalLM",
        dict(TINY, num_key_value_heads=2, num_hidden_layers=2, sliding_window=None, head_dim=24),
    ),
    "qwen2.5-window": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(
            TINY,
            num_key_value_heads=2,
            num_hidden_layers=3,
            use_sliding_window=True,
            sliding_window=WINDOW,
            max_window_layers=1,
            tie_word_embeddings=True,
        ),
    ),
    "qwen2.5": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(TINY, num_key_value_heads=2, num_hidden_layers=2, use_sliding_window=False, sliding_window=WINDOW),
    ),
    "qwen3-yarn": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(
            TINY,
            num_key_value_heads=2,
            num_hidden_layers=2,
            head_dim=16,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        ),
    ),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            TINY,
            num_key_value_heads=2,
            num_hidden_layers=4,
            head_dim=16,
            sliding_window=WINDOW,
            query_pre_attn_scalar=24,
            layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
        ),
    ),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(
            TINY,
            num_key_value_heads=2,
            num_hidden_layers=3,
            head_dim=16,
            sliding_window=WINDOW,
            query_pre_attn_scalar=16,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=3.0,
        ),
    ),
    "smollm3": (
        "SmolLM3Config",
        "SmolLM3ForCausalLM",
        dict(TINY, num_key_value_heads=2, num_hidden_layers=4, no_rope_layer_interval=2),
    ),
    # Phi-4-mini: three quarters of each head rotated, LongRoPE; a window as Phi-3-mini's.
    "phi4-mini": (
        "Phi3Config",
        "Phi3ForCausalLM",
        dict(
            TINY,
            num_key_value_heads=2,
            num_hidden_layers=2,
            sliding_window=WINDOW,
            original_max_position_embeddings=16,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.75,
                "short_factor": [1.0, 1.1, 1.3, 1.5, 2.0, 2.5],
                "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 8.0],
            },
        ),
    ),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(TINY, num_hidden_layers=2)),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", dict(TINY, num_key_value_heads=2, num_hidden_layers=2)),
    "pythia": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(TINY, num_hidden_layers=2)),  # rotary_pct 0.25, parallel
    "gpt-neox-sequential": (
        "GPTNeoXConfig",
        "GPTNeoXForCausalLM",
        dict(
            TINY,
            num_hidden_layers=2,
            use_parallel_residual=False,
            hidden_act="gelu_new",
            rope_parameters={"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.5},
        ),
    ),
    "granite": (
        "GraniteConfig",
        "GraniteForCausalLM",
        dict(
            TINY,
            num_key_value_heads=2,
            num_hidden_layers=2,
            embedding_multiplier=12.0,
            residual_multiplier=0.22,
            attention_multiplier=0.0078125,
            logits_scaling=8.0,
        ),
    ),
}


def make_hf(name: str, seed: int = 0) -> torch.nn.Module:
    """The family's tiny model with every parameter random (norm gains and biases too, so each mapping is tested)."""
    config_class, model_class, kwargs = FAMILIES[name]
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(getattr(transformers, config_class)(**kwargs))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return model.eval()


def ids(shape: tuple[int, int] = (2, SEQ), seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 128, shape, generator=torch.Generator().manual_seed(seed))


def assert_same_logits(hf_model: torch.nn.Module, model: GPT) -> None:
    tokens = ids()
    with torch.no_grad():
        expected, got = hf_model(tokens).logits, model(tokens)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)  # fp32 on both sides: the brief's bound


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory) -> tuple[str, torch.nn.Module, Path]:
    path = tmp_path_factory.mktemp(request.param)
    hf_model = make_hf(request.param)
    hf_model.save_pretrained(path)
    return request.param, hf_model, path


def test_import_gives_transformers_logits(family) -> None:
    _, hf_model, path = family
    model, _ = load_hf(path)
    assert_same_logits(hf_model, model)
    from_memory = gpt_from_hf_model(hf_model)
    assert from_memory.config == model.config
    for (a, x), (b, y) in zip(model_state(from_memory).items(), model_state(model).items()):
        assert a == b and torch.equal(x, y), a


def test_export_loads_as_the_same_family_with_the_same_logits(family, tmp_path) -> None:
    _, hf_model, path = family
    model, _ = load_hf(path)
    model_type = hf_model.config.model_type
    export_hf(model, tmp_path / "out", family=model_type)
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (written["model_type"], written["architectures"]) == (model_type, [type(hf_model).__name__])
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(again) is type(hf_model)
    assert_same_logits(again, model)
    back, _ = load_hf(tmp_path / "out")
    assert back.config == model.config
    assert all(torch.equal(x, y) for x, y in zip(model_state(back).values(), model_state(model).values()))


def test_greedy_generation_matches_transformers(family, monkeypatch) -> None:
    from gptkit.decoding.api import generate_ids
    from gptkit.native import library

    if library.load():  # the fused CPU step as if measured faster here, wherever it covers the model
        monkeypatch.setitem(library.STATE, "choices", dict(library.choices(), fused_step=True))
    _, hf_model, path = family
    model, _ = load_hf(path)
    prompt = ids((1, 8), seed=3)[0].tolist()
    tokens = torch.tensor([prompt])
    # An explicit mask: without one transformers takes prompt tokens equal to pad_token_id for padding.
    out = hf_model.generate(
        tokens,
        attention_mask=torch.ones_like(tokens),
        max_new_tokens=32,
        min_new_tokens=32,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    expected = out[0, len(prompt) :].tolist()
    assert generate_ids(model, prompt, max_new_tokens=32, temperature=0) == expected


# The family an export picks when none is named: the one whose signature setting the model has.
DEFAULT_EXPORT = {
    "llama-3.1": "llama",
    "mistral-v0.1": "mistral",
    "mistral-v0.3": "llama",
    "qwen2.5-window": "qwen2",
    "qwen3-yarn": "qwen3",
    "gemma3": "gemma3_text",
    "gemma2": "gemma2",
    "smollm3": "smollm3",
    "phi4-mini": "phi3",
    "olmo2": "olmo2",
    "pythia": "gpt_neox",
    "granite": "granite",
}


@pytest.mark.parametrize("name", list(DEFAULT_EXPORT))
def test_export_picks_the_family_the_settings_call_for(name) -> None:
    config = gpt_from_hf_model(make_hf(name)).config
    assert export_family(config).model_type == DEFAULT_EXPORT[name]


def test_in_memory_export_of_a_renamed_head(tmp_path) -> None:
    model = gpt_from_hf_model(make_hf("pythia"))  # GPT-NeoX files name the head embed_out, its modules lm_head
    hf_model = hf_model_from_gpt(model)
    assert type(hf_model).__name__ == "GPTNeoXForCausalLM"
    assert_same_logits(hf_model, model)
