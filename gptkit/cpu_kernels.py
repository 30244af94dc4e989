"""gptkit's own CPU kernel: a bf16 matrix-vector product that streams weights at memory speed.

Decoding reads every weight once per token, so a bf16 model should decode about twice as fast as an fp32 one. With
PyTorch 2.13's kernels it does not on a CPU: measured on a 2-core AVX-512 machine (50 distinct GPT-2-small weight
matrices, batch 1), fp32 F.linear streams 19-20 GB/s, bf16 F.linear 9 GB/s and inductor's compiled bf16 matmul 10-12;
csrc/gemv_bf16.cpp streams 16-18. It is used for few-row bf16 products on CPUs with AVX512-BF16, with autograd off;
every other product (training, prefill, fp32, CUDA) is F.linear.

The C++ source is compiled once per machine on first use (about 10 s, cached by torch.utils.cpp_extension under
~/.cache/torch_extensions or $TORCH_EXTENSIONS_DIR); if that fails, gptkit logs why once and keeps F.linear.
"""

from __future__ import annotations

import functools
import logging
import subprocess
import threading
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "gemv_bf16.cpp"
BUILD_FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512bf16", "-fopenmp"]
# Above this many rows a product is no longer bound by reading the weights; the kernel handles 1 to 8.
GEMV_MAX_ROWS = 8

# Whether the kernel is loaded (True), unusable here (False) or not tried yet (absent). Decided in eager code only:
# a compiled graph reads the answer.
_LOADED: dict[str, bool] = {}
_BUILDING = threading.Lock()  # a server's first requests may arrive together


def _cpu_has_avx512_bf16() -> bool:
    # Linux lists the instruction sets in /proc/cpuinfo (PyTorch 2.13 exposes no such probe). Elsewhere the kernel
    # is not built: macOS on Apple silicon has no AVX-512 and the build flags are gcc/clang's.
    try:
        return "avx512_bf16" in Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False


def gemv_bf16_available() -> bool:
    """Whether the bf16 GEMV kernel runs here, building and loading it on the first call (eager code only)."""
    if "gemv_bf16" not in _LOADED and not torch.compiler.is_compiling():
        with _BUILDING:
            if "gemv_bf16" not in _LOADED:
                _LOADED["gemv_bf16"] = _cpu_has_avx512_bf16() and _build()
    return _LOADED.get("gemv_bf16", False)


def _build() -> bool:
    from torch.utils import cpp_extension

    log.info("building gptkit's bf16 CPU kernel (once per machine, about 10 s)")
    try:
        cpp_extension.load(name="gptkit_gemv_bf16", sources=[str(SOURCE)], extra_cflags=BUILD_FLAGS,
                           extra_ldflags=["-fopenmp"], is_python_module=False)  # fmt: skip
    except (RuntimeError, OSError, subprocess.CalledProcessError) as err:
        log.warning("gptkit's bf16 CPU kernel did not build, so bf16 decoding uses PyTorch's slower matmul: %s", err)
        return False
    _register_shape_function()
    return True


@functools.cache
def _register_shape_function() -> None:
    """Tell torch.compile the op's output shape (once per process; a second registration is an error)."""
    torch.library.register_fake("gptkit::gemv_bf16")(_gemv_bf16_shape)


def _gemv_bf16_shape(x: Tensor, w: Tensor, bias: Tensor | None) -> Tensor:
    return x.new_empty(x.size(0), w.size(0))


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """F.linear, by the bf16 GEMV kernel when x is a few bf16 rows on a CPU that runs it and autograd is off."""
    rows = x.numel() // x.size(-1) if x.numel() else 0
    if (
        x.device.type == "cpu"
        and x.dtype == weight.dtype == torch.bfloat16
        and (bias is None or bias.dtype == torch.bfloat16)
        and 1 <= rows <= GEMV_MAX_ROWS
        and not torch.is_grad_enabled()
        and weight.is_contiguous()
        and gemv_bf16_available()
    ):
        y = torch.ops.gptkit.gemv_bf16(x.reshape(rows, x.size(-1)).contiguous(), weight, bias)
        return y.view(*x.shape[:-1], weight.size(0))
    return F.linear(x, weight, bias)
