import json

import pytest
import torch
from helpers import TINY, VARIANTS

from gptkit.config import ModelConfig
from gptkit.formats.modeldir import load_model_dir, save_model_dir
from gptkit.model import GPT
from gptkit.tensors import ModelDirError
from gptkit.weights import WeightsError


@pytest.mark.parametrize("name", ["gpt2", "llama-gqa", "untied-head-bias"])
def test_round_trip_is_bit_identical(tmp_path, name):
    model = GPT(ModelConfig(**VARIANTS[name])).eval()
    save_model_dir(model, tmp_path / "m")
    loaded = load_model_dir(tmp_path / "m")
    assert loaded.config == model.config
    for (key, a), (key_b, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert key == key_b and torch.equal(a, b)
    if model.config.tie_embeddings:
        assert loaded.lm_head.weight is loaded.tok_emb.weight
    ids = torch.randint(0, 50, (2, 9))
    assert torch.equal(model(ids), loaded(ids))
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["format"] == "gptkit" and config["model"]["n_layer"] == 2
    assert not list((tmp_path / "m").glob("*.tmp"))


def test_loads_in_bfloat16(tmp_path):
    save_model_dir(GPT(ModelConfig(**TINY)), tmp_path)
    model = load_model_dir(tmp_path, dtype=torch.bfloat16)
    assert model.tok_emb.weight.dtype == torch.bfloat16


def test_damaged_directories_give_one_line_errors(tmp_path):
    model = GPT(ModelConfig(**TINY))
    save_model_dir(model, tmp_path)
    weights = tmp_path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelDirError, match="model.safetensors"):
        load_model_dir(tmp_path)
    weights.write_bytes(b"\x00" * 100)
    with pytest.raises(ModelDirError, match="model.safetensors"):
        load_model_dir(tmp_path)
    with pytest.raises(ModelDirError, match="does not exist"):
        load_model_dir(tmp_path / "nope")


def test_missing_and_misshapen_tensors_are_named(tmp_path):
    from safetensors.torch import load_file, save_file

    save_model_dir(GPT(ModelConfig(**TINY)), tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    del state["blocks.1.mlp.fc.weight"]
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(WeightsError, match="blocks.1.mlp.fc.weight"):
        load_model_dir(tmp_path)
    state["blocks.1.mlp.fc.weight"] = torch.zeros(3, 3)
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(WeightsError, match=r"blocks.1.mlp.fc.weight.*\(3, 3\)"):
        load_model_dir(tmp_path)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_weight_is_refused_at_load_naming_the_tensor(bad, tmp_path, capsys):
    from gptkit.cli import main
    from gptkit.formats.quantized import save_quantized_dir
    from gptkit.quantization import quantize
    from gptkit.tokenizer import ByteTokenizer

    model = GPT(ModelConfig(**{**TINY, "vocab_size": 257})).eval()
    with torch.no_grad():
        model.blocks[1].mlp.fc.weight[3, 5] = bad
    save_model_dir(model, tmp_path / "m", tokenizer=ByteTokenizer())
    with pytest.raises(WeightsError, match=r"tensor 'blocks.1.mlp.fc.weight' holds 1 NaN or infinite value"):
        load_model_dir(tmp_path / "m")
    # the CLI says so in one line where it would otherwise sample from NaN probabilities
    assert main(["generate", str(tmp_path / "m"), "--prompt", "a", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert "blocks.1.mlp.fc.weight" in err and err.count("\n") == 1 and err.startswith("gptkit generate: error:")
    with torch.no_grad():  # a quantised directory: its int8 per-row scales are checked the same way
        model.blocks[1].mlp.fc.weight[3, 5] = 0.0
        quantized = quantize(model, "int8")
        quantized.blocks[0].attn.proj.scales[2] = bad
    save_quantized_dir(quantized, tmp_path / "q", tokenizer=ByteTokenizer())
    assert main(["generate", str(tmp_path / "q"), "--prompt", "a", "--max-new-tokens", "2"]) == 2
    assert "blocks.0.attn.proj.scales" in capsys.readouterr().err


LORA_SETTINGS = {
    "format": "gptkit-lora",
    "format_version": 1,
    "base_fingerprint": "0" * 64,
    "rank": 2,
    "alpha": 4.0,
    "dropout": 0.0,
    "targets": "all",
    "base_precision": "float32",
}


@pytest.mark.parametrize("pair", [False, True], ids=["its-own-base", "each-others-base"])
def test_lora_directories_whose_bases_form_a_cycle_are_one_line_errors(pair, tmp_path, capsys):
    from gptkit.cli import main
    from gptkit.errors import GptkitError
    from gptkit.loading import load, model_context

    a, b = tmp_path / "a", tmp_path / "b"
    for lora, base in ((a, b if pair else a), (b, a)):
        lora.mkdir()
        (lora / "lora_config.json").write_text(json.dumps({**LORA_SETTINGS, "base": str(base)}))
    chain = f"{a} -> {b} -> {a}" if pair else f"{a} -> {a}"
    with pytest.raises(GptkitError, match="the LoRA bases form a cycle") as raised:
        load(a)
    assert chain in str(raised.value)
    assert model_context(a) is None  # not a RecursionError either
    assert main(["generate", str(a), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert chain in err and err.count("\n") == 1
