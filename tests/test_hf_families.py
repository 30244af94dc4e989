"""Hugging Face families against transformers' own classes: import, greedy generation, export back (tiny models).

Each family is one entry of FAMILIES: a tiny random model built from the family's own config class, with the setting
that family is known for switched on (a window shorter than the test sequence, a RoPE scaling rule, partial rotary,
softcaps, multipliers). Adding a family is one entry.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from gptkit.config import ModelConfig
from gptkit.errors import GptkitError
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
    from gptkit import cpu_kernels
    from gptkit.decoding.api import generate_ids

    if cpu_kernels.load():  # the fused CPU step as if measured faster here, wherever it covers the model
        monkeypatch.setitem(cpu_kernels._STATE, "choices", dict(cpu_kernels.choices(), fused_step=True))
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


def edit(drop: tuple[str, ...] = ("rope_parameters",), **entries) -> Callable[[dict], None]:
    """A change to a saved config.json: keys dropped (by default transformers 5's rope_parameters), entries set."""

    def change(data: dict) -> None:
        for key in drop:
            del data[key]
        data.update(entries)

    return change


LLAMA3_SCALING = {key: value for key, value in LLAMA3_ROPE.items() if key != "rope_theta"}
LONGROPE = FAMILIES["phi4-mini"][2]["rope_parameters"]
# family id -> how a config.json written by older transformers (or by hand) says the same thing
LEGACY = {
    "llama-3.1": edit(rope_theta=500000.0, rope_scaling=LLAMA3_SCALING),  # as Llama 3.1's own config.json
    "gemma3": edit(
        ("rope_parameters", "layer_types"),
        rope_theta=1e6,
        rope_local_base_freq=1e4,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
        sliding_window_pattern=3,
    ),
    "pythia": edit(rotary_pct=0.25, rotary_emb_base=10000),
    "gpt-neox-sequential": edit(rotary_pct=0.5, rotary_emb_base=500),
    "phi4-mini": edit(
        rope_theta=10000.0,
        partial_rotary_factor=0.75,
        rope_scaling={
            "type": "longrope",
            "short_factor": LONGROPE["short_factor"],
            "long_factor": LONGROPE["long_factor"],
        },
    ),
    "qwen2.5-window": edit(("layer_types",)),  # derived from max_window_layers
    "smollm3": edit(("layer_types", "no_rope_layers")),  # derived from no_rope_layer_interval
}


def rewritten(tmp_path: Path, name: str, change: Callable[[dict], None]) -> Path:
    """Family `name` saved, its config.json changed."""
    make_hf(name).save_pretrained(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    change(data)
    (tmp_path / "config.json").write_text(json.dumps(data))
    return tmp_path


@pytest.mark.parametrize("name", list(LEGACY))
def test_older_config_keys_read_as_transformers_reads_them(name, tmp_path) -> None:
    path = rewritten(tmp_path, name, LEGACY[name])
    model, _ = load_hf(path)
    assert model.config == gpt_from_hf_model(make_hf(name)).config  # the same model as the transformers 5 file
    assert_same_logits(AutoModelForCausalLM.from_pretrained(path).eval(), model)


@pytest.mark.parametrize(
    "name, change, match",
    [
        ("gemma3", edit((), use_bidirectional_attention=True), "use_bidirectional_attention=true is not supported"),
        (
            "gemma3",
            edit(
                rope_parameters={
                    "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                    "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
                }
            ),
            "RoPE scaling 'linear' on sliding layers",
        ),
        ("gemma2", edit((), hidden_activation="gelu"), "hidden_activation 'gelu'"),
        ("gemma2", edit((), layer_types=["sliding_attention", "chunked_attention", "full_attention"]), "'chunked"),
        ("pythia", edit((), head_dim=8), "head_dim 8 is not supported: gpt_neox's heads are"),
        ("smollm3", edit((), no_rope_layers=[1, 2, 1, 0]), "no_rope_layers must hold a 0 or 1 per layer"),
        ("phi3", edit((), rope_parameters={"rope_type": "dynamic"}), "rope_scaling.factor is required"),
    ],
)
def test_import_refuses_what_gptkit_does_not_compute(name, change, match, tmp_path) -> None:
    with pytest.raises(GptkitError, match=match) as err:
        load_hf(rewritten(tmp_path, name, change))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "name, family, match",
    [
        ("gemma3", "llama", "norm_position 'sandwich' cannot be exported as llama"),
        ("mistral-v0.1", "llama", "sliding_window 7 cannot be exported as llama"),
        ("qwen2.5-window", "mistral", "layer_types cannot be exported as mistral"),
        ("granite", "llama", "embedding_scale 12.0 cannot be exported as llama: granite has"),
        ("phi4-mini", "llama", "rotary_dim 12 cannot be exported as llama"),
        ("smollm3", "qwen3", "qk_norm False cannot be exported as qwen3"),
        ("olmo2", "qwen3", "norm_position 'sublayer_post' cannot be exported as qwen3"),
        ("gemma2", "gemma3_text", "qk_norm False cannot be exported as gemma3_text"),
        ("llama-3.1", "falcon", "unknown Hugging Face family 'falcon'"),
    ],
)
def test_export_as_a_family_that_cannot_hold_the_model_is_refused(name, family, match, tmp_path) -> None:
    model = gpt_from_hf_model(make_hf(name))
    with pytest.raises(GptkitError, match=match) as err:
        export_hf(model, tmp_path / "out", family=family)
    assert "\n" not in str(err.value)
    assert not (tmp_path / "out" / "config.json").exists()


@pytest.mark.parametrize(
    "name, dropped, field, value",
    [
        ("smollm3", ("rope_parameters",), "rope_theta", 2e6),
        ("gemma3", ("rope_parameters",), "rope_local_theta", 1e4),
        ("qwen2.5-window", ("sliding_window",), "sliding_window", 4096),
        (
            "gemma2",
            ("attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar"),
            "attn_softcap",
            50.0,
        ),
        ("phi3", ("rms_norm_eps",), "norm_eps", 1e-5),
        ("pythia", ("rope_parameters", "use_parallel_residual"), "rotary_dim", 4),
    ],
)
def test_omitted_keys_take_the_config_class_defaults(name, dropped, field, value, tmp_path) -> None:
    path = rewritten(tmp_path, name, edit(dropped))
    model, _ = load_hf(path)
    assert getattr(model.config, field) == value
    assert_same_logits(AutoModelForCausalLM.from_pretrained(path).eval(), model)


NATIVE = {
    "vocab_size": 128,
    "block_size": 64,
    "n_layer": 2,
    "n_head": 4,
    "n_kv_head": 2,
    "n_embd": 64,
    "ffn_hidden": 96,
    "position": "rope",
    "norm": "rmsnorm",
    "activation": "swiglu",
    "attn_bias": False,
    "mlp_bias": False,
    "norm_bias": False,
}
# gptkit configs (as a run trains them) -> the family their export picks
NATIVE_EXPORTS = [
    (dict(NATIVE, rope_scaling=LLAMA3_SCALING, rope_theta=500000.0), "llama"),
    (dict(NATIVE, sliding_window=5), "mistral"),
    (dict(NATIVE, sliding_window=5, layer_types=["full", "sliding"]), "qwen2"),
    (dict(NATIVE, qk_norm=True, sliding_window=5, layer_types=["sliding", "full"]), "qwen3"),
    (dict(NATIVE, rotary_dim=8), "phi3"),
    (dict(NATIVE, nope_layers=[1]), "smollm3"),
    (dict(NATIVE, residual_scale=0.5, logit_scale=0.25), "granite"),
    (dict(NATIVE, qk_norm=True, qk_norm_scope="width", norm_position="sublayer_post"), "olmo2"),
    (
        dict(
            NATIVE,
            norm_position="sandwich",
            activation="geglu",
            norm_gain_offset=1.0,
            embedding_scale=8.0,
            attn_softcap=20.0,
            logit_softcap=10.0,
        ),
        "gemma2",
    ),
    (
        dict(
            NATIVE,
            n_kv_head=4,
            norm="layernorm",
            norm_bias=True,
            parallel_residual=True,
            activation="gelu",
            rotary_dim=4,
        ),
        "gpt_neox",
    ),
]


@pytest.mark.parametrize("changes, model_type", NATIVE_EXPORTS, ids=[m for _, m in NATIVE_EXPORTS])
def test_gptkit_models_export_to_the_family_their_settings_call_for(changes, model_type, tmp_path) -> None:
    torch.manual_seed(0)
    model = GPT(ModelConfig(**changes)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    export_hf(model, tmp_path / "out")
    hf_model = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert hf_model.config.model_type == model_type
    assert_same_logits(hf_model, model)
    assert load_hf(tmp_path / "out")[0].config == model.config
