"""gptkit.devices: the CPU's MFU peak holds up on a busy machine, and MFU shown stays sane."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from gptkit import devices


@pytest.fixture
def cpu_model(monkeypatch):
    """Replace the CPU by a model of one: a product of width n takes 2 n^3 FLOPs at `rate` x min(1, n / 1024) (a
    narrow product uses a CPU less well) plus `waiting` seconds on a fake clock (the product itself is not
    computed), and the calls listed in `slow` 50 ms more (descheduled). Returns (widths measured, the model)."""
    clock, widths = [0.0], []
    model = SimpleNamespace(rate=1e11, waiting=0.0, slow=set(), calls=0)

    def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        n = a.size(0)
        if not widths or widths[-1] != n:
            widths.append(n)
        clock[0] += 2 * n**3 / (model.rate * min(1.0, n / 1024)) + model.waiting + 0.05 * (model.calls in model.slow)
        model.calls += 1
        return a

    monkeypatch.setattr(torch.Tensor, "__matmul__", matmul)
    monkeypatch.setattr(devices, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    devices._cpu_matmul_flops.cache_clear()  # measured once per process: these tests measure again
    yield widths, model
    devices._cpu_matmul_flops.cache_clear()


def test_one_slow_timing_does_not_shrink_the_peak(cpu_model):
    widths, model = cpu_model
    model.slow = {1}  # the first timed product (call 0 sets up): another program ran then
    peak = devices.measured_cpu_matmul_flops(torch.float32)
    assert widths[-1] == devices.PEAK_MATMUL_SIZE and peak == pytest.approx(model.rate)


def test_waiting_at_barriers_does_not_pass_for_a_slow_cpu(cpu_model):
    # Two threads of a loaded 2-core machine: each product from 64 to 512 wide took about 60 ms (measured there).
    widths, model = cpu_model
    model.waiting = 0.06
    peak = devices.measured_cpu_matmul_flops(torch.float32)
    assert widths[-1] == devices.PEAK_MATMUL_SIZE
    assert peak == pytest.approx(2 * 1024**3 / (2 * 1024**3 / model.rate + 0.06))  # the widest product's rate


@pytest.mark.parametrize("rate, widest", [(1e9, 128), (1e11, 1024)])
def test_the_product_grows_only_while_the_next_stays_quick(cpu_model, rate, widest):
    # bf16 on an AVX2-only CPU multiplies at about 1 GFLOP/s: a 1,024-wide product took 2 s, the measurement 25 s
    # at every training start. Where time is the work's, the width doubles only while 8 times as long fits.
    widths, model = cpu_model
    model.rate = rate
    assert devices.measured_cpu_matmul_flops(torch.float32) == pytest.approx(rate * widest / 1024)
    assert widths == [devices.PEAK_FIRST_SIZE * 2**i for i in range(int(math.log2(widest / 64)) + 1)]


def test_mfu_is_at_most_one():
    assert devices.mfu(5e10, 1e11) == 0.5
    assert devices.mfu(5.2e12, 1e11) == 1.0  # a peak measured too low shows 100%, not 5200%


def test_the_peak_is_a_real_cpus_rate_and_overridable():
    fp32 = devices.measured_cpu_matmul_flops(torch.float32)
    assert 1e8 < fp32 < 1e14  # a real CPU's matmul, not a constant: from 0.1 GFLOP/s to 100 TFLOP/s
    assert devices.peak_flops(torch.device("cpu"), "float32", 5e12) == 5e12
    assert devices.peak_flops(torch.device("meta"), "float32", None) is None  # unknown devices show no MFU
