"""gptkit's CPU GEMV kernels (fp32, bf16, int8): their products, when they are used, and what happens without them."""

from __future__ import annotations

import json
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

needs_kernels = pytest.mark.skipif(not cpu_kernels.load(), reason="this CPU has neither AVX2 nor AVX-512")
ALL = {"fp32": True, "bf16": True, "int8": True, "bf16_upcast": False}


@pytest.fixture
def chosen(monkeypatch):
    """Set the kernels' choices as if measured so (restored after the test)."""

    def choose(**values: bool) -> None:
        monkeypatch.setitem(cpu_kernels._STATE, "choices", dict(ALL, **values))

    return choose


def _inputs(rows: int, k: int, n: int, dtype: torch.dtype, bias: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    return x, w, b


@needs_kernels
@pytest.mark.parametrize("rows", range(1, cpu_kernels.GEMV_MAX_ROWS + 1))
@pytest.mark.parametrize("k", [17, 64, 100])  # 17 and 100 end in a partial vector of every width
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_equals_f_linear_at_every_row_count(rows, k, dtype):
    x, w, b = _inputs(rows, k, 37, dtype, bias=rows % 2 == 1)  # 37 output rows: every thread gets a ragged end
    got = torch.ops.gptkit.gemv(x, w, b)
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    assert got.dtype == dtype and got.shape == (rows, 37)
    if dtype == torch.float32:  # the same sum in another order
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    else:  # one rounding of an fp32 sum to bf16: at most half a unit in the last place (2^-9 relative)
        assert ((got.float() - want).abs() <= want.abs() * 2**-8 + 1e-4).all()
    torch.testing.assert_close(got.float(), F.linear(x, w, b).float(), rtol=2e-2, atol=2e-2)


@needs_kernels
@pytest.mark.parametrize("rows", range(1, cpu_kernels.GEMV_MAX_ROWS + 1))
@pytest.mark.parametrize("k", [17, 64, 100])
def test_int8_gemv_is_the_exact_product_in_fp32(rows, k):
    g = torch.Generator().manual_seed(rows * 1000 + k)
    x = torch.randn(rows, k, generator=g)
    q, scales = quantize_weight(torch.randn(37, k, generator=g))
    bias = torch.randn(37, generator=g)
    got = torch.ops.gptkit.gemv_int8(x, q, scales, bias)
    want = (x.double() @ q.double().t()) * scales.double() + bias.double()
    assert got.dtype == torch.float32 and got.shape == (rows, 37)
    assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_uses_the_kernel_for_few_rows_without_autograd_where_chosen(monkeypatch, chosen, dtype):
    calls = []
    real = torch.ops.gptkit.gemv
    monkeypatch.setattr(torch.ops.gptkit, "gemv", lambda *a: calls.append(tuple(a[0].shape)) or real(*a))
    x, w, b = _inputs(8, 64, 48, dtype, True)
    chosen()
    with torch.no_grad():
        y = cpu_kernels.linear(x.view(8, 1, 64), w, b)  # decode's (B, 1, C) with B = 8
        assert y.shape == (8, 1, 48) and calls == [(8, 64)]
        cpu_kernels.linear(torch.cat([x, x[:1]]), w, b)  # 9 rows: a GEMM, not a GEMV
    cpu_kernels.linear(x, w.requires_grad_(), b)  # training keeps autograd's F.linear
    chosen(**{"fp32": False, "bf16": False})  # measured slower here: PyTorch's product
    with torch.no_grad():
        torch.testing.assert_close(cpu_kernels.linear(x, w, b), F.linear(x, w, b))
    assert calls == [(8, 64)]


@pytest.mark.parametrize("upcast", [False, True])
def test_many_bf16_rows_run_in_fp32_where_measured_faster(monkeypatch, chosen, upcast):
    dtypes = []
    real_linear = F.linear
    monkeypatch.setattr(cpu_kernels.F, "linear", lambda *a: dtypes.append(a[0].dtype) or real_linear(*a))
    chosen(bf16_upcast=upcast)
    x, w, b = _inputs(cpu_kernels.BF16_UPCAST_MIN_ROWS, 64, 48, torch.bfloat16, True)
    with torch.no_grad():
        y = cpu_kernels.linear(x.view(2, -1, 64), w, b)
    assert dtypes == [torch.float32 if upcast else torch.bfloat16] and y.dtype == torch.bfloat16
    want = F.linear(x.float(), w.float(), b.float()).view(2, -1, 48)
    assert ((y.float() - want).abs() <= want.abs() * 2**-7 + 1e-3).all()
    cpu_kernels.linear(x, w.requires_grad_(), b)  # training keeps bf16 autograd
    assert dtypes[-1] == torch.bfloat16


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_linear_uses_the_kernel_for_decoding_only(monkeypatch, chosen, dtype):
    calls = []
    real = torch.ops.gptkit.gemv_int8
    monkeypatch.setattr(torch.ops.gptkit, "gemv_int8", lambda *a: calls.append(a[0].shape) or real(*a))
    chosen()
    module = Int8Linear.from_linear(torch.nn.Linear(64, 48).to(dtype))
    x = torch.randn(3, 1, 64).to(dtype)
    with torch.no_grad():
        y = module(x)
        assert calls == [(3, 64)] and y.dtype == dtype and y.shape == (3, 1, 48)
        want = x.float() @ (module.weight.float() * module.scales.float()[:, None]).t() + module.bias.float()
        torch.testing.assert_close(y.float(), want, rtol=1e-2, atol=1e-2)
        module(torch.randn(2, 40, 64).to(dtype))  # prefill: 80 rows
    assert calls == [(3, 64)]


def test_the_choices_are_measured_once_and_kept(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.delenv(cpu_kernels.DISABLE_VARIABLE, raising=False)
    monkeypatch.delenv(cpu_kernels.UPCAST_VARIABLE, raising=False)
    monkeypatch.setattr(cpu_kernels, "_STATE", {"library": True})
    measured = []
    monkeypatch.setattr(cpu_kernels, "_measure", lambda: measured.append(1) or dict(ALL, fp32=False))
    assert cpu_kernels.choices()["fp32"] is False and measured == [1]
    saved = json.loads((cpu_kernels.build_directory() / cpu_kernels.CHOICES_FILE).read_text())
    assert list(saved.values()) == [dict(ALL, fp32=False)]
    monkeypatch.setattr(cpu_kernels, "_STATE", {"library": True})  # a new process reads the file
    assert cpu_kernels.choices()["fp32"] is False and measured == [1]
    monkeypatch.setattr(cpu_kernels, "_STATE", {"library": True})
    monkeypatch.setenv(cpu_kernels.UPCAST_VARIABLE, "1")  # overridden
    assert cpu_kernels.choices()["bf16_upcast"] is True and measured == [1]


def test_a_failed_build_logs_once_and_falls_back(monkeypatch, caplog):
    from torch.utils import cpp_extension

    def broken_build(**_):
        raise RuntimeError("Error building extension 'gptkit_gemv'")

    monkeypatch.setattr(cpu_kernels, "_STATE", {})
    monkeypatch.setattr(cpu_kernels, "_cpu_flags", lambda: {"avx2", "fma"})
    monkeypatch.delenv(cpu_kernels.DISABLE_VARIABLE, raising=False)
    monkeypatch.setenv(cpu_kernels.UPCAST_VARIABLE, "0")
    monkeypatch.setattr(cpp_extension, "load", broken_build)
    x, w, b = _inputs(1, 64, 16, torch.float32, True)
    with caplog.at_level(logging.WARNING, logger="gptkit.cpu_kernels"), torch.no_grad():
        y1 = cpu_kernels.linear(x, w, b)
        y2 = cpu_kernels.linear(x, w, b)
    assert torch.equal(y1, F.linear(x, w, b)) and torch.equal(y2, y1)
    assert [r.getMessage() for r in caplog.records if "did not build" in r.getMessage()] != []
    assert len(caplog.records) == 1
    assert cpu_kernels.choices() == {"fp32": False, "bf16": False, "int8": False, "bf16_upcast": False}


@pytest.mark.parametrize("flags", [set(), {"avx", "sse4_2"}, {"avx512f", "avx2"}])
def test_cpus_without_avx2_or_avx512_never_build(monkeypatch, flags):
    from torch.utils import cpp_extension

    monkeypatch.setattr(cpu_kernels, "_STATE", {})
    monkeypatch.setattr(cpu_kernels, "_cpu_flags", lambda: flags)
    monkeypatch.setenv(cpu_kernels.UPCAST_VARIABLE, "0")
    monkeypatch.setattr(cpp_extension, "load", lambda **_: pytest.fail("built on a CPU that cannot run the kernels"))
    assert cpu_kernels.load() is False and cpu_kernels.isa() == "none"
    x, q = torch.randn(1, 32), torch.ones(8, 32, dtype=torch.int8)
    with torch.no_grad():
        assert cpu_kernels.int8_linear(x, q, torch.ones(8)) is None


def test_the_environment_can_turn_the_kernels_off(monkeypatch):
    from torch.utils import cpp_extension

    monkeypatch.setattr(cpu_kernels, "_STATE", {})
    monkeypatch.setenv(cpu_kernels.DISABLE_VARIABLE, "0")
    monkeypatch.setenv(cpu_kernels.UPCAST_VARIABLE, "0")
    monkeypatch.setattr(cpp_extension, "load", lambda **_: pytest.fail("built although turned off"))
    assert cpu_kernels.load() is False
    assert not any(cpu_kernels.choices().values())


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


@needs_kernels
def test_compiled_bf16_decode_with_the_kernel_matches_eager(chosen):
    chosen()
    config = ModelConfig(**dict(VARIANTS["untied-head-bias"], n_layer=1, n_embd=64, block_size=256))
    model = GPT(config).eval()
    with torch.no_grad():
        model.norm_f.weight.mul_(20.0)  # logits far from ties, so bf16 rounding differences cannot flip a token
    model = model.to(torch.bfloat16)
    prompt = [3, 14, 15, 9, 26]
    eager = generate_ids(model, prompt, max_new_tokens=12, temperature=0)
    assert generate_ids(model, prompt, max_new_tokens=12, temperature=0, compile=True) == eager
