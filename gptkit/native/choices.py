"""The timed choices: whether each of gptkit's products (fp32, bf16, int8 weights at one row; fp32 over a prefill
chunk's rows) beats PyTorch's here, whether many-row bf16 runs faster in fp32, and other modules' choices (the fused
decode step), each timed once per machine and kept in choices.json beside the built library. A CPU flag says what
can run, never what is faster.

A choice timed while other programs kept more than a quarter of a core busy is kept all the same, marked so, with a
log line (contention.timed_choice): a busy machine does not time it again at every start, and the first process
that starts on a quiet machine times it again, once; delete choices.json to measure again."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from gptkit.native import BF16_UPCAST_MIN_ROWS, build, cache, contention
from gptkit.native.cpu import cpu_name

log = logging.getLogger("gptkit.native")

UPCAST_VARIABLE = "GPTKIT_BF16_UPCAST"  # 1 or 0: many-row bf16 products in fp32 or not, without measuring
CHOICES_FILE = "choices.json"
MEASURED = {"fp32", "bf16", "int8", "bf16_upcast", "fp32_rows"}  # _measure's; choices.json entries may hold more
# An entry's mark that one of its choices was timed while other programs were busy: kept, so that a busy machine
# does not time it again at every start, and timed again by the first process that finds the machine quiet.
TIMED_BUSY = "timed_while_busy"
PREFILL_ROWS = 64  # rows of the many-row fp32 product's timing: a prefill chunk (decoding.step.PREFILL_CHUNK)


def record(name: str, measure: Callable[[], bool]) -> bool:
    """Run measure() and keep its answer in choices.json under this machine's key (an answer kept there before is
    returned without measuring)."""
    path = build.build_directory() / CHOICES_FILE
    saved = cache.saved_choices(path)
    entry = saved.setdefault(machine_key(), {})
    if name not in entry:
        log.info("timing gptkit's %s against PyTorch on this machine (once)", name.replace("_", " "))
        entry[name], busy = contention.timed_choice(name.replace("_", " "), lambda: bool(measure()))
        if busy:
            entry[TIMED_BUSY] = True
        cache.keep_choices(path, saved)
    return entry[name]


def decide(loaded: bool) -> dict[str, bool]:
    """The kernels' own choices (MEASURED): forced by the environment, kept in choices.json, or timed now; all False
    where the library is not loaded."""
    forced = os.environ.get(build.DISABLE_VARIABLE)
    upcast = os.environ.get(UPCAST_VARIABLE)
    if forced in ("0", "1") or not loaded:
        chosen = dict.fromkeys(("fp32", "bf16", "int8", "fp32_rows"), forced == "1" and loaded)
        chosen["bf16_upcast"] = upcast == "1" if upcast in ("0", "1") else _faster_in_fp32()
        return chosen
    path = build.build_directory() / CHOICES_FILE
    key = machine_key()
    saved = cache.saved_choices(path)
    if saved.get(key, {}).get(TIMED_BUSY) and contention.quiet():
        log.info(
            "timing gptkit's CPU kernels again: the kept choices were timed while other programs were busy, "
            "and the machine is quiet now"
        )
        del saved[key]
    if not MEASURED <= saved.get(key, {}).keys():
        log.info("timing gptkit's CPU kernels against PyTorch's products on this machine (once)")
        measured, busy = contention.timed_choice("its CPU kernels", _measure)
        saved[key] = {**saved.get(key, {}), **measured, **({TIMED_BUSY: True} if busy else {})}
        cache.keep_choices(path, saved)
    chosen = {name: value for name, value in saved[key].items() if name != TIMED_BUSY}
    if upcast in ("0", "1"):
        chosen["bf16_upcast"] = upcast == "1"
    return chosen


def machine_key() -> str:
    """What a measurement depends on: the CPU, its core count, torch, the kernels' source and the thread count."""
    return f"{cpu_name()}|{os.cpu_count()}|{torch.__version__}|{build.source_hash()}|{torch.get_num_threads()}"


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
    """Time one decode row (and a prefill chunk's rows in fp32) through the kernels and through PyTorch over
    matrices that do not fit in cache."""
    chosen = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        ws = _weights(dtype)
        x = torch.randn(1, 768).to(dtype)
        chosen[name] = faster(
            lambda: [torch.ops.gptkit.gemv(x, w, None) for w in ws], lambda: [F.linear(x, w) for w in ws]
        )
        if dtype == torch.float32:  # the same matrices under a prefill chunk's rows
            rows = torch.randn(PREFILL_ROWS, 768)
            chosen["fp32_rows"] = faster(
                lambda: [torch.ops.gptkit.gemm(rows, w, None) for w in ws],
                lambda: [F.linear(rows, w) for w in ws],
                rounds=3,
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
