"""The products: F.linear, int8 and q4 weight-only products over few rows by gptkit's kernels where they run (and
were measured faster), PyTorch's otherwise; the q4 dequantisation; and huge pages for a model's weights. Everything
runs on CPU inference only (autograd off); training, CUDA and MPS keep PyTorch's products."""

from __future__ import annotations

import threading
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import Tensor

from gptkit.native import BF16_UPCAST_MIN_ROWS

GEMV_MAX_ROWS = 8  # above this many rows a product is no longer bound by reading the weights
# Below this many rows a compiled graph keeps inductor's own int8 GEMM template (it prepacks the weights when it
# freezes them), which won there on a 2-core AVX-512 machine; the kernel won in eager code at every batch. GPT-2
# small, compiled, fp32 activations, tokens/s template vs kernel: batch 1 72 vs 58, 2 131 vs 109, 4 195 vs 180,
# 6 156 vs 242, 8 185 vs 233.
COMPILED_INT8_MIN_ROWS = 5
# Weights under this many values keep F.linear over many rows. At 64 rows with the weights in cache, MKL's F.linear
# took 0.68x of gptkit's kernel's time at 256 x 128 and 0.88x at 768 x 256, and the two were level at 512 x 512
# (0.98x) and 768 x 768 (1.02x); with the weights read from memory, as a prefill reads them, the kernel led
# (bench_kernels.py --shapes gpt2-prefill). 2-core AVX2 EPYC, best of 30 interleaved rounds.
GEMM_MIN_WEIGHT = 512 * 512
HUGE_PAGES_EXIT_WAIT_S = 30.0  # moving huge pages is about a second per GB
_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16"}
_LIBRARY: ModuleType | None = None  # gptkit.native.library, once _library() has imported it
_MOVING_PAGES: list[threading.Thread] = []  # back_with_huge_pages' threads not yet awaited


def _library() -> ModuleType:
    """gptkit.native.library, imported by the first CPU inference product rather than with this module: the model's
    layers import ops, and a model that only trains or is only built never needs the build machinery (the cache,
    the builder process, the timed choices). Kept in _LIBRARY since every product asks."""
    global _LIBRARY
    if _LIBRARY is None:
        from gptkit.native import library

        _LIBRARY = library
    return _LIBRARY


def _loaded() -> bool:
    """Whether the library is loaded (eager code only); where it is yet to come, loading starts in the background."""
    library = _library()
    return bool(library.STATE.get("library") or library.load(wait=False))


def cpu_inference_rows(x: Tensor) -> int:
    """The rows of x (all dimensions but the last) if x is on a CPU with autograd off; else 0."""
    if x.device.type != "cpu" or torch.is_grad_enabled() or not x.numel():
        return 0
    return x.numel() // x.size(-1)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """F.linear; for fp32 and bf16 inference on a CPU, by the GEMV kernel (few rows) or the many-row fp32 kernel
    where each is the faster, and bf16 over many rows in fp32 where that is the faster."""
    rows = cpu_inference_rows(x)
    if not rows:
        return F.linear(x, weight, bias)
    name = _DTYPE_NAMES.get(weight.dtype)
    same = name is not None and x.dtype == weight.dtype and (bias is None or bias.dtype == weight.dtype)
    if same and rows <= GEMV_MAX_ROWS and weight.is_contiguous() and _library().choices().get(name, False):
        y = torch.ops.gptkit.gemv(x.reshape(rows, x.size(-1)).contiguous(), weight, bias)
        return y.view(*x.shape[:-1], weight.size(0))  # (rows, out) -> x's leading dimensions
    if same and name == "bf16" and rows >= BF16_UPCAST_MIN_ROWS and _library().choices().get("bf16_upcast", False):
        return _many_rows_f32(x.float(), weight.float(), None if bias is None else bias.float()).to(torch.bfloat16)
    if same and name == "fp32":
        return _many_rows_f32(x, weight, bias)
    return F.linear(x, weight, bias)


def _many_rows_f32(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """F.linear over fp32 rows past GEMV_MAX_ROWS: by the many-row kernel (csrc/gemm.h) for weights of at least
    GEMM_MIN_WEIGHT values where it was measured the faster, outside a graph being compiled (inductor's frozen
    weights have their own prepacked GEMM)."""
    rows = x.numel() // x.size(-1)
    if (
        rows <= GEMV_MAX_ROWS
        or weight.numel() < GEMM_MIN_WEIGHT
        or not weight.is_contiguous()
        or torch.compiler.is_compiling()
        or not _library().choices().get("fp32_rows", False)
    ):
        return F.linear(x, weight, bias)
    y = torch.ops.gptkit.gemm(x.reshape(rows, x.size(-1)).contiguous(), weight, bias)
    return y.view(*x.shape[:-1], weight.size(0))  # (rows, out) -> x's leading dimensions


def int8_linear(x: Tensor, q: Tensor, scales: Tensor, bias: Tensor | None = None) -> Tensor | None:
    """(x @ q^T) * scales (+ bias) in x's dtype by the int8 GEMV kernel, or None where it does not apply."""
    rows = cpu_inference_rows(x)
    if (
        not 1 <= rows <= GEMV_MAX_ROWS
        or not q.is_contiguous()
        or (torch.compiler.is_compiling() and rows < COMPILED_INT8_MIN_ROWS)
        or not _library().choices().get("int8", False)
    ):
        return None
    x2 = x.reshape(rows, x.size(-1)).float().contiguous()  # (rows, in)
    y = torch.ops.gptkit.gemv_int8(x2, q, scales.float().contiguous(), bias)
    return y.to(x.dtype).view(*x.shape[:-1], q.size(0))  # (rows, out) -> x's leading dimensions


def q4_linear(x: Tensor, q: Tensor, scales: Tensor, bias: Tensor | None, out_features: int) -> Tensor | None:
    """The q4 product (csrc/kernels.h: q and scales in groups of 8 rows, activations rounded to int8 per block of
    32) in x's dtype, or None where it does not apply (autograd, another device, more than GEMV_MAX_ROWS rows, the
    library not loaded): there is no PyTorch product to measure it against, so it runs wherever it can."""
    rows = cpu_inference_rows(x)
    if not 1 <= rows <= GEMV_MAX_ROWS or not _loaded():
        return None
    x2 = x.reshape(rows, x.size(-1)).float().contiguous()  # (rows, in)
    y = torch.ops.gptkit.gemv_q4(x2, q, scales, bias, out_features)
    return y.to(x.dtype).view(*x.shape[:-1], out_features)  # (rows, out) -> x's leading dimensions


def dequantize_q4(q: Tensor, scales: Tensor, rows: int, dtype: torch.dtype) -> Tensor | None:
    """Grouped q4 blocks (q4_linear's q and scales) as the float (rows, K) weight in dtype (fp32 or bf16) in one
    native pass, the values PyTorch's ops give; None where the library is not loaded or q is not on a CPU."""
    if q.device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return None
    if not _loaded():
        return None
    return torch.ops.gptkit.dequantize_q4(q, scales, rows, dtype)


def back_with_huge_pages(tensors: list[Tensor]) -> None:
    """Ask Linux to back the tensors' memory with 2 MiB pages (csrc/gemv.cpp's huge_pages says why: weights stream
    about 15% faster), in a daemon thread: moving a model's pages takes about a second per GB, and decoding goes
    on meanwhile (the call releases the GIL). A no-op without the library, or where the system refuses."""
    library = _library()
    if library.STATE.get("library"):
        thread = library.start_native_thread(
            lambda: torch.ops.gptkit.huge_pages(tensors), "gptkit-huge-pages", HUGE_PAGES_EXIT_WAIT_S
        )
        _MOVING_PAGES.append(thread)


def await_huge_pages(timeout_s: float = HUGE_PAGES_EXIT_WAIT_S) -> None:
    """Wait (up to timeout_s for each) until the pages back_with_huge_pages is moving are moved: decode steps timed
    meanwhile measure the move too (a fp32 Qwen3-MoE-shaped step ran at half its speed for the first 7 s)."""
    while _MOVING_PAGES:
        _MOVING_PAGES.pop().join(timeout_s)
