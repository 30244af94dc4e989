"""Every decoding entry point gives the uncached forward pass's greedy tokens: CLI, generate, stream, generate_ids,
the server, beam search and speculative decoding; eager and compiled; fp32 with gptkit's CPU kernels on and off."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from fastapi.testclient import TestClient
from helpers import VARIANTS

from gptkit.cli import main
from gptkit.config import ModelConfig
from gptkit.decoding.api import generate, generate_ids, sampling_params, stream
from gptkit.decoding.sampling import SamplingParams
from gptkit.errors import ConfigError
from gptkit.formats.modeldir import save_model_dir
from gptkit.loading import load
from gptkit.model import GPT
from gptkit.native import build, library
from gptkit.serving.server import ServeOptions, build_app
from gptkit.tokenizer import CharTokenizer

CHARS = "abcdefghijklmnopqrstuvwxyz .,"
PROMPT = "the cat"


def uncached_greedy(model: GPT, prompt: list[int], steps: int) -> list[int]:
    """The reference: a full forward pass per token, cropped to block_size for learned positions only."""
    ids, out = list(prompt), []
    with torch.no_grad():
        for _ in range(steps):
            context = ids[-model.config.block_size :] if model.config.position == "learned" else ids
            token = int(model(torch.tensor([context]))[0, -1].argmax())
            ids.append(token)
            out.append(token)
    return out


def sharpened(variant: str, **overrides) -> GPT:
    """A random model whose logits are far apart (greedy picks cannot flip on summation order)."""
    config = ModelConfig(**dict(VARIANTS[variant], vocab_size=len(CHARS), **overrides))
    torch.manual_seed(0)
    model = GPT(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.4)
    return model


def use_kernels(monkeypatch, on: bool) -> None:
    """gptkit's kernels for every product they take, or for none (as GPTKIT_CPU_KERNELS=0 leaves it)."""
    monkeypatch.setitem(library.STATE, "choices", {"fp32": on, "bf16": on, "int8": on, "bf16_upcast": False})


@pytest.fixture(params=["kernels on", "kernels off"])
def kernels(request, monkeypatch):
    """Both settings; "kernels on" where this CPU runs them."""
    on = request.param == "kernels on"
    if on and not library.load():
        pytest.skip("this CPU runs no gptkit kernel")
    use_kernels(monkeypatch, on)
    return on


@pytest.fixture
def quick_compile(monkeypatch):
    """Compiled steps without inductor's GEMM autotuning: it picks among kernels (speed), not what they compute."""
    from gptkit.decoding import step

    monkeypatch.setattr(step, "_autotune", lambda *args: False)


@pytest.fixture
def model_dir(tmp_path):
    tokenizer = CharTokenizer(list(CHARS), specials=[])  # no end-of-text token: every request runs to its length
    return save_model_dir(sharpened("llama-gqa", block_size=64), tmp_path / "model", tokenizer), tokenizer


@pytest.mark.parametrize("variant", ["gpt2", "llama-gqa"])
def test_eager_entry_points_give_the_uncached_greedy_tokens(kernels, variant, tmp_path, capsys):
    model = sharpened(variant)  # block_size 16: 5 + 20 tokens pass it (learned positions slide, RoPE continues)
    tokenizer = CharTokenizer(list(CHARS), specials=[])
    ids = tokenizer.encode(PROMPT)
    want = uncached_greedy(model, ids, 20)
    text = tokenizer.decode(want)
    greedy = SamplingParams(max_new_tokens=20, temperature=0)
    assert generate_ids(model, ids, greedy) == want
    assert generate_ids(model, [ids, ids[:3]], greedy)[0] == want  # batched
    assert generate(model, tokenizer, PROMPT, greedy) == text
    assert "".join(stream(model, tokenizer, PROMPT, greedy)) == text
    assert generate_ids(model, ids, greedy, num_beams=1) == want
    assert generate_ids(model, ids, num_beams=2, num_samples=1, max_new_tokens=20, temperature=0)[:1] == want[:1]
    draft = sharpened(variant, n_layer=1)
    if variant != "gpt2":  # learned positions past block_size decode without the draft (tested elsewhere)
        assert generate_ids(model, ids, greedy, draft=draft, draft_k=3) == want
        assert "".join(stream(model, tokenizer, PROMPT, greedy, draft=draft)) == text
    path = save_model_dir(model, tmp_path / variant, tokenizer)
    assert main(["generate", str(path), "--prompt", PROMPT, "--max-new-tokens", "20", "--temperature", "0"]) == 0
    assert capsys.readouterr().out == text + "\n" * (not text.endswith("\n"))  # generate ends the line
    app = build_app(path, ServeOptions(max_batch_size=2, max_context=64))
    with TestClient(app, base_url="http://localhost") as client:
        r = client.post(
            "/v1/completions", json={"model": variant, "prompt": PROMPT, "max_tokens": 20, "temperature": 0}
        )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == text and r.json()["choices"][0]["finish_reason"] == "length"


def test_compiled_entry_points_give_the_uncached_greedy_tokens(monkeypatch, quick_compile, model_dir, capsys):
    use_kernels(monkeypatch, library.load())  # on where they run (see the next test for off)
    path, tokenizer = model_dir
    model, _ = load(path)
    ids = tokenizer.encode(PROMPT)
    want = uncached_greedy(model, ids, 12)
    text = tokenizer.decode(want)
    greedy = SamplingParams(max_new_tokens=12, temperature=0)
    assert generate_ids(model, ids, greedy, compile=True) == want
    assert generate(model, tokenizer, PROMPT, greedy, compile=True) == text
    assert "".join(stream(model, tokenizer, PROMPT, greedy, compile=True)) == text
    assert generate_ids(model, ids, greedy, compile=True, draft=model, draft_k=2) == want
    assert (
        main(["generate", str(path), "--prompt", PROMPT, "--max-new-tokens", "12", "--temperature", "0", "--compile"])
        == 0
    )
    assert capsys.readouterr().out == text + "\n" * (not text.endswith("\n"))  # generate ends the line
    app = build_app(path, ServeOptions(max_batch_size=1, compile=True, max_context=64))
    with TestClient(app, base_url="http://localhost") as client:
        r = client.post(
            "/v1/completions", json={"model": "model", "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
        )
    assert r.json()["choices"][0]["text"] == text


@pytest.mark.slow  # 6 s; the compiled step runs by default in test_compiled_entry_points_give_the_uncached_greedy_tokens
def test_compiled_without_kernels_gives_the_uncached_greedy_tokens(monkeypatch, quick_compile, model_dir):
    use_kernels(monkeypatch, False)
    path, tokenizer = model_dir
    model, _ = load(path)
    ids = tokenizer.encode(PROMPT)
    greedy = SamplingParams(max_new_tokens=12, temperature=0)
    want = uncached_greedy(model, ids, 12)
    assert generate_ids(model, ids, greedy, compile=True) == want
    assert generate_ids(model, ids, greedy, compile=True, draft=model, draft_k=2) == want


@pytest.mark.slow
def test_compiled_beam_search_equals_eager(quick_compile, model_dir):
    path, tokenizer = model_dir
    model, _ = load(path)
    rules = dict(max_new_tokens=10, num_beams=3, num_samples=2)
    assert generate_ids(model, tokenizer.encode(PROMPT), compile=True, **rules) == generate_ids(
        model, tokenizer.encode(PROMPT), **rules
    )


def test_cli_without_kernels_from_the_environment(model_dir):
    path, tokenizer = model_dir
    model, _ = load(path)
    want = tokenizer.decode(uncached_greedy(model, tokenizer.encode(PROMPT), 10))
    env = {**os.environ, build.DISABLE_VARIABLE: "0"}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "gptkit",
            "generate",
            str(path),
            "--prompt",
            PROMPT,
            "--max-new-tokens",
            "10",
            "--temperature",
            "0",
            "--json",
        ],
        capture_output=True,
        text=True,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["text"] == want


def test_server_continues_a_rope_model_past_block_size(tmp_path):
    tokenizer = CharTokenizer(list(CHARS), specials=[])
    model = sharpened("llama-gqa")  # block_size 16
    path = save_model_dir(model, tmp_path / "rope", tokenizer)
    want = uncached_greedy(model, tokenizer.encode(PROMPT), 40)  # 7 + 40 tokens: three times block_size
    app = build_app(path, ServeOptions(max_batch_size=2))
    with TestClient(app, base_url="http://localhost") as client:
        assert client.get("/v1/models").json()["data"][0]["context_length"] == 4 * 16
        r = client.post("/v1/completions", json={"model": "rope", "prompt": PROMPT, "max_tokens": 40, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == tokenizer.decode(want)
        assert r.json()["choices"][0]["finish_reason"] == "length"
        assert app.state.gptkit.engine.batch.max_len > 16  # the cache grew past block_size
        too_long = client.post("/v1/completions", json={"model": "rope", "prompt": PROMPT, "max_tokens": 60})
        assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "max_tokens"


def test_params_and_keyword_overrides():
    params = SamplingParams(max_new_tokens=5, temperature=0.5)
    assert sampling_params(params, {"top_k": 3}) == SamplingParams(max_new_tokens=5, temperature=0.5, top_k=3)
    assert sampling_params(None, {}) == SamplingParams()
    with pytest.raises(ConfigError, match="unknown sampling parameter 'temprature'"):
        sampling_params(None, {"temprature": 0})
    model = sharpened("gpt2")
    assert generate_ids(model, [1, 2], params, temperature=0) == generate_ids(
        model, [1, 2], max_new_tokens=5, temperature=0
    )
