"""gptkit's CPU GEMV kernels (bf16, int8): their products, when they are used, and what happens without them."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from gptkit import cpu_kernels
from gptkit.config import ModelConfig
from gptkit.decoding.api import generate_ids
from gptkit.model import GPT
from gptkit.quantization import Int8Linear, quantize_weight

from conftest import VARIANTS

needs_kernel = pytest.mark.skipif(not cpu_kernels.gemv_bf16_available(), reason="this CPU lacks AVX512-BF16")
needs_int8_kernel = pytest.mark.skipif(not cpu_kernels.gemv_int8_available(), reason="this CPU lacks AVX-512")


def _bf16_inputs(rows: int, k: int, n: int, bias: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g).bfloat16()
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    return x, w, b


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("k", [17, 64, 100])  # 17 and 100 end in a partial 32-lane block
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_is_the_fp32_product_rounded_once(rows, k, bias):
    x, w, b = _bf16_inputs(rows, k, 37, bias)  # 37 output rows: every thread gets a ragged end
    got = torch.ops.gptkit.gemv_bf16(x, w, b)
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 37)
    # One rounding of an fp32 sum to bf16 is off by at most half a unit in the last place (2^-9 relative).
    assert ((got.float() - want).abs() <= want.abs() * 2**-8 + 1e-4).all()


@needs_kernel
def test_linear_uses_the_kernel_only_for_few_bf16_rows_without_autograd(monkeypatch):
    calls = []
    real_linear = F.linear
    monkeypatch.setattr(cpu_kernels.F, "linear", lambda *a: calls.append(a[0].shape) or real_linear(*a))
    x, w, b = _bf16_inputs(8, 64, 48, True)
    with torch.no_grad():
        y = cpu_kernels.linear(x.view(8, 1, 64), w, b)  # decode's (B, 1, C) with B = 8
        assert y.shape == (8, 1, 48) and calls == []
        cpu_kernels.linear(torch.cat([x, x[:1]]), w, b)  # 9 rows: a GEMM, not a GEMV
        cpu_kernels.linear(x.float(), w.float(), b.float())
    cpu_kernels.linear(x, w.requires_grad_(), b)  # training keeps autograd's F.linear
    assert len(calls) == 3


@pytest.mark.parametrize("amx", [False, True])
def test_many_bf16_rows_run_in_fp32_on_cpus_without_amx(monkeypatch, amx):
    dtypes = []
    real_linear = F.linear
    monkeypatch.setattr(cpu_kernels.F, "linear", lambda *a: dtypes.append(a[0].dtype) or real_linear(*a))
    monkeypatch.setattr(cpu_kernels, "_cpu_flags", lambda: {"avx512f", "amx_bf16"} if amx else {"avx512f"})
    x, w, b = _bf16_inputs(cpu_kernels.BF16_UPCAST_MIN_ROWS, 64, 48, True)
    with torch.no_grad():
        y = cpu_kernels.linear(x.view(2, -1, 64), w, b)
    assert dtypes == [torch.bfloat16 if amx else torch.float32] and y.dtype == torch.bfloat16
    want = F.linear(x.float(), w.float(), b.float()).view(2, -1, 48)
    assert ((y.float() - want).abs() <= want.abs() * 2**-7 + 1e-3).all()
    cpu_kernels.linear(x, w.requires_grad_(), b)  # training keeps bf16 autograd
    assert dtypes[-1] == torch.bfloat16


@needs_kernel
def test_compiled_bf16_decode_matches_eager():
    config = ModelConfig(**dict(VARIANTS["untied-head-bias"], n_layer=1, n_embd=64, block_size=256))
    model = GPT(config).eval()
    with torch.no_grad():
        model.norm_f.weight.mul_(20.0)  # logits far from ties, so bf16 rounding differences cannot flip a token
    model = model.to(torch.bfloat16)
    prompt = [3, 14, 15, 9, 26]
    eager = generate_ids(model, prompt, max_new_tokens=12, temperature=0)
    assert generate_ids(model, prompt, max_new_tokens=12, temperature=0, compile=True) == eager


@needs_int8_kernel
@pytest.mark.parametrize("rows", [1, 4, 8])
@pytest.mark.parametrize("k", [17, 64, 100])  # 17 and 100 end in a partial 16-lane block
def test_int8_gemv_is_the_exact_product_in_fp32(rows, k):
    g = torch.Generator().manual_seed(rows * 1000 + k)
    x = torch.randn(rows, k, generator=g)
    q, scales = quantize_weight(torch.randn(37, k, generator=g))
    got = torch.ops.gptkit.gemv_int8(x, q, scales)
    want = (x.double() @ q.double().t()) * scales.double()
    assert got.dtype == torch.float32 and got.shape == (rows, 37)
    assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()


@needs_int8_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_linear_uses_the_kernel_for_decoding_only(monkeypatch, dtype):
    calls = []
    real = torch.ops.gptkit.gemv_int8
    monkeypatch.setattr(torch.ops.gptkit, "gemv_int8", lambda *a: calls.append(a[0].shape) or real(*a))
    linear = torch.nn.Linear(64, 48).to(dtype)
    module = Int8Linear.from_linear(linear)
    x = torch.randn(3, 1, 64).to(dtype)
    with torch.no_grad():
        y = module(x)
        assert calls == [(3, 64)] and y.dtype == dtype and y.shape == (3, 1, 48)
        want = x.float() @ (module.weight.float() * module.scales.float()[:, None]).t() + module.bias.float()
        torch.testing.assert_close(y.float(), want, rtol=1e-2, atol=1e-2)
        module(torch.randn(2, 40, 64).to(dtype))  # prefill: 80 rows
    assert calls == [(3, 64)]


def test_a_failed_build_logs_once_and_falls_back(monkeypatch, caplog):
    from torch.utils import cpp_extension

    def broken_build(**_):
        raise RuntimeError("Error building extension 'gptkit_gemv'")

    monkeypatch.setattr(cpu_kernels, "_LOADED", {})
    monkeypatch.setattr(cpu_kernels, "_cpu_flags", lambda: cpu_kernels.BUILD_CPU_FLAGS | {"avx512_bf16"})
    monkeypatch.setattr(cpp_extension, "load", broken_build)
    x, w, b = _bf16_inputs(1, 64, 16, True)
    with caplog.at_level(logging.WARNING, logger="gptkit.cpu_kernels"), torch.no_grad():
        y1 = cpu_kernels.linear(x, w, b)
        y2 = cpu_kernels.linear(x, w, b)
    assert torch.equal(y1, F.linear(x, w, b)) and torch.equal(y2, y1)
    assert [r.getMessage() for r in caplog.records if "did not build" in r.getMessage()] != []
    assert len(caplog.records) == 1


@pytest.mark.parametrize("flags", [set(), {"avx512f", "avx2"}])
def test_cpus_without_avx512_never_build(monkeypatch, flags):
    from torch.utils import cpp_extension

    monkeypatch.setattr(cpu_kernels, "_LOADED", {})
    monkeypatch.setattr(cpu_kernels, "_cpu_flags", lambda: flags)
    monkeypatch.setattr(cpp_extension, "load", lambda **_: pytest.fail("built on a CPU that cannot run the kernels"))
    assert cpu_kernels.gemv_bf16_available() is False and cpu_kernels.gemv_int8_available() is False
    x, q = torch.randn(1, 32), torch.ones(8, 32, dtype=torch.int8)
    with torch.no_grad():
        assert cpu_kernels.int8_linear(x, q, torch.ones(8)) is None


@needs_int8_kernel
def test_int8_but_not_bf16_without_avx512_bf16(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "_LOADED", {})
    monkeypatch.setattr(cpu_kernels, "_cpu_flags", lambda: set(cpu_kernels.BUILD_CPU_FLAGS))
    assert cpu_kernels.gemv_int8_available() is True and cpu_kernels.gemv_bf16_available() is False
    x, w = torch.randn(1, 64).bfloat16(), torch.randn(8, 64).bfloat16()
    with torch.no_grad():
        assert torch.equal(cpu_kernels.linear(x, w), F.linear(x, w))


def test_the_environment_can_turn_the_kernels_off(monkeypatch):
    from torch.utils import cpp_extension

    monkeypatch.setattr(cpu_kernels, "_LOADED", {})
    monkeypatch.setenv(cpu_kernels.DISABLE_VARIABLE, "0")
    monkeypatch.setattr(cpp_extension, "load", lambda **_: pytest.fail("built although turned off"))
    assert cpu_kernels.gemv_bf16_available() is False and cpu_kernels.gemv_int8_available() is False


def test_a_killed_builds_lock_file_does_not_block_the_next_build(monkeypatch, tmp_path, caplog):
    from torch.utils import cpp_extension

    seen = {}

    def fake_build(**kwargs):  # records what torch's build would find
        seen["lock_exists"] = (Path(kwargs["build_directory"]) / "lock").exists()
        raise RuntimeError("stop here")

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(cpp_extension, "load", fake_build)
    lock = cpu_kernels.build_directory() / "lock"
    assert lock.parent.parent == tmp_path
    lock.parent.mkdir()
    lock.touch()  # as a build killed with SIGKILL leaves it; nobody holds the flock
    with caplog.at_level(logging.WARNING, logger="gptkit.cpu_kernels"):
        assert cpu_kernels._build() is False
    assert seen["lock_exists"] is False
    assert any("did not finish" in r.getMessage() for r in caplog.records)
