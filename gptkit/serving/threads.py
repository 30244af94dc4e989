"""How many threads the model's decode step runs on: as many as the cores other programs leave free.

A decode step of the fused CPU kernel meets at about 75 OpenMP barriers a token. While other programs keep the
cores busy, one of the step's threads is often descheduled, and every barrier waits for it: on a 2-core machine
with a load of 7, two threads took 60 ms for each product that one thread did in 0.1 ms, and serving fell to 1.3
tokens/s, far below the share of the machine it had. One thread never waits for another; it gets its share of a
core and decodes in proportion to it. So ThreadGovernor looks at /proc/stat between decode steps, every CHECK_S
seconds, and sets the engine thread's torch thread count to the cores the other programs left idle since the last
look (at least 1, at most the count the server started with); a look's window starts again when decoding resumes
after the engine sat idle, so that only load beside decoding counts. A thread count changes only the order of a few
sums, not the tokens a seeded request draws beyond float rounding, as any --threads does.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

import torch

from gptkit.native import contention

log = logging.getLogger("gptkit.serve")

CHECK_S = 1.0  # how often the load is looked at: /proc/stat counts 100 ticks a second, so a second is 100 per core
# A core counts as free where other programs used less than this much of it: a shell's or a monitor's blips must
# not take a thread from the model, and a core that is half used makes its thread wait at every barrier.
SPARE = 0.25


class ThreadGovernor:
    """Sets torch's thread count, on the thread that calls adjust(), to the cores others leave free (1 to most)."""

    def __init__(self, most: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.most, self.clock = most, clock
        self.threads = torch.get_num_threads()
        self.last = self._reading()

    def _reading(self) -> tuple[float, tuple[int, int] | None, float]:
        """(when, the machine's busy and all ticks, this process's CPU seconds)."""
        return self.clock(), contention.busy_ticks(), sum(os.times()[:2])

    def settle(self) -> int:
        """Look at the load now (over contention.QUIET_WINDOW_S) and set the thread count it allows: at start,
        before the kernels' choices are timed and kept for that count; return the count in use."""
        others = contention.others_busy()
        if others is not None:
            self._set(others)
        self.last = self._reading()
        return self.threads

    def resume(self) -> None:
        """Start the next look's window now: called when decoding resumes after the engine sat idle. What other
        programs did while it waited did not contend with its decoding, and read at the first step it took a thread
        for a second: served one client at a time beside llama-server, each turn began on one thread ("other
        programs use 1.9 of 2 cores": llama-server's turn just before)."""
        self.last = self._reading()

    def adjust(self) -> int:
        """Look at the load if CHECK_S passed since the last look, set the thread count it allows; return the count
        in use."""
        now, ticks, own = self._reading()
        when, last_ticks, last_own = self.last
        if now - when < CHECK_S:
            return self.threads
        self.last = (now, ticks, own)
        if ticks is None or last_ticks is None:  # no /proc/stat (not Linux): the count the server started with
            return self.threads
        others = contention.others_cores(last_ticks, ticks, (own - last_own) / (now - when), os.cpu_count() or 1)
        if others is not None:
            self._set(others)
        return self.threads

    def _set(self, others: float) -> None:
        """Take as many threads as cores are free of others' use (less than SPARE of each), 1 to most."""
        cores = os.cpu_count() or 1
        wanted = max(1, min(self.most, int(cores - others + SPARE)))
        if wanted != self.threads:
            log.info("other programs use %.1f of %d cores: decoding on %d thread(s)", others, cores, wanted)
            torch.set_num_threads(wanted)
            self.threads = wanted
