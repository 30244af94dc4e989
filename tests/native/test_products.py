"""csrc/products.h's fp32 register tiles: every row count's product is each row's own product to the bit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gptkit.native import library as kernels
from gptkit.native import ops

needs_kernels = pytest.mark.skipif(not kernels.load(), reason="this CPU has neither AVX2 nor AVX-512")


@needs_kernels
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", range(2, ops.GEMV_MAX_ROWS + 1))
@pytest.mark.parametrize("n, k", [(13, 37), (40, 1100)])
def test_fp32_tiles_give_each_row_its_single_row_sum(rows, n, k, threads):
    """Tiles of weight rows and of activation rows ending short (13 and 40 output rows, split between threads in
    multiples of 16; odd row counts), K ending in a partial vector, and K = 1100 in three chunks of k with an odd
    number of whole vectors: the multi-row product equals, to the bit, each row's product alone (which a row at a time
    computes), the same two chains summed in the same order."""
    g = torch.Generator().manual_seed(rows * 100 + n)
    x, w, b = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        together = torch.ops.gptkit.gemv(x, w, b)
        alone = torch.cat([torch.ops.gptkit.gemv(x[i : i + 1], w, b) for i in range(rows)])
    finally:
        torch.set_num_threads(before)
    assert torch.equal(together, alone)
    want = F.linear(x.double(), w.double(), b.double()).float()
    # fp32 sums of up to 1100 products of unit normals: measured at most 2.5e-5 from the float64 sums (of size ~30)
    torch.testing.assert_close(together, want, rtol=1e-5, atol=1e-4)
