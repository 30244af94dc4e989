"""GGUF of the model `make run` trains: a character tokenizer of one document (no special token) goes out with an
added end-of-text token (exact GELU, which llama.cpp computes as tanh GELU: tests/formats/test_gguf_gelu.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from gptkit.cli import main
from gptkit.config import ModelConfig
from gptkit.formats.gguf import export_gguf, load_gguf
from gptkit.formats.modeldir import save_model_dir
from gptkit.model import GPT
from gptkit.tokenizer import EOT, CharTokenizer

gguf = pytest.importorskip("gguf")
TEXT = (Path(__file__).resolve().parents[2] / "gptkit" / "corpora" / "tinyshakespeare.txt").read_text()[:5000]
# The recipe's model cut small: learned positions, no biases, the tanh GELU llama.cpp computes.
SHAPE = dict(block_size=16, n_layer=2, n_head=2, n_embd=32, attn_bias=False, mlp_bias=False, norm_bias=False)


def char_model(activation: str = "gelu_tanh") -> tuple[GPT, CharTokenizer]:
    tokenizer = CharTokenizer.train([TEXT])  # as `gptkit prepare --tokenizer char` makes it of one file: no EOT
    torch.manual_seed(0)
    return GPT(ModelConfig(vocab_size=tokenizer.vocab_size, activation=activation, **SHAPE)).eval(), tokenizer


def test_a_char_tokenizer_without_specials_gets_an_end_of_text_token_and_logits_stay(tmp_path):
    model, tokenizer = char_model()
    assert not tokenizer.special_tokens and tokenizer.eos_id is None
    path = export_gguf(model, tmp_path / "m.gguf", tokenizer, "f32")
    fields = {name: field.contents() for name, field in gguf.GGUFReader(str(path)).fields.items()}
    size = tokenizer.vocab_size
    assert len(fields["tokenizer.ggml.tokens"]) == size + 1 and fields["tokenizer.ggml.tokens"][-1] == EOT
    assert fields["tokenizer.ggml.eos_token_id"] == size  # not llama.cpp's default 11, a character here
    back, back_tokenizer = load_gguf(path)
    assert isinstance(back_tokenizer, CharTokenizer) and back_tokenizer.chars == tokenizer.chars
    assert back_tokenizer.eos_id == size and back.config.vocab_size == size + 1
    ids = torch.tensor([tokenizer.encode(TEXT[:16]), tokenizer.encode(TEXT[100:116])])
    with torch.no_grad():
        theirs, ours = back(ids), model(ids)
    # f32 written and read back: the characters' logits are the model's bit for bit; the added token's row is zero,
    # so its logit is exactly 0 at every position.
    torch.testing.assert_close(theirs[..., :size], ours, atol=0, rtol=0)
    assert torch.equal(theirs[..., size], torch.zeros_like(theirs[..., size]))


def test_the_readmes_gguf_commands_run_on_a_char_model(tmp_path, capsys):
    model, tokenizer = char_model()
    source = save_model_dir(model, tmp_path / "step-002000", tokenizer=tokenizer)
    out = tmp_path / "shakespeare.gguf"
    assert main(["convert", "--to-gguf", str(source), "--out", str(out), "--type", "q8_0"]) == 0
    assert main(["convert", "--from-gguf", str(out), "--out", str(tmp_path / "back")]) == 0
    capsys.readouterr()
    assert main(["generate", str(out), "--prompt", "ROMEO:", "--max-new-tokens", "8", "--temperature", "0"]) == 0
    text = capsys.readouterr().out
    assert len(text) > 1 and set(text) <= set(tokenizer.chars)  # 8 characters of the model's own


def test_a_char_vocabulary_with_its_own_end_of_text_adds_nothing(tmp_path):
    tokenizer = CharTokenizer.train([TEXT], [EOT])  # several documents: prepare adds the token itself
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=tokenizer.vocab_size, **SHAPE)).eval()
    path = export_gguf(model, tmp_path / "m.gguf", tokenizer, "f32")
    back, back_tokenizer = load_gguf(path)
    assert isinstance(back_tokenizer, CharTokenizer) and back_tokenizer.chars == tokenizer.chars
    assert back.config.vocab_size == tokenizer.vocab_size and back_tokenizer.eos_id == tokenizer.eos_id
    ids = torch.from_numpy(np.asarray([tokenizer.encode(TEXT[:16])]))
    with torch.no_grad():
        torch.testing.assert_close(back(ids), model(ids), atol=0, rtol=0)
