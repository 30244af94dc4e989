"""gptkit's CPU GEMV kernels (fp32, bf16, int8): their products, when they are used, and what happens without them."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from helpers import VARIANTS, product_inputs

from gptkit.config import ModelConfig
from gptkit.decoding.api import generate_ids
from gptkit.errors import ConfigError
from gptkit.model import GPT
from gptkit.native import build, choices, contention, cpu, ops
from gptkit.native import cache as kernel_cache
from gptkit.native import library as kernels
from gptkit.quantization import Int8Linear, quantize_weight

REAL_OTHERS_BUSY = contention.others_busy  # (conftest's _quiet_machine replaces it within each test)

needs_kernels = pytest.mark.skipif(not kernels.load(), reason="this CPU has neither AVX2 nor AVX-512")
ALL = {"fp32": True, "bf16": True, "int8": True, "bf16_upcast": False, "fp32_rows": True}


@pytest.fixture
def chosen(monkeypatch):
    """Set the kernels' choices as if measured so (restored after the test)."""

    def choose(**values: bool) -> None:
        monkeypatch.setitem(kernels.STATE, "choices", dict(ALL, **values))

    return choose


@needs_kernels
@pytest.mark.parametrize("rows", range(1, ops.GEMV_MAX_ROWS + 1))
@pytest.mark.parametrize("k", [17, 64, 100])  # 17 and 100 end in a partial vector of every width
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_equals_f_linear_at_every_row_count(rows, k, dtype):
    x, w, b = product_inputs(rows, k, 37, dtype, bias=rows % 2 == 1)  # 37 output rows: every thread gets a ragged end
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
@pytest.mark.parametrize("rows", range(1, ops.GEMV_MAX_ROWS + 1))
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
@pytest.mark.parametrize("rows", range(1, ops.GEMV_MAX_ROWS + 1))
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
    x, w, b = product_inputs(8, 64, 48, dtype, True)
    chosen()
    with torch.no_grad():
        y = ops.linear(x.view(8, 1, 64), w, b)  # decode's (B, 1, C) with B = 8
        assert y.shape == (8, 1, 48) and calls == [(8, 64)]
        ops.linear(torch.cat([x, x[:1]]), w, b)  # 9 rows: a GEMM, not a GEMV
    ops.linear(x, w.requires_grad_(), b)  # training keeps autograd's F.linear
    chosen(**{"fp32": False, "bf16": False})  # measured slower here: PyTorch's product
    with torch.no_grad():
        torch.testing.assert_close(ops.linear(x, w, b), F.linear(x, w, b))
    assert calls == [(8, 64)]


@pytest.mark.parametrize("upcast", [False, True])
def test_many_bf16_rows_run_in_fp32_where_measured_faster(monkeypatch, chosen, upcast):
    dtypes = []
    real_linear = F.linear
    monkeypatch.setattr(ops.F, "linear", lambda *a: dtypes.append(a[0].dtype) or real_linear(*a))
    chosen(bf16_upcast=upcast, fp32_rows=False)  # (with the many-row kernel, the fp32 product is test_gemm's)
    x, w, b = product_inputs(choices.BF16_UPCAST_MIN_ROWS, 64, 48, torch.bfloat16, True)
    with torch.no_grad():
        y = ops.linear(x.view(2, -1, 64), w, b)
    assert dtypes == [torch.float32 if upcast else torch.bfloat16] and y.dtype == torch.bfloat16
    want = F.linear(x.float(), w.float(), b.float()).view(2, -1, 48)
    assert ((y.float() - want).abs() <= want.abs() * 2**-7 + 1e-3).all()
    ops.linear(x, w.requires_grad_(), b)  # training keeps bf16 autograd
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


def test_a_choice_timed_while_other_programs_are_busy_is_kept_until_a_quiet_start(monkeypatch, tmp_path, caplog):
    # Timing again at every start on a busy machine cost each process its start-up (40 s before `serve` was ready);
    # the first process that starts on a quiet machine times it again, once.
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.delenv(build.DISABLE_VARIABLE, raising=False)
    monkeypatch.delenv(choices.UPCAST_VARIABLE, raising=False)
    measured, load = [], [1.0]  # another program keeps a core busy
    monkeypatch.setattr(contention, "others_busy", lambda window=0.2: load[0])
    monkeypatch.setattr(choices, "_measure", lambda: measured.append(1) or dict(ALL, fp32=False))
    path = build.build_directory() / choices.CHOICES_FILE

    def new_process() -> dict[str, bool]:
        monkeypatch.setattr(kernels, "STATE", {"library": True})
        return kernels.choices()

    with caplog.at_level(logging.INFO, logger="gptkit.native"):
        assert new_process() == dict(ALL, fp32=False) and measured == [1]
    assert "1.0 cores while gptkit timed its CPU kernels: the choice is kept" in caplog.text
    assert list(json.loads(path.read_text()).values()) == [dict(ALL, fp32=False, timed_while_busy=True)]
    assert new_process() == dict(ALL, fp32=False) and measured == [1]  # busy still: the kept one, not timed again
    load[0] = 0.0
    assert new_process() == dict(ALL, fp32=False) and measured == [1, 1]  # quiet: timed again, once
    assert list(json.loads(path.read_text()).values()) == [dict(ALL, fp32=False)]
    assert new_process() == dict(ALL, fp32=False) and measured == [1, 1]


def test_others_busy_counts_other_programs_and_not_this_process():
    # /proc/stat's (busy, all) ticks over 0.2 s on 2 cores (40 ticks of all): a reading a busy test machine cannot
    # disturb. Another program spinning on a core: 20 busy ticks; this process's own core subtracted.
    assert contention.others_cores((100, 1000), (120, 1040), own_cores=0.0, cores=2) == pytest.approx(1.0)
    assert contention.others_cores((100, 1000), (120, 1040), own_cores=1.0, cores=2) == pytest.approx(0.0)
    assert contention.others_cores((100, 1000), (140, 1040), own_cores=1.0, cores=2) == pytest.approx(1.0)
    assert contention.others_cores((100, 1000), (100, 1000), own_cores=0.0, cores=2) is None  # no tick passed


def test_others_busy_reads_proc_stat_and_this_processs_own_time(monkeypatch, tmp_path):
    stat = tmp_path / "stat"
    stat.write_text("cpu  50 0 50 880 20 0 0 0 0 0\n")
    later = "cpu  70 0 50 900 20 0 0 0 0 0\n"  # 20 of 40 ticks busy
    monkeypatch.setattr(contention, "PROC_STAT", stat)
    monkeypatch.setattr(contention, "time", SimpleNamespace(sleep=lambda seconds: stat.write_text(later)))
    monkeypatch.setattr(contention.os, "cpu_count", lambda: 2)
    assert REAL_OTHERS_BUSY(window=0.2) == pytest.approx(1.0, abs=0.1)  # (this process's own time: about none)
    monkeypatch.setattr(contention, "PROC_STAT", tmp_path / "missing")
    assert REAL_OTHERS_BUSY(window=0.2) is None


@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="reads Linux's /proc/stat")
def test_other_programs_busy_are_counted_and_this_process_is_not_on_a_quiet_machine():
    # On the real /proc/stat: a quiet machine is needed to tell one spinning program from the rest (the readings
    # above check the arithmetic whatever the machine is doing).
    if (REAL_OTHERS_BUSY() or 0.0) > contention.BUSY_CORES or (os.cpu_count() or 1) < 2:
        pytest.skip("other programs keep this machine busy (or it has one core): one more cannot be told apart")
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)  # (started and spinning)
        assert REAL_OTHERS_BUSY() >= 0.5  # one core's worth, read at 100 ticks a second over 0.2 s
    finally:
        busy.kill()
        busy.wait()
    own = threading.Thread(target=lambda: [torch.randn(1500, 1500) @ torch.randn(1500, 1500) for _ in range(20)])
    own.start()
    try:
        beside_own = REAL_OTHERS_BUSY()
    finally:
        own.join()
    if beside_own >= 0.5 and (REAL_OTHERS_BUSY() or 0.0) > contention.BUSY_CORES:
        pytest.skip("another program got busy during the reading (a parallel test worker): it cannot be told apart")
    assert beside_own < 0.5  # this process's own threads are subtracted


def test_the_choices_are_measured_once_and_kept(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.delenv(build.DISABLE_VARIABLE, raising=False)
    monkeypatch.delenv(choices.UPCAST_VARIABLE, raising=False)
    monkeypatch.setattr(kernels, "STATE", {"library": True})
    measured = []
    monkeypatch.setattr(choices, "_measure", lambda: measured.append(1) or dict(ALL, fp32=False))
    assert kernels.choices()["fp32"] is False and measured == [1]
    saved = json.loads((build.build_directory() / choices.CHOICES_FILE).read_text())
    assert list(saved.values()) == [dict(ALL, fp32=False)]
    monkeypatch.setattr(kernels, "STATE", {"library": True})  # a new process reads the file
    assert kernels.choices()["fp32"] is False and measured == [1]
    monkeypatch.setattr(kernels, "STATE", {"library": True})
    monkeypatch.setenv(choices.UPCAST_VARIABLE, "1")  # overridden
    assert kernels.choices()["bf16_upcast"] is True and measured == [1]


def test_a_failed_build_logs_once_and_falls_back(monkeypatch, cache, caplog):
    from torch.utils import cpp_extension

    def broken_build(**_):
        raise RuntimeError("Error building extension 'gptkit_gemv'")

    monkeypatch.setattr(cpp_extension, "load", broken_build)
    monkeypatch.delenv(build.DISABLE_VARIABLE)  # chosen by measuring: nothing is, without the library
    x, w, b = product_inputs(1, 64, 16, torch.float32, True)
    with caplog.at_level(logging.WARNING, logger="gptkit.native"), torch.no_grad():
        y1 = ops.linear(x, w, b)  # the first product does not wait for the build: PyTorch's product
        kernels.prepare()  # (waits for this process's build)
        y2 = ops.linear(x, w, b)
    assert torch.equal(y1, F.linear(x, w, b)) and torch.equal(y2, y1)
    [said] = [r.getMessage() for r in caplog.records]
    assert "did not build" in said and "Error building extension 'gptkit_gemv'" in said and "build.log" in said
    assert kernels.choices() == {"fp32": False, "bf16": False, "int8": False, "bf16_upcast": False, "fp32_rows": False}


@pytest.mark.parametrize("flags", [set(), {"avx", "sse4_2"}, {"avx512f", "avx2"}])
def test_cpus_without_avx2_or_avx512_never_build(monkeypatch, flags):
    monkeypatch.setattr(kernels, "STATE", {})
    monkeypatch.setattr(cpu, "cpu_flags", lambda: flags)
    monkeypatch.delenv(cpu.ISA_VARIABLE, raising=False)
    monkeypatch.setenv(choices.UPCAST_VARIABLE, "0")
    monkeypatch.setattr(kernel_cache, "spawn_build", lambda *_: pytest.fail("built on a CPU that cannot run them"))
    assert kernels.load() is False and kernels.isa() == "none"
    x, q = torch.randn(1, 32), torch.ones(8, 32, dtype=torch.int8)
    with torch.no_grad():
        assert ops.int8_linear(x, q, torch.ones(8)) is None


def test_the_environment_can_turn_the_kernels_off(monkeypatch):
    monkeypatch.setattr(kernels, "STATE", {})
    monkeypatch.setenv(build.DISABLE_VARIABLE, "0")
    monkeypatch.setenv(choices.UPCAST_VARIABLE, "0")
    monkeypatch.setattr(kernel_cache, "spawn_build", lambda *_: pytest.fail("built although turned off"))
    assert kernels.load() is False
    assert not any(kernels.choices().values())


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


WIDER_THAN_AVX2 = cpu.isa_level() is not None and cpu.isa_level()[0] != "avx2"


@pytest.mark.skipif(not WIDER_THAN_AVX2, reason="the AVX2 variant is what this CPU builds anyway")
def test_the_avx2_variant_computes_the_same_on_a_wider_cpu():
    """An AVX-512 machine builds and runs the AVX2 variant too ($GPTKIT_CPU_ISA): the code an AVX2-only CPU runs
    (8-lane vectors, vpmaddubsw in place of VNNI, widened bf16) passes the same product and fused-step tests."""
    tests = Path(__file__).parents[1]
    env = {**os.environ, cpu.ISA_VARIABLE: "avx2"}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            str(tests / "native" / "test_cpu_kernels.py"),
            str(tests / "decoding" / "test_fused.py"),
            str(tests / "decoding" / "test_moe_decode.py"),
            str(tests / "native" / "test_gemm.py"),
            "-k",
            "gemv or gemm or fused_step_gives or every_weight_and_cache or long_positions or takes_moe_layers",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout.splitlines()[-1]


def test_an_unknown_instruction_set_is_a_one_line_error(monkeypatch):
    monkeypatch.setenv(cpu.ISA_VARIABLE, "avx1024")
    with pytest.raises(ConfigError, match="GPTKIT_CPU_ISA=avx1024 is not one of avx512_bf16, avx512_vnni"):
        cpu.isa_level()


# ----- the kernel cache (gptkit/native/cache.py): shared by copies, never waited on, never loaded damaged -----

WHOLE_LIBRARY = b"\x7fELF a whole library, as a build leaves it"


class InProcessBuilder:
    """The process kernel_cache.spawn_build starts (kernel_cache.main, from the same arguments), run as a thread of
    this one so that a fake compiler applies."""

    def __init__(self, cache: Path, name: str, sources: list[Path], cflags: list[str]) -> None:
        args = [str(cache), name, json.dumps(cflags), *map(str, sources)]
        self.returncode: int | None = None
        self.thread = threading.Thread(target=lambda: setattr(self, "returncode", kernel_cache.main(args)))
        self.thread.start()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self) -> int | None:
        self.thread.join()
        return self.returncode


@pytest.fixture
def cache(monkeypatch, tmp_path) -> SimpleNamespace:
    """An AVX2 machine whose kernel cache lies in tmp_path and whose builds (in-process builders) write WHOLE_LIBRARY
    where torch's build leaves its library (cache.built: the build directories); loading a library records its path
    and bytes at that moment (cache.opened) instead of dlopen'ing it. No choice is timed (GPTKIT_CPU_KERNELS=1)."""
    from torch.utils import cpp_extension

    state = SimpleNamespace(built=[], opened=[], root=tmp_path / "cache")

    def fake_build(name: str, build_directory: str, **_) -> None:
        state.built.append(build_directory)
        (Path(build_directory) / f"{name}.so").write_bytes(WHOLE_LIBRARY)

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(state.root))
    monkeypatch.setattr(cpu, "cpu_flags", lambda: {"avx2", "fma", "f16c"})
    monkeypatch.delenv(cpu.ISA_VARIABLE, raising=False)
    monkeypatch.setenv(build.DISABLE_VARIABLE, "1")
    monkeypatch.setenv(choices.UPCAST_VARIABLE, "0")
    monkeypatch.setattr(cpp_extension, "load", fake_build)
    monkeypatch.setattr(kernel_cache, "spawn_build", InProcessBuilder)
    monkeypatch.setattr(build, "_load_library", lambda path: state.opened.append((path, path.read_bytes())))
    monkeypatch.setattr(build, "_register_shape_functions", lambda: None)  # no real library is loaded
    monkeypatch.setattr(kernels, "STATE", {})
    monkeypatch.setattr(kernels, "POLL_S", 0.02)
    monkeypatch.setattr(kernels, "_EXITING", threading.Event())
    monkeypatch.setattr(kernel_cache, "_WARNED", set())
    return state


def new_process(monkeypatch) -> None:
    """What a new process starts from: nothing loaded, nothing decided."""
    monkeypatch.setattr(kernels, "STATE", {})
    monkeypatch.setattr(kernel_cache, "_WARNED", set())


def settle_within(seconds: float, call: Callable[[], object]) -> object:
    """call()'s result, run in a thread: a call still blocked after `seconds` fails the test instead of hanging it."""
    result = []
    thread = threading.Thread(target=lambda: result.append(call()), daemon=True)
    thread.start()
    thread.join(seconds)
    assert result, f"blocked for more than {seconds} s"
    return result[0]


def test_the_build_is_announced_only_when_it_compiles(monkeypatch, cache, caplog):
    """The first process compiles and says it takes a while; a later one loads the cached library without a word
    and without running torch's build at all."""
    with caplog.at_level(logging.INFO, logger="gptkit.native"):
        for _ in range(2):  # two processes, one after the other
            new_process(monkeypatch)
            assert kernels.load() is True
    announced = [r.getMessage() for r in caplog.records if "building gptkit's CPU kernels" in r.getMessage()]
    assert len(cache.built) == 1 and len(announced) == 1, announced
    library = kernel_cache.verified_library(build.build_directory())
    assert cache.opened == [(library, WHOLE_LIBRARY)] * 2  # each process loads what the builder left


def test_a_builder_process_that_fails_is_one_warning_naming_its_log(monkeypatch, tmp_path, caplog):
    # The one test of a real builder process (kernel_cache.spawn_build running kernel_cache.main); the others run it
    # in a thread. Its compiler here is `false`: it fails at once, and says so in build.log.
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "false")
    monkeypatch.setattr(cpu, "cpu_flags", lambda: {"avx2", "fma", "f16c"})
    monkeypatch.delenv(cpu.ISA_VARIABLE, raising=False)
    monkeypatch.delenv(build.DISABLE_VARIABLE, raising=False)
    monkeypatch.setenv(choices.UPCAST_VARIABLE, "0")
    monkeypatch.setattr(kernels, "STATE", {})
    with caplog.at_level(logging.WARNING, logger="gptkit.native"):
        assert settle_within(120, kernels.load) is False
    log = build.build_directory() / kernel_cache.BUILD_LOG
    [said] = [r.getMessage() for r in caplog.records]
    assert "did not build" in said and str(log) in said and log.read_text().splitlines()[0] in said
    assert kernels.STATE["builder"].returncode == 1


def test_copies_of_gptkit_share_one_library_and_never_rebuild_it(monkeypatch, cache, tmp_path):
    # Issue 43 item 1: two checkouts loading in turn relinked the shared library at every switch (torch's build
    # over the other copy's source paths). Same sources, same compiler, same torch: one build, then loads.
    import shutil

    copies = [tmp_path / name / "csrc" for name in ("checkout_a", "checkout_b")]
    for copy in copies:
        shutil.copytree(build.SOURCE_DIR, copy)
    directories = []
    for copy in copies * 2:
        monkeypatch.setattr(build, "SOURCE_DIR", copy)
        new_process(monkeypatch)
        assert kernels.load() is True
        directories.append(build.build_directory())
    assert len(set(directories)) == 1 and len(cache.built) == 1 and len(cache.opened) == 4


def test_the_cache_key_holds_the_sources_the_compiler_and_torch(monkeypatch, cache, tmp_path):
    """A library is shared only by what builds the same bits: another header, compiler or torch is another library."""
    import shutil

    directories = [build.build_directory()]
    edited = tmp_path / "edited" / "csrc"
    shutil.copytree(build.SOURCE_DIR, edited)
    (edited / "kernels.h").write_text((edited / "kernels.h").read_text() + "\n// one more line\n")
    with monkeypatch.context() as patch:
        patch.setattr(build, "SOURCE_DIR", edited)
        directories.append(build.build_directory())
    with monkeypatch.context() as patch:
        patch.setattr(kernel_cache, "compiler_version", lambda: "c++ (GCC) 99.1.0")
        directories.append(build.build_directory())
    with monkeypatch.context() as patch:
        patch.setattr(torch, "__version__", "9.9.9+cpu")
        directories.append(build.build_directory())
    assert len(set(directories)) == 4 and {d.parent for d in directories} == {cache.root}


@contextlib.contextmanager
def holding_the_build_lock(directory: Path, line: str) -> Iterator[None]:
    """The cache's build lock held as another process holds it (an flock on a file of its own), with its line."""
    import fcntl

    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / kernel_cache.LOCK, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        handle.write(line)
        handle.flush()
        yield


def test_a_process_never_waits_for_another_processs_build_and_takes_the_library_once_built(monkeypatch, cache, caplog):
    # Issue 43 item 1: a process that found another's build under way waited for it (`gptkit serve` had no /health
    # after two minutes). It decodes with PyTorch's products meanwhile and takes the library once it is there.
    directory = build.build_directory()
    model = GPT(ModelConfig(vocab_size=64, block_size=32, n_layer=1, n_head=2, n_embd=32)).eval()
    with holding_the_build_lock(directory, f"{os.getpid()} {time.time():.0f}\n"):  # a live builder
        with caplog.at_level(logging.INFO, logger="gptkit.native"):
            assert settle_within(5, kernels.load) is False  # not even load(wait=True) waits for it
            tokens = settle_within(30, lambda: generate_ids(model, [1, 2, 3], max_new_tokens=4, temperature=0))
        assert len(tokens) == 4 and kernels.building() and cache.built == [] and cache.opened == []
        sources = [build.SOURCE_DIR / name for name in build.SOURCES]
        library = kernel_cache.build(directory, directory.name, sources, [])  # the other process's build ends
    kernels.STATE["background"].join(10)
    assert kernels.load(wait=False) is True and not kernels.building()
    assert cache.opened == [(library, WHOLE_LIBRARY)] and len(cache.built) == 1
    assert len([r for r in caplog.records if "being built by another process" in r.getMessage()]) == 1


def test_a_process_awaiting_another_build_stops_looking_when_it_exits(cache):
    directory = build.build_directory()
    with holding_the_build_lock(directory, f"{os.getpid()} {time.time():.0f}\n"):
        assert kernels.load(wait=False) is False
        thread = kernels.STATE["background"]
        kernels._EXITING.set()  # what the process's exit does first (atexit), before joining the thread
        thread.join(5)
        assert not thread.is_alive() and "library" not in kernels.STATE


HOLD_LOCK = (
    "import fcntl, os, sys, time; f = open(sys.argv[1], 'a+'); fcntl.flock(f, fcntl.LOCK_EX); "
    "f.write(f'{os.getpid()} {time.time():.0f}\\n'); f.flush(); print('holding', flush=True); time.sleep(120)"
)


@pytest.mark.parametrize("holder", ["stopped", "held for an hour"])
def test_a_stopped_or_stale_builder_never_blocks_and_is_named_once(cache, caplog, holder):
    # Issue 43 item 1: a build lock held by a stopped process (kill -STOP, a debugger) blocked `generate` (killed at
    # 90 s) and `serve` for good. It is detected and built past, with one warning naming the lock and its holder.
    import signal

    directory = build.build_directory()
    directory.mkdir(parents=True)
    lock = directory / kernel_cache.LOCK
    child = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(lock)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "holding"
        if holder == "stopped":
            os.kill(child.pid, signal.SIGSTOP)
            stat = Path(f"/proc/{child.pid}/stat")
            for _ in range(500):  # the stop takes effect a moment after the signal is sent
                if stat.read_text().rsplit(")", 1)[1].split()[0] == "T":
                    break
                time.sleep(0.01)
            expected = f"is held by process {child.pid}, which is stopped"
        else:  # running, but its line says it took the lock an hour ago: a build takes about a minute
            lock.write_text(f"{child.pid} {time.time() - 3600:.0f}\n")
            expected = f"has been held by process {child.pid} for 36"
        with caplog.at_level(logging.WARNING, logger="gptkit.native"):
            assert settle_within(10, kernels.load) is True
    finally:
        child.kill()
        child.wait()
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and str(lock) in said[0] and expected in said[0], said
    assert len(cache.built) == 1


def test_what_a_killed_build_left_does_not_block_the_next_and_is_cleared(cache):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    directory = build.build_directory()
    leftover = directory / f"{kernel_cache.WORK_PREFIX}{gone.pid}"
    leftover.mkdir(parents=True)
    (leftover / "lock").touch()  # torch's own lock file, as a build killed with SIGKILL leaves it
    (leftover / "gemv.o").write_bytes(b"half an object file")
    long_ago = time.time() - 2 * kernel_cache.STALE_AFTER_S
    os.utime(leftover, (long_ago, long_ago))
    (directory / kernel_cache.LOCK).write_text(f"{gone.pid} {long_ago:.0f}\n")  # its line, its flock gone with it
    assert settle_within(10, kernels.load) is True
    assert not leftover.exists() and len(cache.built) == 1 and not Path(cache.built[0]).exists()


def _set_field(field: str, value: object) -> Callable[[Path, Path], None]:
    def change(library: Path, manifest: Path) -> None:
        manifest.write_text(json.dumps({**json.loads(manifest.read_text()), field: value}))

    return change


# How a cache is found damaged, and which file the one warning names.
DAMAGE = {
    "library cut to half": (lambda lib, man: lib.write_bytes(lib.read_bytes()[: len(lib.read_bytes()) // 2]), "lib"),
    "library overwritten": (lambda lib, man: lib.write_bytes(b"\0" * len(lib.read_bytes())), "lib"),
    "library deleted": (lambda lib, man: lib.unlink(), "lib"),
    "manifest empty": (lambda lib, man: man.write_text(""), "manifest"),
    "manifest a list": (lambda lib, man: man.write_text("[]"), "manifest"),
    "manifest a string": (lambda lib, man: man.write_text('"x"'), "manifest"),
    "manifest cut short": (lambda lib, man: man.write_text(man.read_text()[:40]), "manifest"),
    "manifest not text": (lambda lib, man: man.write_bytes(b"\xff\xfe\x00"), "manifest"),
    "another digest": (_set_field("sha256", "0" * 64), "lib"),
    "a digest of the wrong shape": (_set_field("sha256", "abc"), "manifest"),
    "a size as text": (_set_field("bytes", "12"), "manifest"),
    "a library outside the cache": (_set_field("library", "../kernels-0123456789abcdef.so"), "manifest"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_every_damaged_cache_file_is_named_once_never_loaded_and_built_again(monkeypatch, cache, caplog, damage):
    # Issue 43 item 2: a library cut to half its size was a SIGBUS on every decode (exit 135, no message). Each file
    # is checked against the manifest before anything is loaded; what fails is built again, with one warning.
    assert kernels.load() is True  # the first process builds
    directory = build.build_directory()
    library, manifest = kernel_cache.verified_library(directory), directory / kernel_cache.MANIFEST
    change, named = DAMAGE[damage]
    change(library, manifest)
    with caplog.at_level(logging.WARNING, logger="gptkit.native"):
        for _ in range(2):  # the next process finds the damage and builds again; the one after loads that build
            new_process(monkeypatch)
            assert kernels.load() is True
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and str(library if named == "lib" else manifest) in warnings[0], warnings
    assert len(cache.built) == 2 and cache.opened == [(library, WHOLE_LIBRARY)] * 3  # never the damaged bytes


@needs_kernels
def test_a_real_library_cut_in_half_is_never_loaded_and_decoding_goes_on(tmp_path):
    # A copy of this machine's cache with its library cut to half its size: loading that was a SIGBUS (exit 135).
    # The process decodes with PyTorch's products, and its builder is refused here (a compiler run takes a minute)
    # so that what is checked is what loads.
    import shutil

    built = build.build_directory()
    copy = tmp_path / built.name
    shutil.copytree(built, copy, ignore=shutil.ignore_patterns(kernel_cache.LOCK, f"{kernel_cache.WORK_PREFIX}*"))
    library = kernel_cache.verified_library(copy)
    library.write_bytes(library.read_bytes()[: library.stat().st_size // 2])
    code = (
        "import torch; from gptkit.native import cache, library; "
        "from gptkit.config import ModelConfig; from gptkit.model import GPT; "
        "from gptkit.decoding.api import generate_ids\n"
        "def refuse(*_): raise OSError('no compiler here')\n"
        "cache.spawn_build = refuse; torch.manual_seed(0)\n"
        "m = GPT(ModelConfig(vocab_size=64, block_size=32, n_layer=1, n_head=2, n_embd=32)).eval()\n"
        "print(len(generate_ids(m, [1, 2, 3], max_new_tokens=5, temperature=0)))\n"
        "library.prepare(); print(library.load())"
    )
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path), build.DISABLE_VARIABLE: "1"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["5", "False"]
    named = [line for line in done.stderr.splitlines() if str(library) in line]
    assert len(named) == 1 and "does not match" in named[0], done.stderr[-2000:]


@pytest.mark.parametrize(
    "content",
    ["[]", '"x"', '{"some machine": []}', '{"some machine": {"fp32": "yes"}}', '{"some machine": {"fp32": tr'],
)
def test_a_choices_file_of_the_wrong_shape_is_measured_again_and_rewritten(monkeypatch, tmp_path, caplog, content):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.delenv(build.DISABLE_VARIABLE, raising=False)
    monkeypatch.delenv(choices.UPCAST_VARIABLE, raising=False)
    monkeypatch.setattr(kernels, "STATE", {"library": True})
    monkeypatch.setattr(choices, "_measure", lambda: dict(ALL, int8=False))
    monkeypatch.setattr(kernel_cache, "_WARNED", set())
    path = build.build_directory() / choices.CHOICES_FILE
    path.parent.mkdir(parents=True)
    path.write_text(content)
    with caplog.at_level(logging.WARNING, logger="gptkit.native"):
        assert kernels.choices() == dict(ALL, int8=False)
        assert kernels.measured("fused_step", lambda: True) is True
    assert len([r for r in caplog.records if str(path) in r.getMessage()]) == 1  # one warning naming the file
    assert json.loads(path.read_text()) == {choices.machine_key(): dict(ALL, int8=False, fused_step=True)}
