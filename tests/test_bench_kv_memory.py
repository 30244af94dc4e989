"""benchmarks/bench_kv_memory.py: the cache it runs 8,192 tokens through holds exactly `gptkit info`'s KV bytes, fewer
with windows than without, and its shrunk models keep the presets' KV figures (resident memory is never asserted)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from gptkit.cli.info import LONG_CONTEXT, describe
from gptkit.config import ModelConfig

REPO = Path(__file__).resolve().parents[1]


def bench_module():
    """benchmarks/bench_kv_memory.py as a module, in this process (a second interpreter would import torch again)."""
    spec = importlib.util.spec_from_file_location("bench_kv_memory", REPO / "benchmarks" / "bench_kv_memory.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tiny(window: int | None) -> ModelConfig:
    """Two layers, the first windowed when window is given: a pattern of local and global layers, as Gemma 3's."""
    return ModelConfig(
        vocab_size=64,
        block_size=LONG_CONTEXT,
        n_layer=2,
        n_head=2,
        n_kv_head=1,
        n_embd=16,
        position="rope",
        norm="rmsnorm",
        sliding_window=window,
        layer_types=["sliding", "full"] if window else None,
    )


@pytest.mark.parametrize("kv", ["float32", "int8"])
def test_the_cache_after_8k_tokens_holds_exactly_infos_bytes_and_windows_hold_fewer(kv):
    bench = bench_module()
    windowed, full = bench.measure(tiny(256), kv), bench.measure(tiny(None), kv)
    for row in (windowed, full):
        assert row["cache_bytes"] == row["info_bytes"]
    assert windowed["windowed_layers"] == 1 and full["windowed_layers"] == 0
    # The windowed layer keeps 256 of the full layer's 8,192 positions.
    assert windowed["cache_bytes"] * 2 == full["cache_bytes"] * (1 + 256 / LONG_CONTEXT)


@pytest.mark.parametrize("preset", ["gemma3-1b", "mistral-7b"])
def test_the_shrunk_models_keep_the_presets_kv_figures(preset):
    bench = bench_module()
    shrunk, real = bench.attention_shape(preset), describe(preset)[f"kv_cache_bytes_at_{LONG_CONTEXT}_tokens"]
    for kv in bench.KV_SETTINGS:
        assert bench.info_kv_bytes(shrunk, kv) == real[kv]
    full = bench.attention_shape(preset, "full")
    assert all(full.layer_window(i) is None for i in range(full.n_layer))
    assert bench.info_kv_bytes(full, "float32") > real["float32"]


def test_a_preset_without_windows_is_refused():
    with pytest.raises(SystemExit, match="llama3.2-1b has no sliding window"):
        bench_module().attention_shape("llama3.2-1b")


def test_the_first_layers_keep_the_presets_pattern_and_their_share_of_its_bytes():
    bench = bench_module()
    gemma = bench.attention_shape("gemma3-1b", layers=6)
    assert [gemma.layer_window(i) for i in range(6)] == [512] * 5 + [None]  # five local layers to one global
    mistral = bench.attention_shape("mistral-7b", layers=4)
    real = describe("mistral-7b")[f"kv_cache_bytes_at_{LONG_CONTEXT}_tokens"]["float32"]
    assert bench.info_kv_bytes(mistral, "float32") * 8 == real  # 4 of its 32 identical layers
    with pytest.raises(SystemExit, match="--layers must be 1 to mistral-7b's 32, got 33"):
        bench.attention_shape("mistral-7b", layers=33)
