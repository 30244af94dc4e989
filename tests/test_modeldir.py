import json

import pytest
import torch

from gptkit.config import ModelConfig
from gptkit.model import GPT
from gptkit.formats.modeldir import ModelDirError, load_model_dir, save_model_dir

from conftest import TINY, VARIANTS


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
    with pytest.raises(ModelDirError, match="blocks.1.mlp.fc.weight"):
        load_model_dir(tmp_path)
    state["blocks.1.mlp.fc.weight"] = torch.zeros(3, 3)
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(ModelDirError, match=r"blocks.1.mlp.fc.weight.*\(3, 3\)"):
        load_model_dir(tmp_path)
