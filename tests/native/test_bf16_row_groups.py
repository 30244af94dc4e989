"""csrc/products.h's batch-1 bf16 products read rows of 2048 values and more four at a time (rows_bf16): each row's
sum must stay the one a row takes alone, so that a request's logits do not depend on the rows beside it."""

from __future__ import annotations

import pytest
import torch

from gptkit.native import library

needs_kernels = pytest.mark.skipif(not library.load(), reason="this CPU has neither AVX2 nor AVX-512")


@needs_kernels
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("k", [2048, 2061, 8192])
def test_one_activation_row_gets_the_sums_it_gets_beside_others(k, threads):
    """bf16 weights of 61 rows (each thread's range of rows ends a group of four short) against fp32 activations, K
    from the four-row route's threshold, with a partial vector (2061) and at a Llama down projection's 8192: one
    activation row's products equal, to the bit, its row's products inside 3 rows (a row at a time over 3 rows)."""
    g = torch.Generator().manual_seed(k)
    x, w = torch.randn(3, k, generator=g), torch.randn(61, k, generator=g).to(torch.bfloat16)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        alone = torch.ops.gptkit.gemv(x[:1], w, None)
        beside = torch.ops.gptkit.gemv(x, w, None)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(alone[0], beside[0])
    want = x[:1].double() @ w.double().T
    # fp32 sums of up to 8192 products of unit normals (sums up to ~190): measured at most 7.9e-5 from float64's
    torch.testing.assert_close(alone, want.float(), rtol=0, atol=2e-4)
