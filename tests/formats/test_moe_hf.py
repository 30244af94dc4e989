"""Mixture-of-experts families against transformers' own classes: Mixtral, Qwen2-MoE (shared expert), Qwen3-MoE and
OLMoE, imported from what save_pretrained writes and exported back to what from_pretrained reads (tiny, fp32)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from gptkit.config import ModelConfig
from gptkit.formats.hf import (
    ConversionError,
    export_family,
    export_hf,
    gpt_from_hf_model,
    hf_block_modules,
    hf_config_from_gptkit,
    load_hf,
)
from gptkit.presets import PRESETS

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()
from transformers import AutoModelForCausalLM

TINY = {
    "vocab_size": 128,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 3,
    "intermediate_size": 96,
    "max_position_embeddings": 64,
    "bos_token_id": None,
    "eos_token_id": None,
    "pad_token_id": None,
}
# family id -> (config class, the config's arguments)
FAMILIES = {
    "mixtral": ("MixtralConfig", dict(TINY, num_local_experts=4, num_experts_per_tok=2)),
    "qwen2-moe": (
        "Qwen2MoeConfig",
        dict(
            TINY,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=40,
            shared_expert_intermediate_size=56,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
            norm_topk_prob=False,
        ),
    ),
    "qwen3-moe": (
        "Qwen3MoeConfig",
        dict(
            TINY,
            num_experts=8,
            num_experts_per_tok=3,
            moe_intermediate_size=32,
            head_dim=24,
            norm_topk_prob=True,
            decoder_sparse_step=2,
        ),
    ),
    "olmoe": ("OlmoeConfig", dict(TINY, num_experts=4, num_experts_per_tok=2, norm_topk_prob=False)),
}
SEQ = 20


def hf_model(family: str) -> torch.nn.Module:
    """A tiny random transformers model of the family, in eval mode, fp32."""
    class_name, arguments = FAMILIES[family]
    torch.manual_seed(0)
    config = getattr(transformers, class_name)(**arguments)
    model = AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():  # larger than the init's 0.02, so that routing and every expert matter to the logits
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.1)
    return model


@pytest.mark.parametrize("family", FAMILIES)
def test_import_and_export_match_transformers(family: str, tmp_path: Path) -> None:
    hf = hf_model(family)
    hf.save_pretrained(tmp_path / "hf")
    ids = torch.randint(0, TINY["vocab_size"], (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(ids).logits
    model, _ = load_hf(tmp_path / "hf")
    assert model.config.n_experts == FAMILIES[family][1].get(
        "num_experts", FAMILIES[family][1].get("num_local_experts")
    )
    with torch.no_grad():
        ours = model(ids)
    # fp32 through 3 layers: measured differences about 1e-6; a token routed to another expert differs by about 0.1.
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-4)
    export_hf(model, tmp_path / "back")
    written = json.loads((tmp_path / "back" / "config.json").read_text())
    assert written["model_type"] == hf.config.model_type
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "back").float().eval()
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, ours, rtol=0, atol=1e-4)
    again, _ = load_hf(tmp_path / "back")
    assert again.config == model.config


def test_each_moe_preset_exports_as_its_own_family() -> None:
    for preset, model_type in (("mixtral-8x7b", "mixtral"), ("qwen3-30b-a3b", "qwen3_moe"), ("olmoe-1b-7b", "olmoe")):
        assert export_family(ModelConfig.preset(preset)).model_type == model_type


def test_exports_a_family_cannot_hold_are_refused() -> None:
    tiny = dict(PRESETS["tiny-llama"], n_experts=4, n_experts_per_token=2)
    with pytest.raises(ConversionError, match="moe_ffn_hidden 32 cannot be exported as mixtral"):
        hf_config_from_gptkit(ModelConfig(**tiny, moe_ffn_hidden=32))
    with pytest.raises(ConversionError, match="dense model cannot be exported as mixtral"):
        hf_config_from_gptkit(ModelConfig.preset("tiny-llama"), family_name="mixtral")
    with pytest.raises(ConversionError, match="moe_renormalize False cannot be exported as mixtral"):
        hf_config_from_gptkit(ModelConfig(**tiny, moe_renormalize=False))
    with pytest.raises(ConversionError, match="moe_shared_gate False cannot be exported as qwen2_moe"):
        hf_config_from_gptkit(ModelConfig(**tiny), family_name="qwen2_moe")


def test_adapters_see_the_dense_modules_of_an_moe_export() -> None:
    config = ModelConfig.preset("tiny-llama")
    config = ModelConfig(**dict(config.to_dict(), n_experts=4, n_experts_per_token=2, qk_norm=True, moe_layer_step=2))
    modules, _ = hf_block_modules(config)
    rows = config.ffn_hidden
    assert modules["blocks.0.mlp.fc"] == [("model.layers.0.mlp.gate_proj", rows), ("model.layers.0.mlp.up_proj", rows)]
    assert "blocks.1.mlp.fc" not in modules and "blocks.1.attn.qkv" in modules


@pytest.mark.parametrize("family", ["mixtral", "qwen2-moe"])
def test_import_of_an_in_memory_model(family: str) -> None:
    hf = hf_model(family)  # its experts fused in memory (gate_up_proj, down_proj), unlike its files
    ids = torch.randint(0, TINY["vocab_size"], (1, SEQ), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(gpt_from_hf_model(hf)(ids), hf(ids).logits, rtol=0, atol=1e-4)
