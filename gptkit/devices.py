"""Choosing the device to run on: one rule for every command."""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from gptkit.errors import ConfigError


def pick_device(name: str, option: str = "--device") -> torch.device:
    """The device for `auto` (CUDA, then MPS, then CPU) or the named one, checked to exist.

    option names the setting in error messages (e.g. "--device" or "train.device").
    """
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"{option} {name!r} is not a device; use auto, cpu, cuda, cuda:N or mps") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"{option} {name} was asked for but no CUDA device is available; use auto or cpu")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"{option} {name} was asked for but MPS is not available; use auto or cpu")
    return device


# Dense (no structured sparsity) peak FLOP/s of GPUs by the name CUDA reports, from NVIDIA's datasheets: (16-bit
# tensor-core rate for bfloat16 and float16, float32 rate without TF32, which PyTorch leaves off for matmuls).
GPU_PEAK_FLOPS: dict[str, tuple[float, float]] = {
    "NVIDIA H100 80GB HBM3": (989.4e12, 66.9e12),  # H100 SXM5
    "NVIDIA H100 PCIe": (756.0e12, 51.2e12),
    "NVIDIA H100 NVL": (835.0e12, 60.0e12),
    "NVIDIA H200": (989.4e12, 66.9e12),  # H200 SXM: the H100 SXM's chip and clocks
    "NVIDIA A100-SXM4-80GB": (312.0e12, 19.5e12),
    "NVIDIA A100-SXM4-40GB": (312.0e12, 19.5e12),
    "NVIDIA A100 80GB PCIe": (312.0e12, 19.5e12),
    "NVIDIA A100-PCIE-40GB": (312.0e12, 19.5e12),
    "NVIDIA L40S": (362.05e12, 91.6e12),
    "NVIDIA L4": (121.0e12, 30.3e12),
}


def gpu_peak_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    """A known GPU's dense peak FLOP/s for matmuls in dtype (the datasheet's), or None for any other device."""
    if device.type != "cuda":
        return None
    rates = GPU_PEAK_FLOPS.get(torch.cuda.get_device_name(device))
    if rates is None:
        return None
    return rates[1] if dtype == torch.float32 else rates[0]


def autocast_for(device: torch.device, dtype: str) -> contextlib.AbstractContextManager:
    """The mixed-precision context of a forward pass in dtype (a no-op for float32)."""
    if dtype == "float32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=getattr(torch, dtype))


# On CPU, MFU is measured against this CPU's own matmul (CPUs differ too much for one table of peaks): the best rate
# over square products of doubling sizes up to this one, about 0.1 s at start. The 2-core reference machine gives
# fp32 260 GFLOP/s and bf16 135 (PyTorch 2.13 without AMX); a fixed 146 / 349 used before overstated fp32 MFU about
# twice. A GPU of gptkit.devices.GPU_PEAK_FLOPS is measured against its datasheet; other devices show MFU only when
# train.peak_flops is set.
PEAK_MATMUL_SIZE = 1024
# A product grows (doubling its side) while the next would take at most this long: where a dtype has no hardware
# behind it (bf16 on an AVX2-only CPU: about 1 GFLOP/s) a 1,024-wide product takes 2 s, and the measurement, 25 s
# at every training start; it stays at 256 there and takes half a second.
PEAK_MATMUL_SECONDS = 0.05
# It also grows while its time does not follow its work: a product twice as wide takes 8 times as long where time
# is the work's, but about as long where it is waiting (two threads of a loaded 2-core machine: each product from
# 64 to 512 wide took 60 ms, waiting at OpenMP's barriers for the other thread to be scheduled), so that waiting
# does not pass for a slow CPU. Each size is timed PEAK_REPEATS times and its best kept: one slow timing stopped
# the growth at 128 x 128 on a busy machine, and the peak, a tenth of the 1,024-wide rate, showed MFU of 5196%.
PEAK_FIRST_SIZE = 64
PEAK_WAITING_GROWTH = 2.0  # a doubling whose time less than doubled (8x where it is the work's) was waiting
PEAK_REPEATS = 5


def peak_flops(device: torch.device, dtype: str, override: float | None) -> float | None:
    """Peak FLOP/s for MFU: the override, else a CPU's measured matmul rate or a known GPU's datasheet rate, else
    unknown (None)."""
    if override is not None:
        return override
    if device.type == "cpu":
        return measured_cpu_matmul_flops(getattr(torch, dtype))
    return gpu_peak_flops(device, getattr(torch, dtype))


def mfu(achieved_flops: float, peak: float) -> float:
    """Model FLOPs utilisation, at most 1: a rate past the peak means the peak was measured too low (another program
    slowed every timing), and 100% says that better than 5000%."""
    return min(1.0, achieved_flops / peak)


def measured_cpu_matmul_flops(dtype: torch.dtype) -> float:
    """This CPU's dense matmul FLOP/s in dtype at the current thread count: the best rate over square products of
    doubling width, up to PEAK_MATMUL_SIZE where that stays quick (PEAK_MATMUL_SECONDS), each the best of
    PEAK_REPEATS timings; measured once per process and count."""
    return _cpu_matmul_flops(dtype, torch.get_num_threads())


@functools.cache
def _cpu_matmul_flops(dtype: torch.dtype, threads: int) -> float:
    own = torch.Generator().manual_seed(0)  # the global RNG stays untouched: resumed runs replay it exactly
    n, rate, previous = PEAK_FIRST_SIZE, 0.0, math.inf
    while True:
        a, b = torch.randn(n, n, generator=own).to(dtype), torch.randn(n, n, generator=own).to(dtype)
        a @ b  # first-call set-up (thread pool, packing buffers) is not the rate
        best = math.inf
        for _ in range(PEAK_REPEATS):
            start = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - start)
        rate = max(rate, 2 * n**3 / best)
        waiting = best < PEAK_WAITING_GROWTH * previous
        if n >= PEAK_MATMUL_SIZE or (8 * best > PEAK_MATMUL_SECONDS and not waiting):
            return rate
        n, previous = 2 * n, best


def gpu_recipe_on_cpu(
    requested: str, device: torch.device, dtype: str, compiled: bool, total_flops: float, peak: float | None
) -> str | None:
    """The warning for a recipe written for a GPU (device auto, with bf16/fp16 or compile) that found only a CPU:
    the FLOPs it needs and the least time they take at the CPU's measured peak; None for any other run."""
    fixed_dtype = dtype not in ("float32", "auto")  # (auto trains in bfloat16 on a CPU only where it is faster)
    if requested != "auto" or device.type != "cpu" or not (fixed_dtype or compiled):
        return None
    settings = ", ".join([f"dtype {dtype}"] * fixed_dtype + ["compile"] * compiled)
    floor = f", at least {_duration(total_flops / peak)} at its measured {peak / 1e9:.0f} GFLOP/s" if peak else ""
    faster = "; on a CPU, use dtype auto (bfloat16 only where measured faster) or float32" if fixed_dtype else ""
    return (
        f"this run is set up for a GPU (device auto, {settings}) but found none, so it trains on the CPU: "
        f"{total_flops:.2g} FLOPs{floor} (the progress bar's ETA measures it{faster})"
    )


def _duration(seconds: float) -> str:
    """A time as a person says it: 45 s, 12 min, 3 h 20 min."""
    if seconds < 60:
        return f"{seconds:.0f} s"
    if seconds < 3600:
        return f"{seconds / 60:.0f} min"
    return f"{int(seconds // 3600)} h {int(seconds % 3600 // 60)} min"


def check_precision(dtype: str, device: torch.device) -> None:
    """float16 trains with a gradient scaler, which needs CUDA."""
    if dtype == "float16" and device.type != "cuda":
        raise ConfigError(
            f"train.dtype float16 needs CUDA (gradient scaling); on {device.type} use bfloat16 or float32"
        )


def attention_backends(device: torch.device) -> contextlib.AbstractContextManager:
    """The scaled-dot-product attention kernels to try first on device, as a context around training.

    On Hopper (compute capability 9.x) cuDNN's fused attention comes first: faster than FlashAttention 2 at
    training shapes there (benchmarks/bench_gpu.py --parts attention measures both). Elsewhere PyTorch's own order.
    PyTorch still falls back down the list where a kernel cannot take an input (a mask it lacks, a dtype).
    """
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] != 9:
        return contextlib.nullcontext()

    if "set_priority" not in inspect.signature(sdpa_kernel).parameters:  # PyTorch before 2.6 cannot order them
        return contextlib.nullcontext()
    order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    return sdpa_kernel(order, set_priority=True)
