"""Building and opening gptkit's CPU kernel library: its sources and flags, where its build is cached (native/cache.py
keeps the files), starting a builder process, and loading a built library into torch.ops.gptkit."""

from __future__ import annotations

import functools
import hashlib
import logging
import subprocess
from pathlib import Path

import torch

from gptkit.native import cache
from gptkit.native.cpu import isa_level

log = logging.getLogger("gptkit.native")

SOURCE_DIR = Path(__file__).parent.parent / "csrc"
SOURCES = ("gemv.cpp", "step.cpp")  # and the headers they include (kernels.h: simd.h, quant.h, products.h; ...)
BUILD_FLAGS = ["-O3", "-fopenmp"]
DISABLE_VARIABLE = "GPTKIT_CPU_KERNELS"  # 0: PyTorch's products only; 1: the kernels without measuring


def build_directory() -> Path:
    """Where the kernels' library is cached: cache.directory, one directory per instruction set and key (the
    sources, flags, compiler and torch)."""
    level = isa_level()
    name, flags = level if level else ("none", [])
    return cache.directory(name, [SOURCE_DIR / s for s in SOURCES], BUILD_FLAGS + flags)


@functools.cache
def source_hash() -> str:
    """A short hash of the C++ sources (a timed choice holds for these sources only)."""
    digest = hashlib.sha256()
    for path in sorted(SOURCE_DIR.iterdir()):
        if path.suffix in (".cpp", ".h"):
            digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()[:10]


def start_build(directory: Path, level: tuple[str, list[str]]) -> subprocess.Popen:
    """Start a builder process for this instruction set (cache.spawn_build); raises OSError where it cannot start."""
    log.info("building gptkit's CPU kernels for %s (once per machine and version, about a minute)", level[0])
    sources = [SOURCE_DIR / name for name in SOURCES]
    return cache.spawn_build(directory, directory.name, sources, BUILD_FLAGS + level[1])


def open_library(library: Path) -> bool:
    """Load a library that matched its manifest (a fraction of a second); False, with a warning, where it fails."""
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


@functools.cache
def _register_shape_functions() -> None:
    """Tell torch.compile the ops' output shapes (once per process; a second registration is an error)."""
    torch.library.register_fake("gptkit::gemv")(lambda x, w, bias: x.new_empty(x.size(0), w.size(0)))
    torch.library.register_fake("gptkit::gemm")(lambda x, w, bias: x.new_empty(x.size(0), w.size(0)))
    torch.library.register_fake("gptkit::gemv_int8")(lambda x, q, scales, bias: x.new_empty(x.size(0), q.size(0)))
    torch.library.register_fake("gptkit::gemv_q4")(lambda x, q, scales, bias, rows: x.new_empty(x.size(0), rows))
    torch.library.register_fake("gptkit::dequantize_q4")(
        lambda q, scales, rows, dtype: q.new_empty(rows, q.size(1) * 32, dtype=dtype)
    )
