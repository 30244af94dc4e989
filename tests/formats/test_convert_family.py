"""`gptkit convert --to-hf --family NAME`, and an imported model exported again as the family it came as."""

from __future__ import annotations

import json

import pytest
import torch

from gptkit.cli import main
from gptkit.config import ModelConfig
from gptkit.formats.modeldir import save_model_dir
from gptkit.model import GPT

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """A tiny Llama-shaped gptkit model (RMSNorm, SwiGLU, RoPE, grouped-query attention, no window)."""
    torch.manual_seed(0)
    model = GPT(ModelConfig.preset("tiny-llama")).eval()
    return save_model_dir(model, tmp_path_factory.mktemp("model"))


def test_family_mistral_round_trip(llama_dir, tmp_path):
    out = tmp_path / "hf"
    assert main(["convert", "--to-hf", str(llama_dir), "--out", str(out), "--family", "mistral"]) == 0
    config = transformers.AutoConfig.from_pretrained(out)
    assert config.model_type == "mistral" and config.architectures == ["MistralForCausalLM"]
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    torch.manual_seed(0)
    model = GPT(ModelConfig.preset("tiny-llama")).eval()  # the same weights as llama_dir's
    tokens = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        # fp32 on both sides; the families tests measure 1e-6 and assert 1e-4, as here
        torch.testing.assert_close(hf_model(tokens).logits, model(tokens), atol=1e-4, rtol=0)
    assert main(["convert", "--to-hf", str(llama_dir), "--out", str(tmp_path / "default")]) == 0
    assert json.loads((tmp_path / "default" / "config.json").read_text())["model_type"] == "llama"  # as inferred


@pytest.mark.parametrize(
    "family, message",
    [("gpt2", "norm 'rmsnorm' cannot be exported as gpt2"), ("bert", "unknown Hugging Face family 'bert'")],
)
def test_a_family_the_model_cannot_be_is_one_line_exit_2(llama_dir, tmp_path, capsys, family, message):
    assert main(["convert", "--to-hf", str(llama_dir), "--out", str(tmp_path / "hf"), "--family", family]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "hf").exists()


def test_family_is_for_exports_only(tmp_path, capsys):
    argv = ["convert", "--from-hf", str(tmp_path), "--out", str(tmp_path / "out"), "--family", "llama"]
    assert main(argv) == 2
    assert "--family applies to --to-hf only" in capsys.readouterr().err


def test_an_imported_mistral_without_a_window_exports_as_mistral(tmp_path):
    # Mistral v0.3 has no sliding window: nothing in its settings calls for mistral, the import remembers it
    hf_config = transformers.MistralConfig(
        vocab_size=128,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=96,
        num_hidden_layers=2,
        max_position_embeddings=64,
        sliding_window=None,
    )
    torch.manual_seed(0)
    transformers.MistralForCausalLM(hf_config).save_pretrained(tmp_path / "mistral")
    assert main(["convert", "--from-hf", str(tmp_path / "mistral"), "--out", str(tmp_path / "gptkit")]) == 0
    assert main(["convert", "--to-hf", str(tmp_path / "gptkit"), "--out", str(tmp_path / "back")]) == 0
    assert transformers.AutoConfig.from_pretrained(tmp_path / "back").model_type == "mistral"
    argv = ["convert", "--to-hf", str(tmp_path / "gptkit"), "--out", str(tmp_path / "llama"), "--family", "llama"]
    assert main(argv) == 0  # --family still wins
    assert transformers.AutoConfig.from_pretrained(tmp_path / "llama").model_type == "llama"
