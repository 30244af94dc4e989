"""The many-row fp32 product (csrc/gemm.h), a prefill's linear layers: its sums, their independence from the rest of
the batch, and when ops.linear takes it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import product_inputs

from gptkit.native import library, ops

needs_kernels = pytest.mark.skipif(not library.load(), reason="this CPU has neither AVX2 nor AVX-512")


def _sequential(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """Each output as products added one after another from zero, each multiply-add rounded once to fp32 (the
    product of two fp32 values is exact in fp64; the fp64 sum then rounds to fp32)."""
    s = torch.zeros(x.size(0), w.size(0), dtype=torch.float64)
    for k in range(x.size(1)):
        s = (s + x[:, k, None].double() * w[None, :, k].double()).float().double()
    return (s + b.double()).float() if b is not None else s.float()


@needs_kernels
@pytest.mark.parametrize("rows", [9, 16, 17, 40])  # a panel and a half-vector tail; a full panel; one row past; 2.5
@pytest.mark.parametrize("k", [1, 19, 300])  # 300: past one block of k (256), so a sum goes on from memory
@pytest.mark.parametrize("bias", [False, True])
def test_gemm_adds_each_outputs_products_in_order_from_zero(rows, k, bias):
    x, w, b = product_inputs(rows, k, 13)  # 13 weight rows: tiles of 6, 6 and 1, split between threads mid-tile
    b = b if bias else None
    assert torch.equal(torch.ops.gptkit.gemm(x, w, b), _sequential(x, w, b))


@needs_kernels
def test_an_outputs_bits_depend_on_its_own_rows_only():
    # what lets a prefill chunk's keys and values be the same whatever else the forward held
    x, w, b = product_inputs(70, 100, 50, seed=1)
    whole = torch.ops.gptkit.gemm(x, w, b)
    assert torch.equal(torch.ops.gptkit.gemm(x[5:30].contiguous(), w, b), whole[5:30])
    assert torch.equal(torch.ops.gptkit.gemm(x[3:4].contiguous(), w, b), whole[3:4])
    assert torch.equal(torch.ops.gptkit.gemm(x.flip(0).contiguous(), w, b), whole.flip(0))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(torch.ops.gptkit.gemm(x, w, b), whole)
    finally:
        torch.set_num_threads(threads)
    assert torch.ops.gptkit.gemm(x[:0], w, b).shape == (0, 50)


@needs_kernels
def test_linear_takes_the_many_row_kernel_for_fp32_prefill_rows_where_chosen(monkeypatch):
    calls = []
    real = torch.ops.gptkit.gemm
    monkeypatch.setattr(torch.ops.gptkit, "gemm", lambda *a: calls.append(tuple(a[0].shape)) or real(*a))
    monkeypatch.setitem(library.STATE, "choices", {"fp32": True, "fp32_rows": True})
    x, w, b = product_inputs(80, 512, ops.GEMM_MIN_WEIGHT // 512)
    with torch.no_grad():
        y = ops.linear(x.view(2, 40, 512), w, b)  # a prefill's (B, T, C)
        assert y.shape == (2, 40, w.size(0)) and calls == [(80, 512)]
        assert torch.equal(y.view(80, -1), _sequential(x, w, b))
        ops.linear(x[:8], w, b)  # decode rows: the GEMV kernel
        ops.linear(x.bfloat16(), w.bfloat16(), b.bfloat16())  # bf16: not this kernel
        ops.linear(x, w[:-1], b[:-1])  # a weight under GEMM_MIN_WEIGHT values: F.linear
    ops.linear(x, w.requires_grad_(), b)  # training keeps autograd's F.linear
    assert calls == [(80, 512)]
    monkeypatch.setitem(library.STATE, "choices", {"fp32": True, "fp32_rows": False})  # measured slower here
    with torch.no_grad():
        assert torch.equal(ops.linear(x, w, b), F.linear(x, w, b))
    assert calls == [(80, 512)]
