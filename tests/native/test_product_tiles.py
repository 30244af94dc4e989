"""csrc/products.h's fp32 register tiles past their edges: sums that start fresh in each chain's first chunk, the next
tile prefetched across a thread's range, and batches of several groups of 8 rows; each row's sum is its own to the
bit."""

from __future__ import annotations

import pytest
import torch

from gptkit.config import ModelConfig
from gptkit.decoding import fused
from gptkit.kv_cache import KVCache
from gptkit.model import GPT
from gptkit.native import library as kernels
from gptkit.native import ops

needs_kernels = pytest.mark.skipif(not kernels.load(), reason="this CPU has neither AVX2 nor AVX-512")


@needs_kernels
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("k", [5, 16, 24, 771])
def test_tiles_of_every_row_count_give_each_row_its_single_row_sum(k, threads):
    """97 output rows (tiles of 4 on AVX2 and 6 on AVX-512, then a short one; two threads split them at 48), K shorter
    than one vector (no tile pass at all), of one or two AVX-512 vectors (one chain's pass finds nothing to add), of 24
    (an odd number of AVX2 vectors) and 771 (two chunks and a scalar tail): at 2 to 8 rows the product equals, to
    the bit, each row's product alone."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for rows in range(2, ops.GEMV_MAX_ROWS + 1):
            g = torch.Generator().manual_seed(rows * 1000 + k)
            x, w = torch.randn(rows, k, generator=g), torch.randn(97, k, generator=g)
            together = torch.ops.gptkit.gemv(x, w, None)
            alone = torch.cat([torch.ops.gptkit.gemv(x[i : i + 1], w, None) for i in range(rows)])
            assert torch.equal(together, alone), f"{rows} rows"
    finally:
        torch.set_num_threads(before)


def _step(plan: torch.ScriptObject, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> torch.Tensor:
    none = torch.empty(0, dtype=torch.long)  # no adapters; each row its own cache row; no shared prefix
    return plan.step(tokens, positions, cache.keys, cache.values, [], [], none, none, none)


@needs_kernels
@pytest.mark.parametrize("rows", [16, 32])
def test_a_step_of_whole_groups_of_8_rows_gives_each_row_its_own_logits(rows):
    """16 and 32 rows (two and four groups of 8 over each tile; only the first prefetches the next tile) through the
    fused step with its own widths (72 and 40: scalar tails) and a vocabulary of 97 (a short last tile): each row's
    logits are, to the bit, those of that row decoded alone."""
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=97, block_size=32, n_layer=2, n_head=2, n_embd=72, ffn_hidden=40)
    model = GPT(config).eval()
    plan = fused._plan(model)
    tokens = torch.randint(0, config.vocab_size, (rows,))
    positions = torch.arange(rows) % 7
    wide = KVCache(config, rows, config.block_size)
    alone = KVCache(config, rows, config.block_size)
    with torch.inference_mode():
        for p in range(7):  # each row's cache filled up to its position by the same steps
            _step(plan, tokens, torch.full((rows,), p), wide)
            _step(plan, tokens, torch.full((rows,), p), alone)
        together = _step(plan, tokens, positions, wide)
        apart = [
            _step(plan, tokens[i : i + 1], positions[i : i + 1], alone.row(i, config.block_size)) for i in range(rows)
        ]
    assert torch.equal(together, torch.cat(apart))
