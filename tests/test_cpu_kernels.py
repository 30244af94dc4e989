"""gptkit's CPU GEMV kernels (fp32, bf16, int8): their products, when they are used, and what happens without them."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from gptkit import cpu_kernels
from gptkit.config import ModelConfig
from gptkit.decoding.api import generate_ids
from gptkit.errors import ConfigError
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


def rounded_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """llama.cpp's q8_0 of each row of x (rows, K): integer values (rows, K) and per-block scales (rows, K / 32)."""
    blocks = x.reshape(x.size(0), -1, 32)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    q = torch.round(blocks * torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax)))
    return q.reshape(x.shape), (amax / 127.0)[..., 0]


def blockwise_product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """sum over blocks of d_x * (x_q . w) in float64: the int8 and q4 kernels' math (w: integers or q4's q - 8)."""
    q, d = rounded_rows(x)
    per_block = torch.einsum("mbj,nbj->mnb", q.double().reshape(*d.shape, 32), w.double().reshape(w.size(0), -1, 32))
    return (per_block * d.double()[:, None, :]).sum(-1)


@needs_kernels
@pytest.mark.parametrize("rows", range(1, cpu_kernels.GEMV_MAX_ROWS + 1))
@pytest.mark.parametrize("k", [17, 64, 100])
def test_int8_gemv_is_its_exact_product(rows, k):
    """Whole blocks of 32 (k = 64): activations rounded to int8 per block (llama.cpp's q8_0), integer sums; else the
    fp32 product over the widened weights."""
    g = torch.Generator().manual_seed(rows * 1000 + k)
    x = torch.randn(rows, k, generator=g)
    q, scales = quantize_weight(torch.randn(37, k, generator=g))
    bias = torch.randn(37, generator=g)
    got = torch.ops.gptkit.gemv_int8(x, q, scales, bias)
    product = blockwise_product(x, q) if k % 32 == 0 else x.double() @ q.double().t()
    want = product * scales.double() + bias.double()
    assert got.dtype == torch.float32 and got.shape == (rows, 37)
    assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()
    exact = (x.double() @ q.double().t()) * scales.double() + bias.double()  # the rounding costs under 1%
    assert (got.double() - exact).abs().max() <= 1e-2 * exact.abs().max()


@needs_kernels
@pytest.mark.parametrize("rows", range(1, cpu_kernels.GEMV_MAX_ROWS + 1))
@pytest.mark.parametrize("k", [32, 96])
def test_q4_gemv_is_llama_cpps_q4_0_by_q8_0_product(rows, k):
    from gptkit.quantization import Q4_BLOCK, group_q4, quantize_q4

    g = torch.Generator().manual_seed(rows * 100 + k)
    x = torch.randn(rows, k, generator=g)
    w = torch.randn(37, k, generator=g)
    packed, scales = quantize_q4(w)
    bias = torch.randn(37, generator=g)
    got = torch.ops.gptkit.gemv_q4(x, *group_q4(packed, scales), bias, 37)  # 37 rows: a group with 3 of padding
    nibbles = packed.reshape(37, -1, Q4_BLOCK // 2)
    q = torch.cat([nibbles & 15, nibbles >> 4], dim=-1).reshape(37, k).double() - 8  # (N, K), block by block
    rows_q, d_x = rounded_rows(x)
    per_block = torch.einsum("mbj,nbj->mnb", rows_q.double().reshape(rows, -1, 32), q.reshape(37, -1, 32))
    want = (per_block * d_x.double()[:, None, :] * scales.double()[None]).sum(-1) + bias.double()
    assert got.dtype == torch.float32 and got.shape == (rows, 37)
    assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_q4_dequantisation_gives_pytorchs_values(dtype):
    from gptkit.quantization import dequantize_q4, group_q4, quantize_q4

    packed, scales = quantize_q4(torch.randn(37, 96, generator=torch.Generator().manual_seed(1)))
    got = torch.ops.gptkit.dequantize_q4(*group_q4(packed, scales), 37, dtype)
    assert got.dtype == dtype and torch.equal(got, dequantize_q4(packed, scales, dtype))


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
    monkeypatch.setattr(cpu_kernels, "_cpu_flags", lambda: {"avx2", "fma", "f16c"})
    monkeypatch.delenv(cpu_kernels.ISA_VARIABLE, raising=False)
    monkeypatch.delenv(cpu_kernels.DISABLE_VARIABLE, raising=False)
    monkeypatch.setenv(cpu_kernels.UPCAST_VARIABLE, "0")
    monkeypatch.setattr(cpp_extension, "load", broken_build)
    x, w, b = _inputs(1, 64, 16, torch.float32, True)
    with caplog.at_level(logging.WARNING, logger="gptkit.cpu_kernels"), torch.no_grad():
        y1 = cpu_kernels.linear(x, w, b)  # the first product does not wait for the build: PyTorch's product
        cpu_kernels.prepare()  # (waits for the background build)
        y2 = cpu_kernels.linear(x, w, b)
    assert torch.equal(y1, F.linear(x, w, b)) and torch.equal(y2, y1)
    assert [r.getMessage() for r in caplog.records if "did not build" in r.getMessage()] != []
    assert len(caplog.records) == 1
    assert cpu_kernels.choices() == {"fp32": False, "bf16": False, "int8": False, "bf16_upcast": False}


def _build_with(fake_build: Callable[..., None], monkeypatch, tmp_path) -> None:
    """An AVX2 machine whose kernel cache lies in tmp_path and whose builds run fake_build instead of torch's."""
    from torch.utils import cpp_extension

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_kernels, "_cpu_flags", lambda: {"avx2", "fma", "f16c"})
    monkeypatch.delenv(cpu_kernels.ISA_VARIABLE, raising=False)
    monkeypatch.delenv(cpu_kernels.DISABLE_VARIABLE, raising=False)
    monkeypatch.setattr(cpp_extension, "load", fake_build)
    monkeypatch.setattr(cpu_kernels, "_register_shape_functions", lambda: None)  # no real library was loaded


def test_the_build_is_announced_only_when_it_compiles(monkeypatch, tmp_path, caplog):
    """The first process compiles and says it takes a while; a later one loads the built library without a word."""
    def fake_build(name: str, build_directory: str, **_) -> None:  # leaves the library where torch's build does
        compiled.append(name)
        (Path(build_directory) / f"{name}.so").write_bytes(b"")

    compiled: list[str] = []
    _build_with(fake_build, monkeypatch, tmp_path)
    with caplog.at_level(logging.INFO, logger="gptkit.cpu_kernels"):
        for _ in range(2):  # two processes, one after the other
            monkeypatch.setattr(cpu_kernels, "_STATE", {})
            assert cpu_kernels.load() is True
    announced = [r.getMessage() for r in caplog.records if "building gptkit's CPU kernels" in r.getMessage()]
    assert len(compiled) == 2 and len(announced) == 1, announced


@pytest.mark.parametrize("flags", [set(), {"avx", "sse4_2"}, {"avx512f", "avx2"}])
def test_cpus_without_avx2_or_avx512_never_build(monkeypatch, flags):
    from torch.utils import cpp_extension

    monkeypatch.setattr(cpu_kernels, "_STATE", {})
    monkeypatch.setattr(cpu_kernels, "_cpu_flags", lambda: flags)
    monkeypatch.delenv(cpu_kernels.ISA_VARIABLE, raising=False)
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


WIDER_THAN_AVX2 = cpu_kernels.isa_level() is not None and cpu_kernels.isa_level()[0] != "avx2"


@pytest.mark.skipif(not WIDER_THAN_AVX2, reason="the AVX2 variant is what this CPU builds anyway")
def test_the_avx2_variant_computes_the_same_on_a_wider_cpu():
    """An AVX-512 machine builds and runs the AVX2 variant too ($GPTKIT_CPU_ISA): the code an AVX2-only CPU runs
    (8-lane vectors, vpmaddubsw in place of VNNI, widened bf16) passes the same product and fused-step tests."""
    tests = Path(__file__).parent
    env = {**os.environ, cpu_kernels.ISA_VARIABLE: "avx2"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           str(tests / "test_cpu_kernels.py"), str(tests / "test_fused.py"),
                           "-k", "gemv or fused_step_gives or every_weight_and_cache"],
                          capture_output=True, text=True, env=env, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout.splitlines()[-1]


def test_an_unknown_instruction_set_is_a_one_line_error(monkeypatch):
    monkeypatch.setenv(cpu_kernels.ISA_VARIABLE, "avx1024")
    with pytest.raises(ConfigError, match="GPTKIT_CPU_ISA=avx1024 is not one of avx512_bf16, avx512_vnni"):
        cpu_kernels.isa_level()


@pytest.mark.parametrize("content", ["[]", '"x"', '{"some machine": []}', '{"some machine": {"fp32": "yes"}}',
                                     '{"some machine": {"fp32": tr'])  # fmt: skip
def test_a_choices_file_of_the_wrong_shape_is_measured_again_and_rewritten(monkeypatch, tmp_path, caplog, content):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.delenv(cpu_kernels.DISABLE_VARIABLE, raising=False)
    monkeypatch.delenv(cpu_kernels.UPCAST_VARIABLE, raising=False)
    monkeypatch.setattr(cpu_kernels, "_STATE", {"library": True})
    monkeypatch.setattr(cpu_kernels, "_measure", lambda: dict(ALL, int8=False))
    path = cpu_kernels.build_directory() / cpu_kernels.CHOICES_FILE
    path.parent.mkdir(parents=True)
    path.write_text(content)
    with caplog.at_level(logging.WARNING, logger="gptkit.cpu_kernels"):
        assert cpu_kernels.choices() == dict(ALL, int8=False)
        assert cpu_kernels.measured("fused_step", lambda: True) is True
    assert len([r for r in caplog.records if str(path) in r.getMessage()]) == 1  # one warning naming the file
    assert json.loads(path.read_text()) == {cpu_kernels._machine_key(): dict(ALL, int8=False, fused_step=True)}


def test_a_library_that_fails_its_checksum_is_never_loaded_but_built_again(monkeypatch, tmp_path, caplog):
    def fake_build(name: str, build_directory: str, **_) -> None:  # as torch's build: links a missing library
        library = Path(build_directory) / f"{name}.so"
        found.append(library.read_bytes() if library.exists() else None)
        if not library.exists():
            library.write_bytes(b"\x7fELF a whole library")

    found: list[bytes | None] = []
    _build_with(fake_build, monkeypatch, tmp_path)
    library = cpu_kernels._library_path(cpu_kernels.build_directory())
    for damage in (lambda: None, lambda: library.write_bytes(library.read_bytes()[:6])):  # whole, then cut short
        damage()
        monkeypatch.setattr(cpu_kernels, "_STATE", {})  # a new process
        with caplog.at_level(logging.WARNING, logger="gptkit.cpu_kernels"):
            assert cpu_kernels.load() is True
    assert found == [None, None]  # the cut library was removed before torch's build could load it
    assert [r.getMessage() for r in caplog.records if "does not match the checksum" in r.getMessage()] != []
    assert cpu_kernels._built() and library.read_bytes() == b"\x7fELF a whole library"
    library.with_suffix(".sha256").unlink()  # as a library an older gptkit built: linked again, said quietly
    monkeypatch.setattr(cpu_kernels, "_STATE", {})
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="gptkit.cpu_kernels"):
        assert cpu_kernels.load() is True
    assert found == [None, None, None] and cpu_kernels._built()
    assert [r.levelno for r in caplog.records if "has no checksum" in r.getMessage()] == [logging.INFO]


@needs_kernels
def test_a_real_library_cut_in_half_is_linked_again_and_decoding_works(tmp_path):
    # A copy of this machine's build directory (objects and library), loaded once from there (torch's build links it
    # again for its new place), then its library cut to half its size: loading that was a SIGBUS (exit 135). The
    # next process notices, links it again from the objects and decodes with it.
    import shutil

    built = cpu_kernels.build_directory()
    copy = tmp_path / built.name
    shutil.copytree(built, copy, ignore=shutil.ignore_patterns("*lock"))
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path), cpu_kernels.DISABLE_VARIABLE: "1"}
    settle = "from gptkit import cpu_kernels; assert cpu_kernels.load()"
    subprocess.run([sys.executable, "-c", settle], env=env, check=True, capture_output=True, timeout=300)
    library = copy / f"{copy.name}.so"
    library.write_bytes(library.read_bytes()[: library.stat().st_size // 2])
    code = ("import torch; from gptkit import cpu_kernels; from gptkit.config import ModelConfig; "
            "from gptkit.model import GPT; from gptkit.decoding.api import generate_ids; "
            "assert cpu_kernels.load(); torch.manual_seed(0); "
            "m = GPT(ModelConfig(vocab_size=64, block_size=32, n_layer=1, n_head=2, n_embd=32)).eval(); "
            "print(len(generate_ids(m, [1, 2, 3], max_new_tokens=5, temperature=0)))")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "does not match the checksum" in done.stderr and done.stdout.strip() == "5"
    assert cpu_kernels._verified(library)
