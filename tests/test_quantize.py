"""Int8 weight-only quantisation: the kernel against the plain product, held-out loss, saving and loading, the CLI."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

import gptkit.formats.quantized as fq
import gptkit.quantization as q
from gptkit.cli import main
from gptkit.config import ModelConfig
from gptkit.errors import ConfigError
from gptkit.decoding.api import complete, generate_ids
from gptkit.loss import next_token_loss
from gptkit.model import GPT
from gptkit.formats.modeldir import ModelDirError, save_model_dir
from gptkit.loading import load
from gptkit.decoding.sampling import SamplingParams
from gptkit.tokenizer import CharTokenizer

from conftest import VARIANTS

CORPUS = Path(__file__).resolve().parents[1] / "gptkit" / "corpora" / "tinyshakespeare.txt"


@pytest.fixture(scope="module")
def trained() -> tuple[GPT, CharTokenizer, torch.Tensor]:
    """A small character model trained for a few hundred steps on tiny shakespeare, and held-out ids."""
    torch.manual_seed(0)
    text = CORPUS.read_text()[:200_000]
    tokenizer = CharTokenizer.train([text])
    ids = torch.tensor(tokenizer.encode(text))
    split = int(0.9 * len(ids))
    train, held_out = ids[:split], ids[split:]
    config = ModelConfig(vocab_size=tokenizer.vocab_size, block_size=64, n_layer=2, n_head=4, n_embd=64)
    model = GPT(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(150):
        starts = torch.randint(0, len(train) - 65, (16,))
        batch = torch.stack([train[s : s + 65] for s in starts.tolist()])
        loss = next_token_loss(model(batch[:, :-1]), batch[:, 1:])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval(), tokenizer, held_out


def held_out_loss(model: GPT, ids: torch.Tensor) -> float:
    """Mean next-token loss over consecutive 64-token windows of ids."""
    n = (len(ids) - 1) // 64
    ids = ids.to(model.lm_head.weight.device)
    x = ids[: n * 64].view(n, 64)
    y = ids[1 : n * 64 + 1].view(n, 64)
    with torch.no_grad():
        return float(next_token_loss(model(x), y))


def test_quantize_weight_is_per_channel_and_close():
    w = torch.randn(40, 24) * torch.logspace(-3, 0, 40)[:, None]  # rows of very different scale
    qw, scales = q.quantize_weight(w)
    assert qw.dtype == torch.int8 and scales.shape == (40,)
    assert int(qw.abs().max(dim=1).values.min()) == q.QUANT_MAX  # every row uses the full range
    error = (qw.float() * scales[:, None] - w).abs().max(dim=1).values
    assert bool((error <= scales / 2 + 1e-9).all())  # rounding error at most half a step, row by row


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [48, 40, 200])  # 40 and 200 are not multiples of the kernel's 16: the fallback
@pytest.mark.parametrize("rows", [3, 40])  # 40 rows: past KERNEL_MAX_ROWS, the dequantised GEMM
def test_int8_linear_matches_dequantised_product(dtype, width, rows, device):
    linear = torch.nn.Linear(width, 20).to(device, dtype)
    module = q.Int8Linear.from_linear(linear)
    x = torch.randn(1, rows, width, device=device).to(dtype)
    qw, scales = q.quantize_weight(linear.weight)
    want = x.float() @ (qw.float() * scales[:, None]).t() + linear.bias.float()
    got = module(x)
    assert got.dtype == dtype and got.shape == (1, rows, 20)
    tol = 3e-2  # bf16 activations inside the CPU kernel
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)


def test_kernel_and_fallback_agree(monkeypatch):
    module = q.Int8Linear.from_linear(torch.nn.Linear(32, 16))
    x = torch.randn(5, 32)
    with_kernel = module(x)
    monkeypatch.setattr(q, "_kernel_works", lambda device, dtype: False)
    without = module(x)
    assert without.dtype == with_kernel.dtype == torch.float32
    torch.testing.assert_close(without, with_kernel, rtol=2e-2, atol=2e-2)  # the CPU kernel runs in bf16


def test_held_out_loss_within_one_percent(trained, device):
    model, _, held_out = trained
    model = _copy(model).to(device)
    fp32 = held_out_loss(model, held_out)
    assert fp32 < 0.8 * math.log(model.config.vocab_size)  # the model learned something: a meaningful check
    quantised = q.quantize(GPT(model.config).eval().to(device), "int8")
    quantised.load_state_dict(q.quantize(_copy(model), "int8").state_dict())
    int8 = held_out_loss(quantised, held_out)
    assert abs(int8 - fp32) / fp32 < 0.01
    assert int8 != fp32  # the weights really changed


def _copy(model: GPT) -> GPT:
    clone = GPT(model.config)
    clone.load_state_dict(model.state_dict())
    return clone.eval()


@pytest.mark.parametrize("variant", ["gpt2", "llama-gqa"])
def test_quantize_replaces_every_linear(variant):
    model = q.quantize(GPT(ModelConfig(**VARIANTS[variant])), "int8")
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert not linears and q.is_quantized(model)
    assert model.tok_emb.weight.dtype == torch.float32  # the embedding table stays in float
    with pytest.raises(ConfigError, match="already quantised"):
        q.quantize(model, "int8")
    with pytest.raises(ConfigError, match="int4"):
        q.quantize(GPT(ModelConfig(**VARIANTS[variant])), "int4")


def test_bf16_quantised_model_generates():
    model = q.quantize(GPT(ModelConfig(**VARIANTS["llama-gqa"])).to(torch.bfloat16), "int8")
    assert model.blocks[0].attn.qkv.scales.dtype == torch.bfloat16
    out = generate_ids(model, [1, 2, 3], max_new_tokens=6, temperature=0)
    assert len(out) == 6 and all(0 <= t < 50 for t in out)


def test_compiled_int8_decode_matches_eager(trained, device, capfd):
    # On CPU the compiled step lets inductor autotune its own int8 GEMM template against torch's kernel.
    model, _, held_out = trained
    quantised = q.quantize(_copy(model).to(device), "int8")
    prompt = held_out[:20].tolist()
    eager = complete(quantised, [prompt], SamplingParams(max_new_tokens=12, temperature=0))
    compiled = complete(quantised, [prompt], SamplingParams(max_new_tokens=12, temperature=0), compile=True)
    assert compiled.completions == eager.completions
    assert compiled.timing.compile_seconds is not None
    assert "AUTOTUNE" not in capfd.readouterr().err  # the autotuner's timing tables stay out of the user's terminal
    # From cpu_kernels.COMPILED_INT8_MIN_ROWS rows on, the compiled graph calls gptkit's int8 kernel instead.
    prompts = [held_out[i : i + 20].tolist() for i in range(0, 600, 100)]
    params = SamplingParams(max_new_tokens=8, temperature=0)
    assert complete(quantised, prompts, params, compile=True).completions == complete(quantised, prompts, params).completions


def test_saved_int8_directory_loads_and_generates(trained, tmp_path):
    model, tokenizer, held_out = trained
    quantised = q.quantize(_copy(model), "int8")
    path = fq.save_quantized_dir(quantised, tmp_path / "int8", tokenizer)
    config = json.loads((path / "config.json").read_text())
    assert config["quantization"] == "int8" and fq.quantization_of(path) == "int8"
    loaded, loaded_tokenizer = load(path)
    assert q.is_quantized(loaded) and loaded.blocks[0].mlp.fc.weight.dtype == torch.int8
    assert all(b.data_ptr() % 64 == 0 for b in loaded.buffers() if b.dtype == torch.int8)  # the kernel needs it
    assert held_out_loss(loaded, held_out) == pytest.approx(held_out_loss(quantised, held_out), abs=1e-6)
    prompt = tokenizer.encode("ROMEO:")
    assert generate_ids(loaded, prompt, max_new_tokens=12, temperature=0) == generate_ids(
        quantised, prompt, max_new_tokens=12, temperature=0
    )
    assert loaded_tokenizer.decode(prompt) == "ROMEO:"
    # int8 weights take a quarter of the bytes of the float ones
    size = (path / "model.safetensors").stat().st_size
    float_size = save_model_dir(_copy(model), tmp_path / "fp32").joinpath("model.safetensors").stat().st_size
    assert size < 0.6 * float_size
    with pytest.raises(ModelDirError, match="float model"):
        fq.load_quantized_dir(tmp_path / "fp32")
    with pytest.raises(ConfigError, match="not quantised"):
        fq.save_quantized_dir(_copy(model), tmp_path / "bad")


def test_cli_generate_quantize_int8(trained, tmp_path, capsys):
    model, tokenizer, _ = trained
    float_dir = save_model_dir(_copy(model), tmp_path / "fp32", tokenizer)
    int8_dir = fq.save_quantized_dir(q.quantize(_copy(model), "int8"), tmp_path / "int8", tokenizer)
    args = ["--prompt", "ROMEO:", "--max-new-tokens", "10", "--temperature", "0", "--json"]
    assert main(["generate", str(float_dir), "--quantize", "int8", *args]) == 0
    on_the_fly = json.loads(capsys.readouterr().out)
    assert main(["generate", str(int8_dir), *args]) == 0
    from_dir = json.loads(capsys.readouterr().out)
    assert on_the_fly["ids"] == from_dir["ids"] and len(from_dir["ids"]) == 10
    with pytest.raises(SystemExit):  # argparse refuses an unknown method before loading anything
        main(["generate", str(float_dir), "--quantize", "int4", *args])
