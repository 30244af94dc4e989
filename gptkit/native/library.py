"""Whether gptkit's CPU kernel library is loaded in this process, and what it chose here: load() without ever waiting
for another process's build, a background thread that takes the library once built and times the choices, and the
choices themselves (native/choices.py times them)."""

from __future__ import annotations

import atexit
import json
import logging
import os
import threading
from collections.abc import Callable

import torch

from gptkit.native import build, cache
from gptkit.native import choices as timed
from gptkit.native.cpu import ISA_NAMES, cpu_flags, cpu_name, isa_level

log = logging.getLogger("gptkit.native")

# State decided in eager code only (a compiled graph reads the answers): "library" (bool), "choices" (dict); and
# "background" (the thread that awaits a build and measures) and "builder" (this process's builder process).
STATE: dict[str, object] = {}
_UNDECIDED: dict[str, bool] = {}  # what a compiled graph reads if nothing was decided in eager code before it
# How long a process ending waits for its background work: a build runs in a process of its own (left to finish),
# loading and measuring take a few seconds.
BUILD_EXIT_WAIT_S = 10.0
_BUILDING = threading.RLock()  # a server's first requests may arrive together
_STARTING = threading.Lock()  # starts the background build once
_EXITING = threading.Event()  # set at exit: a background thread awaiting another process's build stops looking
POLL_S = 1.0  # how often a process awaiting another's build looks for the library


def load(wait: bool = True) -> bool:
    """Whether the kernels' library is loaded (eager code only). A library built before is checked and loaded at
    once; else wait=True builds it now and wait=False in a background thread, returning False until it is done.
    Neither waits for a build another process runs: PyTorch's products meanwhile, and a background thread takes the
    library once it is there (looking every POLL_S)."""
    if "library" in STATE or torch.compiler.is_compiling():
        return bool(STATE.get("library", False))
    if (not wait and building()) or not _BUILDING.acquire(blocking=wait):
        return False  # this process builds or measures in the background: never waited for by decoding
    try:
        if "library" not in STATE:
            settled = _settle(start=wait, wait=wait)
            if settled is None:
                _build_in_background()
            else:
                STATE["library"] = settled
    finally:
        _BUILDING.release()
    return bool(STATE.get("library", False))


def _settle(start: bool, wait: bool = False) -> bool | None:
    """True once the library is loaded, False where it will not be (turned off, no AVX2, a failed build), None while
    it is yet to be built. start: start a builder process (cache.spawn_build) where none runs; wait: wait for this
    process's own builder, never for another's."""
    level = isa_level()
    if os.environ.get(build.DISABLE_VARIABLE) == "0" or level is None:
        return False
    directory = build.build_directory()
    library = cache.verified_library(directory)
    if library is not None:
        return build.open_library(library)
    builder = STATE.get("builder")
    if builder is None or builder.poll() == cache.BUSY:  # none of this process's, or it found another's
        if not start:
            return None
        try:
            if cache.busy(directory):
                return None
            STATE["builder"] = builder = build.start_build(directory, level)
        except OSError as err:
            log.warning("gptkit's CPU kernels did not build, so decoding uses PyTorch's slower products: %s", err)
            return False
    if wait:
        builder.wait()
    if builder.poll() is None or builder.returncode == cache.BUSY:
        return None
    library = cache.verified_library(directory)
    if builder.returncode != 0 or library is None:
        log.warning(
            "gptkit's CPU kernels did not build, so decoding uses PyTorch's slower products: %s",
            cache.build_error(directory),
        )
        return False
    return build.open_library(library)


def _build_in_background() -> None:
    """Await the library in a daemon thread (starting a builder process where none runs), then measure the choices:
    once per process."""
    with _STARTING:
        if "background" not in STATE:
            STATE["background"] = start_native_thread(_settle_in_background, "gptkit-kernels", BUILD_EXIT_WAIT_S)
            atexit.register(_EXITING.set)  # runs before the thread's join: one awaiting another's build stops looking


def _settle_in_background() -> None:
    while True:
        with _BUILDING:
            if "library" not in STATE:
                settled = _settle(start=True)
                if settled is not None:
                    STATE["library"] = settled
            if "library" in STATE:
                if "choices" not in STATE:
                    STATE["choices"] = timed.decide(bool(STATE["library"]))
                return
        if _EXITING.wait(POLL_S):
            return


def building() -> bool:
    """Whether the library is being built, awaited or measured in the background now (decoding takes PyTorch's
    products meanwhile)."""
    thread = STATE.get("background")
    return isinstance(thread, threading.Thread) and thread.is_alive()


def isa() -> str:
    """The instruction set the loaded kernels run with here ("none" when they are not loaded)."""
    return ISA_NAMES[int(torch.ops.gptkit.isa())] if load() else "none"


def capability() -> str:
    """One line for benchmarks: the CPU, its vector extensions, and what the kernels chose here."""
    flags = cpu_flags()
    extensions = [f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return (
        f"{cpu_name()}; {os.cpu_count()} cores; {' '.join(extensions) or 'no x86 vector extensions'}; "
        f"gptkit kernels: {isa()}; choices: {json.dumps(choices(), sort_keys=True)}"
    )


def choices() -> dict[str, bool]:
    """Which products this machine runs faster: {"fp32", "bf16", "int8": the kernel beats PyTorch at one row;
    "fp32_rows": the many-row fp32 kernel beats it over a prefill chunk; "bf16_upcast": many-row bf16 products run
    faster in fp32}. Measured once per machine (eager code only); while
    the library is still to come, or this process measures in the background, nothing is chosen yet."""
    if "choices" not in STATE and not torch.compiler.is_compiling() and (load(wait=False) or "library" in STATE):
        if _BUILDING.acquire(blocking=False):
            try:
                if "choices" not in STATE:
                    STATE["choices"] = timed.decide(load())
            finally:
                _BUILDING.release()
    return STATE.get("choices", _UNDECIDED)  # type: ignore[return-value]  (read-only: called per product)


def prepare() -> None:
    """Build, load and measure now, in eager code, before a compiled graph needs the answers: waits for this
    process's own build, never for another's (then PyTorch's products until the library is there)."""
    load()
    with _BUILDING:
        if "library" in STATE and "choices" not in STATE:
            STATE["choices"] = timed.decide(load())
    thread = STATE.get("background")
    if "library" in STATE and isinstance(thread, threading.Thread):
        thread.join()  # past its decisions: it ends at once


def measured(name: str, measure: Callable[[], bool]) -> bool:
    """A choice of another module (the fused decode step) by the same rules: measure() says whether it beats
    PyTorch, timed once per machine and kept in choices.json beside the kernels' own; False while the library is
    not loaded or the kernels' own choices are not made yet."""
    current = choices()
    if name in current:
        return current[name]
    if not STATE.get("library") or "choices" not in STATE or torch.compiler.is_compiling():
        return False
    forced = os.environ.get(build.DISABLE_VARIABLE)
    with _BUILDING:
        chosen = dict(STATE["choices"])
        if name not in chosen:
            chosen[name] = forced == "1" or (forced != "0" and timed.record(name, measure))
            STATE["choices"] = chosen
    return chosen[name]


def start_native_thread(work: Callable[[], object], name: str, exit_wait_s: float) -> threading.Thread:
    """Run work in a daemon thread that the process waits for at exit, up to exit_wait_s: native code still
    running while the interpreter tears down can abort the process ("terminate called without an active
    exception"); the bound keeps a slow build from holding the exit for long."""
    thread = threading.Thread(target=work, name=name, daemon=True)
    thread.start()
    atexit.register(thread.join, exit_wait_s)
    return thread
