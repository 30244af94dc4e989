"""How busy other programs keep this machine: /proc/stat read over a short window, for timed choices (a choice timed
under contention is marked so) and for the server's thread count."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

log = logging.getLogger("gptkit.native")
T = TypeVar("T")

# Other programs using more than this many cores while a choice is timed make it a guess under contention, which
# slows the kernels' many-barrier OpenMP regions far more than PyTorch's products (a fused-step choice timed beside
# another job chose the eager step, 1.5x slower at 4 rows on a quiet machine). It is kept all the same, marked as
# timed while busy, with a log line: timing again at every start on a busy machine cost each `gptkit serve` 40 s
# before it was ready, and a busy machine gives no better answer the next time; the first process that finds the
# machine quiet times it again (native/choices.py). Deleting choices.json times everything again.
BUSY_CORES = 0.25
QUIET_WINDOW_S = 0.2  # how long the check watches, this process asleep (/proc/stat counts 100 ticks a second)
PROC_STAT = Path("/proc/stat")


def others_busy(window: float = QUIET_WINDOW_S) -> float | None:
    """Cores' worth of CPU time that other processes used over `window` seconds (from /proc/stat, less this
    process's own); None where /proc/stat cannot be read (not Linux)."""
    start, own_start = busy_ticks(), sum(os.times()[:2])
    time.sleep(window)
    end, own_end = busy_ticks(), sum(os.times()[:2])
    if start is None or end is None:
        return None
    return others_cores(start, end, (own_end - own_start) / window, os.cpu_count() or 1)


def others_cores(start: tuple[int, int], end: tuple[int, int], own_cores: float, cores: int) -> float | None:
    """Cores' worth of CPU that others used between two readings of (busy ticks, all ticks) of a machine with
    `cores` cores, over which this process used own_cores; None where no tick passed."""
    if end[1] == start[1]:
        return None
    busy = (end[0] - start[0]) / (end[1] - start[1]) * cores
    return max(0.0, busy - own_cores)


def busy_ticks() -> tuple[int, int] | None:
    """(busy, all) ticks of every core since boot, from the first line of /proc/stat; None where it cannot be read."""
    try:
        values = [int(v) for v in PROC_STAT.read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return None
    idle = values[3] + values[4]  # idle and waiting for I/O; the rest is busy (guest time is within user)
    return sum(values) - idle, sum(values)


def timed_choice(what: str, measure: Callable[[], T]) -> tuple[T, bool]:
    """measure()'s answer, and whether other programs were busy (BUSY_CORES) just before or after it (then said in
    a log line): the answer is kept all the same (see BUSY_CORES)."""
    before = others_busy()
    answer = measure()
    busy = max(before or 0.0, others_busy() or 0.0)
    if busy > BUSY_CORES:
        log.info(
            "other programs used %.1f cores while gptkit timed %s: the choice is kept all the same, and timed again "
            "when a process starts on a quiet machine",
            busy,
            what,
        )
    return answer, busy > BUSY_CORES


def quiet() -> bool:
    """Whether other programs use at most BUSY_CORES now (True where /proc/stat cannot be read)."""
    return (others_busy() or 0.0) <= BUSY_CORES
