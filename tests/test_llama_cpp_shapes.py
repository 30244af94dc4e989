"""benchmarks/llama_cpp_shapes.py, the decode table against llama.cpp: its byte accounting, its vocabulary of any
size, and a smoke run of bench_generate.py's --shapes through llama.cpp when `make llama-cpp` has built it."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
gguf = pytest.importorskip("gguf")


def bench_module(name: str):
    """A benchmarks/ script as a module, in this process (a second interpreter would import torch again)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_moe_models_active_bytes_are_the_same_counted_in_gptkit_and_in_its_gguf_file(tmp_path):
    shapes = bench_module("llama_cpp_shapes")
    config = shapes.shape_config("qwen3-moe", tiny=True)
    model = shapes.formats_of(config, ["bf16"])[0]["bf16"]
    path = shapes.write_gguf(model, tmp_path / "m.gguf", "f32")
    fp32_bytes = shapes.gguf_active_bytes(path, config)
    d, e, k = config.n_embd, config.n_experts, config.n_experts_per_token
    experts = config.n_layer * e * 3 * d * config.expert_hidden * 4  # gate, up and down of every expert, f32
    whole = sum(int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors if len(t.shape) > 1)
    embedding = config.vocab_size * d * 4  # looked up, not multiplied (the head is a tensor of its own)
    assert fp32_bytes == whole - embedding - experts + experts * k // e
    assert shapes.step_weight_bytes(model) * 2 == fp32_bytes  # gptkit's own count, of its bf16 model


def test_an_int4_moe_model_reads_the_bytes_its_q4_0_file_does(tmp_path):
    # The same Q4_0 blocks on both sides (routers f32 in the file as in gptkit): the int4 row counts its expert
    # stacks too (issue 55: it counted the dense matrices only, 46 MB a token of the Qwen3-MoE shape's 104)
    shapes = bench_module("llama_cpp_shapes")
    config = shapes.shape_config("qwen3-moe", tiny=True)
    model = shapes.formats_of(config, ["int4"])[0]["int4"]
    path = shapes.write_gguf(model, tmp_path / "m.gguf", "q4_0")
    assert shapes.step_weight_bytes(model) == shapes.gguf_active_bytes(path, config)


def test_the_vocabulary_has_exactly_the_size_asked_past_every_byte_pair():
    shapes = bench_module("llama_cpp_shapes")
    tokenizer = shapes.vocabulary_of(256 + 256 * 256 + 300)
    assert tokenizer.vocab_size == 256 + 256 * 256 + 300


def test_the_decode_table_runs_against_llama_cpp_at_a_smoke_runs_size(capsys):
    folder = Path(os.environ.get("LLAMA_CPP") or REPO / ".cache/llama.cpp/build/bin")
    if not (folder / "llama-bench").is_file():
        pytest.skip(f"no llama-bench in {folder}: build llama.cpp with `make llama-cpp` (or set LLAMA_CPP)")
    bench = bench_module("bench_generate")
    argv = ["--shapes", "qwen3-moe", "--tiny-shapes", "--spec-steps", "0", "--rounds", "1", "--new-tokens", "8"]
    argv += ["--decode-prompt-len", "4", "--probe-mb", "64", "--llama-cpp", str(folder), "--json"]
    assert bench.main(argv) == 0
    rows = json.loads(capsys.readouterr().out)["llama_cpp_decode"]
    assert [(r["shape"], r["format"], r["gguf"]) for r in rows] == [
        ("qwen3-moe", "bf16", "bf16"),
        ("qwen3-moe", "int8", "q8_0"),
        ("qwen3-moe", "int4", "q4_0"),
    ]
    assert all(r["llama_cpp"] > 0 and 0 < r["llama_cpp_share"] for r in rows)
    # gptkit decodes each of them: its int8 and int4 quantise the expert stacks too (gptkit.quantization.Int8Experts)
    assert all(r["vs_llama_cpp"] > 0 and "gptkit_refused" not in r for r in rows)
