"""What Ctrl-C (SIGINT) and SIGTERM do to a training run: the first is answered at once and stops the run with a
checkpoint (an evaluation in progress is cut short), a second SIGINT aborts without one."""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

logger = logging.getLogger(__name__)


class EvaluationStopped(BaseException):
    """Raised in the main thread by the first SIGINT or SIGTERM during an evaluation: the evaluation ends there.

    A BaseException, as KeyboardInterrupt is, so that no `except Exception` on the way swallows it."""


@contextlib.contextmanager
def stop_on_signals(
    announce: Callable[[str], None] = logger.warning, cut_short: Callable[[], bool] = lambda: False
) -> Iterator[threading.Event]:
    """An event set by the first SIGINT or SIGTERM (the loop then checkpoints and returns); a second SIGINT aborts.

    The first signal is announced at once; while cut_short() is true (an evaluation is running) it also raises
    EvaluationStopped, so that the evaluation stops where it is instead of running to its end."""
    requested = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield requested
        return

    def handler(signum: int, frame: Any) -> None:
        if requested.is_set() and signum == signal.SIGINT:
            raise KeyboardInterrupt
        requested.set()
        cut = cut_short()
        announce(
            ("stopping now: this evaluation is cut short" if cut else "stopping after this step")
            + "; a checkpoint is written (Ctrl-C again to abort without saving)"
        )
        if cut:
            raise EvaluationStopped

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield requested
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
