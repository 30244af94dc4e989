import json

import pytest

from gptkit.config import PRESETS, ModelConfig
from gptkit.errors import ConfigError


def test_defaults_derive_kv_heads_and_ffn_width():
    config = ModelConfig(n_embd=96, n_head=4)
    assert config.n_kv_head == 4
    assert config.ffn_hidden == 384
    swiglu = ModelConfig(n_embd=96, n_head=4, activation="swiglu")
    assert swiglu.ffn_hidden == 256  # 8/3 * 96 = 256 exactly, already a multiple of 64
    assert ModelConfig(n_embd=128, n_head=4, activation="swiglu").ffn_hidden == 384  # 341.3 rounded up to 64s


def test_json_round_trip_is_exact():
    config = ModelConfig.preset("llama-15m")
    again = ModelConfig.from_dict(json.loads(json.dumps(config.to_dict())))
    assert again == config


@pytest.mark.parametrize(
    "field, value",
    [
        ("vocab_size", 0),
        ("block_size", -3),
        ("n_layer", 1.5),
        ("n_head", 5),  # does not divide n_embd 768
        ("n_kv_head", 5),  # does not divide n_head 12
        ("activation", "tanh"),
        ("norm", "batchnorm"),
        ("norm_position", "middle"),
        ("position", "alibi"),
        ("dropout", 1.0),
        ("norm_eps", 0.0),
        ("rope_theta", -1.0),
        ("tie_embeddings", "yes"),
        ("attn_bias", 1),
    ],
)
def test_bad_values_raise_value_error_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        ModelConfig(**{field: value})


def test_rope_needs_even_head_size():
    with pytest.raises(ValueError, match="rope"):
        ModelConfig(n_embd=36, n_head=4, position="rope")


def test_unknown_field_is_named():
    with pytest.raises(ValueError, match="n_layers"):
        ModelConfig.from_dict({"n_layers": 4})


def test_unknown_preset_lists_choices():
    with pytest.raises(ValueError, match="gpt2-medium"):
        ModelConfig.preset("gpt5")


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_is_valid(name):
    config = ModelConfig.preset(name)
    assert config.n_embd % config.n_head == 0


def test_spec_table_presets_have_their_architecture():
    decoder = ModelConfig.preset("transformer-decoder")
    assert (decoder.norm, decoder.norm_position, decoder.position, decoder.activation) == (
        "layernorm",
        "post",
        "sinusoidal",
        "relu",
    )
    gpt1 = ModelConfig.preset("gpt1-style")
    assert (gpt1.norm_position, gpt1.position, gpt1.activation, gpt1.tie_embeddings) == (
        "post",
        "learned",
        "gelu",
        True,
    )
    gpt2 = ModelConfig.preset("gpt2")
    assert (gpt2.norm_position, gpt2.position, gpt2.activation, gpt2.block_size, gpt2.vocab_size) == (
        "pre",
        "learned",
        "gelu_tanh",
        1024,
        50257,
    )
    llama = ModelConfig.preset("llama-110m")
    assert (llama.norm, llama.position, llama.activation, llama.tie_embeddings, llama.attn_bias) == (
        "rmsnorm",
        "rope",
        "swiglu",
        False,
        False,
    )
    assert llama.n_kv_head < llama.n_head


def test_load_reads_json_files_and_model_dirs(tmp_path):
    config = ModelConfig(n_layer=3)
    (tmp_path / "c.json").write_text(json.dumps(config.to_dict()))
    assert ModelConfig.load(tmp_path / "c.json") == config
    (tmp_path / "config.json").write_text(json.dumps({"model": config.to_dict()}))
    assert ModelConfig.load(tmp_path) == config
    with pytest.raises(ValueError, match="neither a preset nor a config file"):
        ModelConfig.load(tmp_path / "missing.json")


def test_a_fine_tune_may_extend_a_rope_models_context_but_change_nothing_else():
    from gptkit.config import ModelSection, resolve_model

    rope = ModelConfig.preset("tiny-llama")
    scaling = {"rope_type": "linear", "factor": 4.0}
    section = ModelSection(init_from="base", fields={"block_size": 512, "rope_scaling": scaling, "dropout": 0.1})
    extended = resolve_model(section, rope.vocab_size, rope)
    assert (extended.block_size, extended.rope_scaling.rope_type, extended.rope_scaling.factor) == (512, "linear", 4.0)
    with pytest.raises(ConfigError, match="^model.n_head 8 conflicts with init_from's 4; only block_size, dropout, "):
        resolve_model(ModelSection(init_from="base", fields={"n_head": 8}), rope.vocab_size, rope)
    learned = ModelConfig.preset("tiny")  # learned positions: a longer context needs new position rows
    with pytest.raises(ConfigError, match="^model.block_size 512 conflicts with init_from's 128; only dropout may"):
        resolve_model(ModelSection(init_from="base", fields={"block_size": 512}), learned.vocab_size, learned)
