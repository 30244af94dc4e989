"""KV-cache memory with sliding windows: accounting's formula, the cache gptkit allocates, info and plan."""

from __future__ import annotations

import json

import pytest
import torch

from gptkit.accounting import kv_cache_bytes, param_breakdown
from gptkit.cli import main
from gptkit.cli.info import describe
from gptkit.config import ModelConfig
from gptkit.kv_cache import KVCache
from gptkit.plan import PlanSettings, make_plan
from gptkit.presets import PRESETS

# A Gemma-3-shaped miniature: five sliding layers of window 16 to each full one, decoupled head_dim.
LAYERS = ["sliding"] * 5 + ["full"] + ["sliding"] * 2
GEMMA_LIKE = dict(
    vocab_size=300,
    block_size=512,
    n_layer=8,
    n_head=4,
    n_kv_head=1,
    n_embd=48,
    head_dim=32,
    activation="geglu",
    norm="rmsnorm",
    norm_position="sandwich",
    position="rope",
    qk_norm=True,
    norm_gain_offset=1.0,
    embedding_scale=48**0.5,
    rope_local_theta=10000.0,
    rope_theta=1e6,
    sliding_window=16,
    layer_types=LAYERS,
    attn_bias=False,
    mlp_bias=False,
    norm_bias=False,
)


def test_formula_takes_min_of_context_and_window_per_layer() -> None:
    config = ModelConfig(**GEMMA_LIKE)
    per_position = 2 * 1 * 32 * 2  # keys and values, one kv head of 32 values, 2 bytes (bf16)
    assert kv_cache_bytes(config, 3, 100, "bfloat16") == 3 * per_position * (7 * 16 + 100)
    assert kv_cache_bytes(config, 1, 10, "bfloat16") == per_position * 8 * 10  # below the window: all hold T
    int8 = 2 * 1 * (32 + 4)  # one byte per value and a 4-byte fp32 scale per vector
    assert kv_cache_bytes(config, 1, 100, "int8") == int8 * (7 * 16 + 100)


def test_formula_is_what_the_cache_allocates() -> None:
    config = ModelConfig(**GEMMA_LIKE)
    for context in (8, 16, 40):
        assert KVCache(config, 2, context).nbytes == kv_cache_bytes(config, 2, context, "float32")
        int8 = KVCache(config, 2, context, kv_dtype=torch.int8)
        assert int8.nbytes == kv_cache_bytes(config, 2, context, "int8")


def test_info_reports_windows_switches_and_8k(tmp_path, capsys) -> None:
    path = tmp_path / "gemma_like.json"
    path.write_text(json.dumps(GEMMA_LIKE))
    report = describe(str(path))
    config = ModelConfig(**GEMMA_LIKE)
    assert report["kv_cache_bytes_at_8192_tokens"]["float32"] == kv_cache_bytes(config, 1, 8192, "float32")
    assert report["kv_cache_bytes_at_8192_tokens"]["float32"] == 2 * 32 * 4 * (7 * 16 + 8192)
    assert report["layer_windows"] == [16] * 5 + [None] + [16] * 2
    assert main(["info", str(path)]) == 0
    out = capsys.readouterr().out
    for words in (
        "head_dim 32",
        "sliding window 16 on 7 of 8 layers",
        "norm gain offset 1",
        "embedding scale 6.9282",
        "KV cache at 8,192 tokens",
        "geglu",
        "sandwich",
    ):
        assert words in out, words


def test_info_on_a_full_attention_model_is_unchanged() -> None:
    report = describe("gpt2")
    assert report["switches"] == [] and report["layer_windows"] == [None] * 12
    assert report["kv_cache_bytes_at_8192_tokens"]["float16"] == 8 * report["kv_cache_bytes_per_1024_tokens"]["float16"]


def test_plan_kv_cache_counts_windows(capsys) -> None:
    config = ModelConfig(**GEMMA_LIKE)
    plan = make_plan(config, PlanSettings(kv_context=4096, kv_batch=2))
    assert plan.kv_cache["bytes"] == kv_cache_bytes(config, 2, 4096, "float32") == 2 * 2 * 32 * 4 * (7 * 16 + 4096)
    assert plan.kv_cache["windowed_layers"] == 7 and plan.kv_cache["window"] == 16


@pytest.mark.parametrize("name", list(PRESETS))
def test_info_on_every_preset_counts_the_models_parameters(name: str, capsys) -> None:
    """gptkit info PRESET: its total is accounting's count (which test_accounting checks against the numel of the
    model each preset builds), and its KV figures follow the formula, windows included."""
    config = ModelConfig.preset(name)
    report = describe(name)
    assert report["total"] == param_breakdown(config).total
    assert report["kv_cache_bytes_at_8192_tokens"]["bfloat16"] == kv_cache_bytes(config, 1, 8192, "bfloat16")
    assert main(["info", name]) == 0
    out = capsys.readouterr().out
    assert f"{report['total']:,}" in out and "KV cache at 8,192 tokens" in out
    for words in report["switches"]:
        assert words in out
