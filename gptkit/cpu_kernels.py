"""gptkit's own CPU kernels: few-row products that stream weights at memory speed, and the fused decode step.

Decoding reads every weight once per token, so its speed on a CPU is how fast the matmuls stream the weights; an
int8 model should decode about four times as fast as an fp32 one. PyTorch 2.13's few-row kernels fall short of
the memory's rate (measured over GPT-2-small matrices at batch 1: on a 2-core AVX-512 machine, fp32 F.linear 19-20
GB/s of ~30, bf16 9, torch._weight_int8pack_mm 7; on a 2-core AVX2 EPYC, fp32 5.3 GB/s of ~11, bf16 2.9).
csrc/ holds products for 1 to GEMV_MAX_ROWS rows of fp32, bf16, int8 and q4 weights (gemv.cpp, over kernels.h) and
the whole decode step in one call, for any number of rows (step.cpp, driven by gptkit.decoding.fused). The library
is compiled for the widest instruction set of ISA_LEVELS this CPU has. Whether each product (fp32, bf16, int8
weights) and the fused step (at one row, and at each batch size past GEMV_MAX_ROWS it is asked for) are used is
decided by timing them against PyTorch on this machine, once, and kept in a small JSON file beside the built
library: a CPU flag says what can run, never what is faster. The same measurement decides whether bf16 inference
over many rows (prefill, eval) runs in fp32, which is faster where bf16 matmul has no hardware behind it.

A choice timed while other programs kept more than a quarter of a core busy is kept all the same, marked so, with
a log line (kernel_cache.timed_choice): a busy machine does not time it again at every start, and the first
process that starts on a quiet machine times it again, once; delete choices.json to measure again.
Overrides: GPTKIT_CPU_KERNELS=0 keeps PyTorch's products (the kernels are not even built), =1 uses the kernels
without measuring; GPTKIT_BF16_UPCAST=1 or 0 forces the many-row bf16 choice. Everything runs on CPU inference
only (autograd off); training, CUDA and MPS keep PyTorch's products.

The C++ sources are compiled once per machine and version (about a minute on 2 cores) into the cache that
kernel_cache.py describes (under $TORCH_EXTENSIONS_DIR or ~/.cache/torch_extensions, keyed by the sources, flags,
compiler and torch; a library is checked against its manifest before it is loaded). Decoding never waits for a
build: the first process that needs the library starts a builder process (which finishes even if this one ends
first) and decodes with PyTorch's products meanwhile, a background thread taking the library once it is there; one
that finds another process's build under way does the same without starting one; later processes load it at once.
prepare() waits for this process's own build (benchmarks, tests, a compiled step), never another's. If the build
fails, gptkit logs why once and keeps PyTorch's kernels.
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import json
import logging
import os
import platform
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from gptkit import kernel_cache
from gptkit.errors import ConfigError

log = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).parent / "csrc"
SOURCES = ("gemv.cpp", "step.cpp")  # and the headers they include (kernels.h: simd.h, quant.h, products.h; ...)
BUILD_FLAGS = ["-O3", "-fopenmp"]
# The instruction sets the library is built for, widest first: (name, what /proc/cpuinfo must list, compiler flags).
# torch.ops.gptkit.isa() numbers them from the narrowest (1) up.
_AVX2 = ({"avx2", "fma", "f16c"}, ["-mavx2", "-mfma", "-mf16c"])
_AVX512 = ({"avx512f", "avx512bw", "avx512vl", "avx512dq"}, ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"])
ISA_LEVELS = (
    (
        "avx512_bf16",
        _AVX2[0] | _AVX512[0] | {"avx512_vnni", "avx512_bf16"},
        _AVX2[1] + _AVX512[1] + ["-mavx512vnni", "-mavx512bf16"],
    ),
    ("avx512_vnni", _AVX2[0] | _AVX512[0] | {"avx512_vnni"}, _AVX2[1] + _AVX512[1] + ["-mavx512vnni"]),
    ("avx512", _AVX2[0] | _AVX512[0], _AVX2[1] + _AVX512[1]),
    ("avx2", _AVX2[0], _AVX2[1]),
)
DISABLE_VARIABLE = "GPTKIT_CPU_KERNELS"  # 0: PyTorch's products only; 1: the kernels without measuring
UPCAST_VARIABLE = "GPTKIT_BF16_UPCAST"  # 1 or 0: many-row bf16 products in fp32 or not, without measuring
ISA_VARIABLE = "GPTKIT_CPU_ISA"  # one of ISA_LEVELS' names: build that variant (the CPU must run it)
GEMV_MAX_ROWS = 8  # above this many rows a product is no longer bound by reading the weights
# From this many rows on, a bf16 product may run faster in fp32 (weights converted on the fly) where bf16 matmul
# has no hardware support: whether it does is measured (choices()["bf16_upcast"]).
BF16_UPCAST_MIN_ROWS = 128
# Below this many rows a compiled graph keeps inductor's own int8 GEMM template (it prepacks the weights when it
# freezes them), which won there on a 2-core AVX-512 machine; the kernel won in eager code at every batch. GPT-2
# small, compiled, fp32 activations, tokens/s template vs kernel: batch 1 72 vs 58, 2 131 vs 109, 4 195 vs 180,
# 6 156 vs 242, 8 185 vs 233.
COMPILED_INT8_MIN_ROWS = 5
ISA_NAMES = {0: "none", 1: "avx2", 2: "avx512", 3: "avx512_vnni", 4: "avx512_bf16"}
CHOICES_FILE = "choices.json"
MEASURED = {"fp32", "bf16", "int8", "bf16_upcast"}  # what _measure decides; choices.json entries may hold more
# An entry's mark that one of its choices was timed while other programs were busy: kept, so that a busy machine
# does not time it again at every start, and timed again by the first process that finds the machine quiet.
TIMED_BUSY = "timed_while_busy"

# State decided in eager code only (a compiled graph reads the answers): "library" (bool), "choices" (dict); and
# "background" (the thread that awaits a build and measures) and "builder" (this process's builder process).
_STATE: dict[str, object] = {}
_UNDECIDED: dict[str, bool] = {}  # what a compiled graph reads if nothing was decided in eager code before it
# How long a process ending waits for its background work: a build runs in a process of its own (left to finish),
# loading and measuring take a few seconds; moving huge pages is about a second per GB.
BUILD_EXIT_WAIT_S = 10.0
HUGE_PAGES_EXIT_WAIT_S = 30.0
_BUILDING = threading.RLock()  # a server's first requests may arrive together
_STARTING = threading.Lock()  # starts the background build once
_EXITING = threading.Event()  # set at exit: a background thread awaiting another process's build stops looking
POLL_S = 1.0  # how often a process awaiting another's build looks for the library


@functools.cache
def _cpu_flags() -> set[str]:
    # Linux lists the instruction sets in /proc/cpuinfo (PyTorch 2.13 exposes no such probe). Elsewhere nothing is
    # built: macOS on Apple silicon has neither AVX2 nor AVX-512 and the build flags are gcc/clang's.
    try:
        return set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return set()


def cpu_flags() -> set[str]:
    """The instruction-set extensions this CPU reports (/proc/cpuinfo's flags; none where that is missing)."""
    return _cpu_flags()


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def isa_level() -> tuple[str, list[str]] | None:
    """(name, compiler flags) of the widest of ISA_LEVELS this CPU runs, or None (no AVX2: no kernels); $GPTKIT_CPU_ISA
    names a narrower one (to try another variant's code on a wider CPU)."""
    flags, wanted = _cpu_flags(), os.environ.get(ISA_VARIABLE)
    runs = [(name, build) for name, needed, build in ISA_LEVELS if needed <= flags]
    if wanted and wanted not in [name for name, _, _ in ISA_LEVELS]:
        raise ConfigError(f"{ISA_VARIABLE}={wanted} is not one of {', '.join(name for name, _, _ in ISA_LEVELS)}")
    if wanted:
        runs = [(name, build) for name, build in runs if name == wanted]
    return runs[0] if runs else None


def load(wait: bool = True) -> bool:
    """Whether the kernels' library is loaded (eager code only). A library built before is checked and loaded at
    once; else wait=True builds it now and wait=False in a background thread, returning False until it is done.
    Neither waits for a build another process runs: PyTorch's products meanwhile, and a background thread takes the
    library once it is there (looking every POLL_S)."""
    if "library" in _STATE or torch.compiler.is_compiling():
        return bool(_STATE.get("library", False))
    if (not wait and building()) or not _BUILDING.acquire(blocking=wait):
        return False  # this process builds or measures in the background: never waited for by decoding
    try:
        if "library" not in _STATE:
            settled = _settle(start=wait, wait=wait)
            if settled is None:
                _build_in_background()
            else:
                _STATE["library"] = settled
    finally:
        _BUILDING.release()
    return bool(_STATE.get("library", False))


def _settle(start: bool, wait: bool = False) -> bool | None:
    """True once the library is loaded, False where it will not be (turned off, no AVX2, a failed build), None while
    it is yet to be built. start: start a builder process (kernel_cache.spawn_build) where none runs; wait: wait for
    this process's own builder, never for another's."""
    level = isa_level()
    if os.environ.get(DISABLE_VARIABLE) == "0" or level is None:
        return False
    cache = build_directory()
    library = kernel_cache.verified_library(cache)
    if library is not None:
        return _open(library)
    builder = _STATE.get("builder")
    if builder is None or builder.poll() == kernel_cache.BUSY:  # none of this process's, or it found another's
        if not start:
            return None
        try:
            if kernel_cache.busy(cache):
                return None
            log.info("building gptkit's CPU kernels for %s (once per machine and version, about a minute)", level[0])
            sources = [SOURCE_DIR / name for name in SOURCES]
            _STATE["builder"] = builder = kernel_cache.spawn_build(cache, cache.name, sources, BUILD_FLAGS + level[1])
        except OSError as err:
            log.warning("gptkit's CPU kernels did not build, so decoding uses PyTorch's slower products: %s", err)
            return False
    if wait:
        builder.wait()
    if builder.poll() is None or builder.returncode == kernel_cache.BUSY:
        return None
    library = kernel_cache.verified_library(cache)
    if builder.returncode != 0 or library is None:
        log.warning(
            "gptkit's CPU kernels did not build, so decoding uses PyTorch's slower products: %s",
            kernel_cache.build_error(cache),
        )
        return False
    return _open(library)


def _open(library: Path) -> bool:
    """Load a library that matched its manifest (a fraction of a second)."""
    try:
        _load_library(library)
    except (OSError, RuntimeError) as err:
        log.warning(
            "gptkit's CPU kernel library %s does not load, so decoding uses PyTorch's slower products (delete "
            "%s to build it again): %s",
            library,
            library.parent,
            err,
        )
        return False
    _register_shape_functions()
    return True


def _load_library(library: Path) -> None:
    torch.ops.load_library(str(library))


def _build_in_background() -> None:
    """Await the library in a daemon thread (starting a builder process where none runs), then measure the choices:
    once per process."""
    with _STARTING:
        if "background" not in _STATE:
            _STATE["background"] = _start_native_thread(_settle_in_background, "gptkit-kernels", BUILD_EXIT_WAIT_S)
            atexit.register(_EXITING.set)  # runs before the thread's join: one awaiting another's build stops looking


def _settle_in_background() -> None:
    while True:
        with _BUILDING:
            if "library" not in _STATE:
                settled = _settle(start=True)
                if settled is not None:
                    _STATE["library"] = settled
            if "library" in _STATE:
                if "choices" not in _STATE:
                    _STATE["choices"] = _decide()
                return
        if _EXITING.wait(POLL_S):
            return


def building() -> bool:
    """Whether the library is being built, awaited or measured in the background now (decoding takes PyTorch's
    products meanwhile)."""
    thread = _STATE.get("background")
    return isinstance(thread, threading.Thread) and thread.is_alive()


def isa() -> str:
    """The instruction set the loaded kernels run with here ("none" when they are not loaded)."""
    return ISA_NAMES[int(torch.ops.gptkit.isa())] if load() else "none"


def capability() -> str:
    """One line for benchmarks: the CPU, its vector extensions, and what the kernels chose here."""
    flags = _cpu_flags()
    extensions = [f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return (
        f"{_cpu_name()}; {os.cpu_count()} cores; {' '.join(extensions) or 'no x86 vector extensions'}; "
        f"gptkit kernels: {isa()}; choices: {json.dumps(choices(), sort_keys=True)}"
    )


def build_directory() -> Path:
    """Where the kernels' library is cached: kernel_cache.directory, one directory per instruction set and key (the
    sources, flags, compiler and torch)."""
    level = isa_level()
    name, flags = level if level else ("none", [])
    return kernel_cache.directory(name, [SOURCE_DIR / s for s in SOURCES], BUILD_FLAGS + flags)


@functools.cache
def _source_hash() -> str:
    digest = hashlib.sha256()
    for path in sorted(SOURCE_DIR.iterdir()):
        if path.suffix in (".cpp", ".h"):
            digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()[:10]


@functools.cache
def _register_shape_functions() -> None:
    """Tell torch.compile the ops' output shapes (once per process; a second registration is an error)."""
    torch.library.register_fake("gptkit::gemv")(lambda x, w, bias: x.new_empty(x.size(0), w.size(0)))
    torch.library.register_fake("gptkit::gemv_int8")(lambda x, q, scales, bias: x.new_empty(x.size(0), q.size(0)))
    torch.library.register_fake("gptkit::gemv_q4")(lambda x, q, scales, bias, rows: x.new_empty(x.size(0), rows))
    torch.library.register_fake("gptkit::dequantize_q4")(
        lambda q, scales, rows, dtype: q.new_empty(rows, q.size(1) * 32, dtype=dtype)
    )


# ----- the measured choices -----


def choices() -> dict[str, bool]:
    """Which products this machine runs faster: {"fp32", "bf16", "int8": the kernel beats PyTorch at one row;
    "bf16_upcast": many-row bf16 products run faster in fp32}. Measured once per machine (eager code only); while
    the library is still to come, or this process measures in the background, nothing is chosen yet."""
    if "choices" not in _STATE and not torch.compiler.is_compiling() and (load(wait=False) or "library" in _STATE):
        if _BUILDING.acquire(blocking=False):
            try:
                if "choices" not in _STATE:
                    _STATE["choices"] = _decide()
            finally:
                _BUILDING.release()
    return _STATE.get("choices", _UNDECIDED)  # type: ignore[return-value]  (read-only: called per product)


def prepare() -> None:
    """Build, load and measure now, in eager code, before a compiled graph needs the answers: waits for this
    process's own build, never for another's (then PyTorch's products until the library is there)."""
    load()
    with _BUILDING:
        if "library" in _STATE and "choices" not in _STATE:
            _STATE["choices"] = _decide()
    thread = _STATE.get("background")
    if "library" in _STATE and isinstance(thread, threading.Thread):
        thread.join()  # past its decisions: it ends at once


def measured(name: str, measure: Callable[[], bool]) -> bool:
    """A choice of another module (the fused decode step) by the same rules: measure() says whether it beats
    PyTorch, timed once per machine and kept in choices.json beside the kernels' own; False while the library is
    not loaded or the kernels' own choices are not made yet."""
    current = choices()
    if name in current:
        return current[name]
    if not _STATE.get("library") or "choices" not in _STATE or torch.compiler.is_compiling():
        return False
    forced = os.environ.get(DISABLE_VARIABLE)
    with _BUILDING:
        chosen = dict(_STATE["choices"])
        if name not in chosen:
            chosen[name] = forced == "1" or (forced != "0" and _record(name, measure))
            _STATE["choices"] = chosen
    return chosen[name]


def _record(name: str, measure: Callable[[], bool]) -> bool:
    """Run measure() and keep its answer in choices.json under this machine's key."""
    path = build_directory() / CHOICES_FILE
    saved = kernel_cache.saved_choices(path)
    entry = saved.setdefault(_machine_key(), {})
    if name not in entry:
        log.info("timing gptkit's %s against PyTorch on this machine (once)", name.replace("_", " "))
        entry[name], busy = kernel_cache.timed_choice(name.replace("_", " "), lambda: bool(measure()))
        if busy:
            entry[TIMED_BUSY] = True
        kernel_cache.keep_choices(path, saved)
    return entry[name]


def _decide() -> dict[str, bool]:
    forced = os.environ.get(DISABLE_VARIABLE)
    upcast = os.environ.get(UPCAST_VARIABLE)
    if forced in ("0", "1") or not load():
        chosen = dict.fromkeys(("fp32", "bf16", "int8"), forced == "1" and load())
        chosen["bf16_upcast"] = upcast == "1" if upcast in ("0", "1") else _faster_in_fp32()
        return chosen
    path = build_directory() / CHOICES_FILE
    key = _machine_key()
    saved = kernel_cache.saved_choices(path)
    if saved.get(key, {}).get(TIMED_BUSY) and kernel_cache.quiet():
        log.info(
            "timing gptkit's CPU kernels again: the kept choices were timed while other programs were busy, "
            "and the machine is quiet now"
        )
        del saved[key]
    if not MEASURED <= saved.get(key, {}).keys():
        log.info("timing gptkit's CPU kernels against PyTorch's products on this machine (once)")
        measured, busy = kernel_cache.timed_choice("its CPU kernels", _measure)
        saved[key] = {**saved.get(key, {}), **measured, **({TIMED_BUSY: True} if busy else {})}
        kernel_cache.keep_choices(path, saved)
    chosen = {name: value for name, value in saved[key].items() if name != TIMED_BUSY}
    if upcast in ("0", "1"):
        chosen["bf16_upcast"] = upcast == "1"
    return chosen


def _machine_key() -> str:
    """What a measurement depends on: the CPU, its core count, torch, the kernels' source and the thread count."""
    return f"{_cpu_name()}|{os.cpu_count()}|{torch.__version__}|{_source_hash()}|{torch.get_num_threads()}"


def faster(ours: Callable[[], object], theirs: Callable[[], object], rounds: int = 5) -> bool:
    """Whether ours runs faster than theirs: the best of a few rounds each, interleaved so that load from other
    processes falls on both alike."""
    best = [float("inf"), float("inf")]
    for round_ in range(rounds + 1):
        for i, fn in enumerate((ours, theirs)):
            start = time.perf_counter()
            fn()
            if round_:  # round 0 warms up
                best[i] = min(best[i], time.perf_counter() - start)
    return best[0] < best[1]


def _weights(dtype: torch.dtype, megabytes: int = 64) -> list[Tensor]:
    """GPT-2-small-shaped matrices (768 -> 2304) filling more memory than a CPU's caches hold."""
    size = torch.tensor([], dtype=dtype).element_size()
    count = max(1, megabytes * (1 << 20) // (2304 * 768 * size))
    return [torch.empty(2304, 768).uniform_(-1, 1).to(dtype) for _ in range(count)]


@torch.no_grad()
def _measure() -> dict[str, bool]:
    """Time one decode row through the kernels and through PyTorch over matrices that do not fit in cache."""
    chosen = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        ws = _weights(dtype)
        x = torch.randn(1, 768).to(dtype)
        chosen[name] = faster(
            lambda: [torch.ops.gptkit.gemv(x, w, None) for w in ws], lambda: [F.linear(x, w) for w in ws]
        )
    qs = [w.to(torch.int8) for w in _weights(torch.int8)]
    scales = torch.ones(2304)
    x = torch.randn(1, 768)
    chosen["int8"] = faster(
        lambda: [torch.ops.gptkit.gemv_int8(x, q, scales, None) for q in qs],
        lambda: [_torch_int8(x, q, scales) for q in qs],
    )
    chosen["bf16_upcast"] = _faster_in_fp32()
    return chosen


def _torch_int8(x: Tensor, q: Tensor, scales: Tensor) -> Tensor:
    """PyTorch's int8 weight-only product as gptkit's Int8Linear runs it without the kernel (bf16 activations)."""
    try:
        return torch._weight_int8pack_mm(x.bfloat16(), q, scales.bfloat16())
    except (RuntimeError, NotImplementedError, AttributeError):
        return F.linear(x, q.float()) * scales


@torch.no_grad()
def _faster_in_fp32() -> bool:
    """Whether a 128-row bf16 product runs faster converted to fp32 (the weight's conversion timed too)."""
    if os.environ.get(UPCAST_VARIABLE) in ("0", "1"):
        return os.environ[UPCAST_VARIABLE] == "1"
    x = torch.randn(BF16_UPCAST_MIN_ROWS, 768).bfloat16()
    w = torch.randn(3072, 768).bfloat16()
    return faster(lambda: F.linear(x.float(), w.float()).bfloat16(), lambda: F.linear(x, w), rounds=3)


# ----- the products -----


def _cpu_inference_rows(x: Tensor) -> int:
    """The rows of x (all dimensions but the last) if x is on a CPU with autograd off; else 0."""
    if x.device.type != "cpu" or torch.is_grad_enabled() or not x.numel():
        return 0
    return x.numel() // x.size(-1)


_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16"}


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """F.linear; for fp32 and bf16 inference on a CPU, by the GEMV kernel (few rows) where it is the faster, and
    bf16 over many rows in fp32 where that is the faster."""
    rows = _cpu_inference_rows(x)
    if not rows:
        return F.linear(x, weight, bias)
    name = _DTYPE_NAMES.get(weight.dtype)
    same = name is not None and x.dtype == weight.dtype and (bias is None or bias.dtype == weight.dtype)
    if same and rows <= GEMV_MAX_ROWS and weight.is_contiguous() and choices().get(name, False):
        y = torch.ops.gptkit.gemv(x.reshape(rows, x.size(-1)).contiguous(), weight, bias)
        return y.view(*x.shape[:-1], weight.size(0))
    if same and name == "bf16" and rows >= BF16_UPCAST_MIN_ROWS and choices().get("bf16_upcast", False):
        return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(torch.bfloat16)
    return F.linear(x, weight, bias)


def int8_linear(x: Tensor, q: Tensor, scales: Tensor, bias: Tensor | None = None) -> Tensor | None:
    """(x @ q^T) * scales (+ bias) in x's dtype by the int8 GEMV kernel, or None where it does not apply."""
    rows = _cpu_inference_rows(x)
    if (
        not 1 <= rows <= GEMV_MAX_ROWS
        or not q.is_contiguous()
        or (torch.compiler.is_compiling() and rows < COMPILED_INT8_MIN_ROWS)
        or not choices().get("int8", False)
    ):
        return None
    x2 = x.reshape(rows, x.size(-1)).float().contiguous()
    y = torch.ops.gptkit.gemv_int8(x2, q, scales.float().contiguous(), bias)
    return y.to(x.dtype).view(*x.shape[:-1], q.size(0))


def q4_linear(x: Tensor, q: Tensor, scales: Tensor, bias: Tensor | None, out_features: int) -> Tensor | None:
    """The q4 product (csrc/kernels.h: q and scales in groups of 8 rows, activations rounded to int8 per block of
    32) in x's dtype, or None where it does not apply (autograd, another device, more than GEMV_MAX_ROWS rows, the
    library not loaded): there is no PyTorch product to measure it against, so it runs wherever it can."""
    rows = _cpu_inference_rows(x)
    if not 1 <= rows <= GEMV_MAX_ROWS or not (_STATE.get("library") or load(wait=False)):
        return None
    x2 = x.reshape(rows, x.size(-1)).float().contiguous()
    y = torch.ops.gptkit.gemv_q4(x2, q, scales, bias, out_features)
    return y.to(x.dtype).view(*x.shape[:-1], out_features)


def dequantize_q4(q: Tensor, scales: Tensor, rows: int, dtype: torch.dtype) -> Tensor | None:
    """Grouped q4 blocks (q4_linear's q and scales) as the float (rows, K) weight in dtype (fp32 or bf16) in one
    native pass, the values PyTorch's ops give; None where the library is not loaded or q is not on a CPU."""
    if q.device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return None
    if not (_STATE.get("library") or load(wait=False)):
        return None
    return torch.ops.gptkit.dequantize_q4(q, scales, rows, dtype)


def back_with_huge_pages(tensors: list[Tensor]) -> None:
    """Ask Linux to back the tensors' memory with 2 MiB pages (csrc/gemv.cpp's huge_pages says why: weights stream
    about 15% faster), in a daemon thread: moving a model's pages takes about a second per GB, and decoding goes
    on meanwhile (the call releases the GIL). A no-op without the library, or where the system refuses."""
    if _STATE.get("library"):
        _start_native_thread(lambda: torch.ops.gptkit.huge_pages(tensors), "gptkit-huge-pages", HUGE_PAGES_EXIT_WAIT_S)


def _start_native_thread(work: Callable[[], object], name: str, exit_wait_s: float) -> threading.Thread:
    """Run work in a daemon thread that the process waits for at exit, up to exit_wait_s: native code still
    running while the interpreter tears down can abort the process ("terminate called without an active
    exception"); the bound keeps a slow build from holding the exit for long."""
    thread = threading.Thread(target=work, name=name, daemon=True)
    thread.start()
    atexit.register(thread.join, exit_wait_s)
    return thread
