"""What this CPU is: its instruction-set extensions, its name, and the widest of gptkit's library variants it runs."""

from __future__ import annotations

import functools
import os
import platform
from pathlib import Path

from gptkit.errors import ConfigError

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
ISA_NAMES = {0: "none", 1: "avx2", 2: "avx512", 3: "avx512_vnni", 4: "avx512_bf16"}
ISA_VARIABLE = "GPTKIT_CPU_ISA"  # one of ISA_LEVELS' names: build that variant (the CPU must run it)


@functools.cache
def cpu_flags() -> set[str]:
    """The instruction-set extensions this CPU reports (/proc/cpuinfo's flags; none where that is missing)."""
    # Linux lists the instruction sets in /proc/cpuinfo (PyTorch 2.13 exposes no such probe). Elsewhere nothing is
    # built: macOS on Apple silicon has neither AVX2 nor AVX-512 and the build flags are gcc/clang's.
    try:
        return set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return set()


def cpu_name() -> str:
    """The CPU's model name (from /proc/cpuinfo, else what platform says)."""
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
    flags, wanted = cpu_flags(), os.environ.get(ISA_VARIABLE)
    runs = [(name, build) for name, needed, build in ISA_LEVELS if needed <= flags]
    if wanted and wanted not in [name for name, _, _ in ISA_LEVELS]:
        raise ConfigError(f"{ISA_VARIABLE}={wanted} is not one of {', '.join(name for name, _, _ in ISA_LEVELS)}")
    if wanted:
        runs = [(name, build) for name, build in runs if name == wanted]
    return runs[0] if runs else None
