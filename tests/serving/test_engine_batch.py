"""serving/engine.py's default batch: the measured 32 rows, halved while their up-front KV cache would take more than
its share of the free memory, never under the former default of 8; an explicit --max-batch-size is kept."""

from __future__ import annotations

import pytest
import torch

from gptkit.accounting import kv_cache_bytes
from gptkit.config import ModelConfig
from gptkit.model import GPT
from gptkit.serving import engine
from gptkit.tokenizer import ByteTokenizer

CONFIG = ModelConfig(vocab_size=256, block_size=64, n_layer=2, n_head=2, n_embd=32)
ROW_BYTES = kv_cache_bytes(CONFIG, 1, CONFIG.block_size, "float32")


@pytest.mark.parametrize(
    "free_rows, expected",
    [
        (1000, 32),
        (32 / engine.DEFAULT_BATCH_MEMORY_SHARE, 32),
        (31 / engine.DEFAULT_BATCH_MEMORY_SHARE, 16),
        (9, 8),
        (0, 8),
    ],
)
def test_the_default_batch_halves_until_its_cache_fits_the_free_memory(monkeypatch, free_rows, expected):
    monkeypatch.setattr(engine, "available_memory", lambda: int(free_rows * ROW_BYTES))
    served = engine.Engine(GPT(CONFIG), ByteTokenizer())
    assert served.max_batch_size == expected
    assert served.batch.cache.batch_size == expected  # the rows allocated, not only the number reported


def test_a_batch_size_given_is_kept_whatever_the_memory(monkeypatch):
    monkeypatch.setattr(engine, "available_memory", lambda: 0)
    assert engine.Engine(GPT(CONFIG), ByteTokenizer(), max_batch_size=3).max_batch_size == 3
    with pytest.raises(engine.GptkitError, match="--max-batch-size must be >= 1, got 0"):
        engine.Engine(GPT(CONFIG), ByteTokenizer(), max_batch_size=0)


def test_an_int8_cache_is_sized_as_int8(monkeypatch):
    # room for 32 rows of the int8 cache (a byte a value plus its scales), not for 32 of the fp32 one
    int8_row = kv_cache_bytes(CONFIG, 1, CONFIG.block_size, "int8")
    monkeypatch.setattr(engine, "available_memory", lambda: int(32 * int8_row / engine.DEFAULT_BATCH_MEMORY_SHARE))
    assert engine.Engine(GPT(CONFIG), ByteTokenizer(), kv_dtype=torch.int8).max_batch_size == 32
    assert engine.Engine(GPT(CONFIG), ByteTokenizer()).max_batch_size == 8
