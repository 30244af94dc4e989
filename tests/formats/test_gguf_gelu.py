"""Exact GELU goes to GGUF as llama.cpp's tanh GELU, with the measured change in the logits stated; a model whose
logits change more than MAX_CHANGE is refused with the way out. And the convert line counts the file's tokens."""

from __future__ import annotations

import dataclasses
import logging
import re
from pathlib import Path

import pytest
import torch

import gptkit.formats.gguf.write as write
from gptkit.cli import main
from gptkit.config import ModelConfig
from gptkit.formats.gguf import export_gguf, load_gguf
from gptkit.formats.gguf.gelu import tanh_gelu_change
from gptkit.formats.modeldir import save_model_dir
from gptkit.model import GPT
from gptkit.tokenizer import CharTokenizer

pytest.importorskip("gguf")
TEXT = (Path(__file__).resolve().parents[2] / "gptkit" / "corpora" / "tinyshakespeare.txt").read_text()[:5000]
# nanoGPT's recipe cut small: learned positions, no biases, exact GELU.
SHAPE = dict(block_size=32, n_layer=2, n_head=2, n_embd=32, attn_bias=False, mlp_bias=False, norm_bias=False)


def exact_gelu_model() -> tuple[GPT, CharTokenizer]:
    tokenizer = CharTokenizer.train([TEXT])
    torch.manual_seed(0)
    return GPT(ModelConfig(vocab_size=tokenizer.vocab_size, activation="gelu", **SHAPE)).eval(), tokenizer


def test_the_change_is_the_difference_to_the_same_weights_with_tanh_gelu():
    model, _ = exact_gelu_model()
    twin = GPT(dataclasses.replace(model.config, activation="gelu_tanh")).eval()
    twin.load_state_dict(model.state_dict())
    ids = torch.randint(0, model.config.vocab_size, (4, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = (model(ids) - twin(ids)).abs().max().item()
    assert tanh_gelu_change(model) == want and 0 < want < 1e-2
    assert model.config.activation == "gelu" and all(
        getattr(m, "activation", "gelu") == "gelu" for m in model.modules()
    )  # the model computes exact GELU again afterwards


def test_an_exact_gelu_model_is_written_with_the_change_stated(tmp_path, caplog):
    model, tokenizer = exact_gelu_model()
    with caplog.at_level(logging.WARNING, logger="gptkit.formats.gguf.write"):
        path = export_gguf(model, tmp_path / "m.gguf", tokenizer, "f32")
    [stated] = re.findall(r"logits change by at most ([0-9.e-]+)", caplog.text)
    assert float(stated) == pytest.approx(tanh_gelu_change(model), rel=0.05)  # printed to 2 significant digits
    back, _ = load_gguf(path)
    assert back.config.activation == "gelu_tanh"  # what llama.cpp computes, read back as such
    ids = torch.tensor([tokenizer.encode(TEXT[:32])])
    with torch.no_grad():
        change = (back(ids)[..., : tokenizer.vocab_size] - model(ids)).abs().max().item()
    assert change < 1e-2  # the same order as the stated change (measured on random ids, this on text)


def test_past_the_limit_it_is_refused_in_one_line_naming_the_fix(tmp_path, capsys, monkeypatch):
    model, tokenizer = exact_gelu_model()
    source = save_model_dir(model, tmp_path / "model", tokenizer=tokenizer)
    monkeypatch.setattr(write, "MAX_CHANGE", 0.0)
    assert main(["convert", "--to-gguf", str(source), "--out", str(tmp_path / "m.gguf")]) == 2
    err = capsys.readouterr().err
    assert "--model.activation gelu_tanh" in err and err.count("\n") == 1 and not (tmp_path / "m.gguf").exists()


def test_the_convert_line_counts_the_files_tokens(tmp_path, capsys):
    model, tokenizer = exact_gelu_model()
    source = save_model_dir(model, tmp_path / "model", tokenizer=tokenizer)
    assert main(["convert", "--to-gguf", str(source), "--out", str(tmp_path / "m.gguf")]) == 0
    size = tokenizer.vocab_size
    assert f"vocab {size + 1} ({size} + <|endoftext|>)" in capsys.readouterr().out
