"""gptkit's own CPU kernels: bf16 and int8 matrix-vector products that stream weights at memory speed.

Decoding reads every weight once per token, so a bf16 model should decode about twice as fast as an fp32 one and
an int8 one four times. With PyTorch 2.13's kernels it does not on a CPU. Measured on a 2-core AVX-512 machine over
50 distinct GPT-2-small weight matrices at batch 1: fp32 F.linear streams 19-20 GB/s, bf16 F.linear 9 and inductor's
compiled bf16 matmul 10-12; csrc/gemv.cpp streams 16-18 in bf16 (10-11 at 8 rows, against 7 for oneDNN), and
int8 at 11-12 against 7 for torch._weight_int8pack_mm.
The kernels serve few-row products (decoding, up to GEMV_MAX_ROWS rows) on CPUs with AVX-512 (and AVX512-BF16 for
bf16), with autograd off; every other product (training, prefill, fp32, CUDA) keeps PyTorch's, except that bf16
inference over many rows (prefill, eval) runs in fp32 on CPUs without AMX, where that is faster.

The C++ source is compiled once per machine on first use (about 10 s, cached by torch.utils.cpp_extension under
$TORCH_EXTENSIONS_DIR or torch's default root, ~/.cache/torch_extensions); if that fails, gptkit logs why once and
keeps PyTorch's kernels. A build killed midway leaves nothing that blocks the next one.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import subprocess
import threading
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "gemv.cpp"
BUILD_FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-fopenmp"]
BUILD_CPU_FLAGS = {"avx512f", "avx512bw", "avx512vl"}  # as /proc/cpuinfo names them
DISABLE_VARIABLE = "GPTKIT_CPU_KERNELS"  # set to 0 to keep PyTorch's kernels (read once, at first use)
# Above this many rows a product is no longer bound by reading the weights; the kernel handles 1 to 8.
GEMV_MAX_ROWS = 8
# From this many rows on, a bf16 product on a CPU without AMX runs faster in fp32 (weights converted on the fly):
# PyTorch 2.13's bf16 matmul reaches half the fp32 rate there (135 against 260 GFLOP/s on 2 threads). One GPT-2
# matrix, bf16 against converted-fp32 ms: 64 rows 1.47 vs 1.71, 128 rows 2.89 vs 2.22, 512 rows 11.7 vs 7.7.
BF16_UPCAST_MIN_ROWS = 128
# Below this many rows a compiled graph keeps inductor's own int8 GEMM template (it prepacks the weights when it
# freezes them), which wins there; this kernel wins in eager code at every batch. GPT-2 small, compiled, fp32
# activations, tokens/s template vs kernel: batch 1 72 vs 58, 2 131 vs 109, 4 195 vs 180, 6 156 vs 242,
# 8 185 vs 233 (bf16 activations: batch 4 215 vs 211, 8 217 vs 248). Eager, batch 1: 42 vs 51.
COMPILED_INT8_MIN_ROWS = 5

# Whether the kernels are loaded (True), unusable here (False) or not tried yet (absent). Decided in eager code only:
# a compiled graph reads the answer.
_LOADED: dict[str, bool] = {}
_BUILDING = threading.Lock()  # a server's first requests may arrive together


@functools.cache
def _cpu_flags() -> set[str]:
    # Linux lists the instruction sets in /proc/cpuinfo (PyTorch 2.13 exposes no such probe). Elsewhere nothing is
    # built: macOS on Apple silicon has no AVX-512 and the build flags are gcc/clang's.
    try:
        return set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return set()


def load() -> bool:
    """Whether the kernels' library is loaded, building it on the first call (eager code only)."""
    if "library" not in _LOADED and not torch.compiler.is_compiling():
        with _BUILDING:
            if "library" not in _LOADED:
                flags = _cpu_flags()
                _LOADED["avx512_bf16"] = "avx512_bf16" in flags
                wanted = os.environ.get(DISABLE_VARIABLE) != "0"
                _LOADED["library"] = wanted and BUILD_CPU_FLAGS <= flags and _build()
    return _LOADED.get("library", False)


def gemv_bf16_available() -> bool:
    """Whether the bf16 GEMV kernel runs here (the first call builds the kernels; eager code only)."""
    return load() and _LOADED["avx512_bf16"]


def gemv_int8_available() -> bool:
    """Whether the int8 weight-only GEMV kernel runs here (the first call builds the kernels; eager code only)."""
    return load()


def _build() -> bool:
    import fcntl  # Unix only, as builds are (_cpu_flags is empty elsewhere)

    from torch.utils import cpp_extension

    log.info("building gptkit's CPU kernels (once per machine, about 10 s)")
    build_dir = build_directory()
    try:
        build_dir.mkdir(parents=True, exist_ok=True)
        # torch's own lock file names no owner, so a build killed outright leaves it and every later build waits on
        # it forever. Builds here take an flock first, which the system releases when its holder dies: whoever
        # holds it knows that a torch lock file still present is a dead build's.
        with open(build_dir / "gptkit.lock", "w") as owner:
            fcntl.flock(owner, fcntl.LOCK_EX)
            if (build_dir / "lock").exists():
                log.warning("removing the lock file of an earlier build that did not finish")
                (build_dir / "lock").unlink()
            cpp_extension.load(name=build_dir.name, sources=[str(SOURCE)], extra_cflags=BUILD_FLAGS,
                               extra_ldflags=["-fopenmp"], build_directory=str(build_dir),
                               is_python_module=False)  # fmt: skip
    except (RuntimeError, OSError, subprocess.CalledProcessError) as err:
        log.warning("gptkit's CPU kernels did not build, so bf16 and int8 decoding use PyTorch's slower ones: %s", err)
        return False
    _register_shape_functions()
    return True


def build_directory() -> Path:
    """Where the kernels' library is built and cached: one directory per torch version (a library built against
    another libtorch may not load), under $TORCH_EXTENSIONS_DIR or torch's default root."""
    from torch.utils import cpp_extension

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    return Path(root) / ("gptkit_gemv_torch_" + re.sub(r"\W", "_", torch.__version__))


@functools.cache
def _register_shape_functions() -> None:
    """Tell torch.compile the ops' output shapes (once per process; a second registration is an error)."""
    torch.library.register_fake("gptkit::gemv_bf16")(lambda x, w, bias: x.new_empty(x.size(0), w.size(0)))
    torch.library.register_fake("gptkit::gemv_int8")(lambda x, q, scales: x.new_empty(x.size(0), q.size(0)))


def _cpu_inference_rows(x: Tensor) -> int:
    """The rows of x (all dimensions but the last) if x is on a CPU with autograd off; else 0."""
    if x.device.type != "cpu" or torch.is_grad_enabled() or not x.numel():
        return 0
    return x.numel() // x.size(-1)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """F.linear; for bf16 inference on a CPU, by the GEMV kernel (few rows) or in fp32 (many rows, no AMX)."""
    rows = _cpu_inference_rows(x)
    bf16 = x.dtype == weight.dtype == torch.bfloat16 and (bias is None or bias.dtype == torch.bfloat16)
    if (
        bf16
        and 1 <= rows <= GEMV_MAX_ROWS
        and (bias is None or bias.is_contiguous())
        and weight.is_contiguous()
        and gemv_bf16_available()
    ):
        y = torch.ops.gptkit.gemv_bf16(x.reshape(rows, x.size(-1)).contiguous(), weight, bias)
        return y.view(*x.shape[:-1], weight.size(0))
    if bf16 and rows >= BF16_UPCAST_MIN_ROWS and "amx_bf16" not in _cpu_flags():
        return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(torch.bfloat16)
    return F.linear(x, weight, bias)


def int8_linear(x: Tensor, q: Tensor, scales: Tensor) -> Tensor | None:
    """(x @ q^T) * scales in x's dtype by the int8 GEMV kernel, or None where it does not apply (the caller's job)."""
    rows = _cpu_inference_rows(x)
    if (
        not 1 <= rows <= GEMV_MAX_ROWS
        or not q.is_contiguous()
        or (torch.compiler.is_compiling() and rows < COMPILED_INT8_MIN_ROWS)
        or not gemv_int8_available()
    ):
        return None
    x2 = x.reshape(rows, x.size(-1)).float().contiguous()
    y = torch.ops.gptkit.gemv_int8(x2, q, scales.float().contiguous())
    return y.to(x.dtype).view(*x.shape[:-1], q.size(0))


def prepare() -> None:
    """Build (or rule out) the kernels now, in eager code, before a compiled graph needs the answer."""
    load()
