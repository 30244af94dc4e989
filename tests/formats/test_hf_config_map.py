"""The HF config mapping against transformers: older config.json forms and omitted keys read as transformers reads
them, refusals name the setting, and gptkit-trained models export to the family their settings call for."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from gptkit.config import ModelConfig
from gptkit.errors import GptkitError
from gptkit.formats.hf import export_hf, gpt_from_hf_model, load_hf
from gptkit.model import GPT
from tests.formats.test_hf_families import FAMILIES, LLAMA3_ROPE, assert_same_logits, make_hf

transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM


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
        (
            "gemma3",
            edit(rope_parameters={"full_attention": {"rope_type": "default", "partial_rotary_factor": 0.5}}),
            "RoPE setting 'partial_rotary_factor' is not supported: Gemma 3 rotates the full head",
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
        ("llama-3.1", "phi3", "rope_scaling 'llama3' cannot be exported as phi3: its config takes longrope only"),
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


@pytest.mark.parametrize("name", ["gemma3", "pythia", "phi4-mini"])
def test_a_classifier_exports_as_the_family_s_sequence_classifier(name, tmp_path) -> None:
    from gptkit.finetune.heads import SequenceClassifier

    torch.manual_seed(0)
    classifier = SequenceClassifier(gpt_from_hf_model(make_hf(name)), ["neg", "pos"]).eval()
    export_hf(classifier.gpt, tmp_path / "out", head=(classifier.labels, classifier.score.weight))
    hf_model = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "out").eval()
    assert type(hf_model).__name__.endswith("ForSequenceClassification")
    tokens = torch.randint(0, 128, (1, 11), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():  # without a pad id transformers scores the last token of a single row
        want = hf_model(input_ids=tokens).logits
        got, _ = classifier(tokens, torch.tensor([10]))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
