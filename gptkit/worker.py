"""A child Python process that runs user code (a chat template, a reward function) where it can be stopped for real.

Code that never returns cannot be stopped in a thread: it keeps a core and the interpreter's lock busy for good,
and a signal handler waits for it. A process can be killed. Its parent writes one request and reads one answer,
each a JSON line over the child's pipes (nothing pickled), with a deadline for the whole exchange; past it, or when
the child dies, the parent learns it at once (TimeoutError, EOFError) and kills what is left.

The child leads a process group of its own (a new session), and every kill ends the whole group: user code that
starts processes of its own (a reward that forks a helper) leaves none behind when its call times out, when the
worker is closed, or when the parent dies. A process that starts a session of its own again is beyond reach.

Both sides live here: LineWorker is the parent's end; child_pipes(), exit_with_parent() and send_line() the child's.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, BinaryIO

CHUNK = 1 << 16  # bytes written to or read from a pipe at a time
# Where children start: `python -c` puts its working directory first on the path, and the parent's own (a directory
# holding, say, a json.py) must not shadow what the child imports; from here it imports this very gptkit.
PACKAGE_ROOT = Path(__file__).resolve().parents[1]
PARENT_POLL_S = 0.5  # how often a child checks that its parent still lives


class Interrupted(Exception):
    """A SIGINT or SIGTERM came while the parent waited on its child (the signal's own handler has run)."""


class LineWorker:
    """One child process (started with `command` in `cwd`) and the pipes its requests and answers travel on."""

    def __init__(self, command: Sequence[str], cwd: Path, show_errors: bool = False) -> None:
        self.process = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            bufsize=0,
            cwd=cwd,
            stderr=None if show_errors else subprocess.DEVNULL,
            start_new_session=True,
        )
        self.requests, self.answers = self.process.stdin, self.process.stdout
        os.set_blocking(self.requests.fileno(), False)  # a child that stops reading must not block the parent

    def ask(self, request: dict[str, Any] | None, deadline: float) -> dict[str, Any]:
        """Send request (None: send nothing) and read one answer line, all by deadline (time.monotonic());
        TimeoutError past it, EOFError or BrokenPipeError if the process died, ValueError if it wrote no JSON."""
        pending = memoryview(json.dumps(request).encode() + b"\n" if request is not None else b"")
        answer, read_fd, write_fd = bytearray(), self.answers.fileno(), self.requests.fileno()
        with selectors.DefaultSelector() as selector:
            selector.register(read_fd, selectors.EVENT_READ)
            if pending:
                selector.register(write_fd, selectors.EVENT_WRITE)
            while not answer.endswith(b"\n"):
                ready = selector.select(max(deadline - time.monotonic(), 0))
                if not ready:
                    raise TimeoutError
                for key, _ in ready:
                    if key.fd == write_fd:
                        pending = pending[os.write(write_fd, pending[:CHUNK]) :]
                        if not pending:
                            selector.unregister(write_fd)
                        continue
                    chunk = os.read(read_fd, CHUNK)
                    if not chunk:
                        raise EOFError
                    answer += chunk
        return json.loads(answer)

    def kill(self) -> None:
        """End the process and every process it started now (it may be deep in code that would never read another
        request), and reap it."""
        kill_group(self.process.pid)
        self.process.wait()
        self.requests.close()
        self.answers.close()

    def ended(self, wait_s: float = 1.0) -> str:
        """How a process whose pipe closed ended ("exit code 3", "killed by SIGKILL"), once it is reaped; killed
        first if it is still alive after wait_s (it closed its pipes but lingers)."""
        try:
            self.process.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            pass
        self.kill()
        code = self.process.returncode
        if code >= 0:
            return f"exit code {code}"
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"


def kill_group(leader: int) -> None:
    """SIGKILL the process group that process `leader` leads (it and what it started), if any of it is left."""
    try:
        os.killpg(leader, signal.SIGKILL)
    except ProcessLookupError:  # the whole group has ended already
        pass


@contextlib.contextmanager
def signals_end_waits() -> Iterator[None]:
    """Within the block, a SIGINT or SIGTERM still runs its handler (the trainer's notes the stop request), then
    ends the wait at once with Interrupted: the parent is never held by the child's code. Only the main thread gets
    signals; elsewhere, and for a signal without a Python handler, nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    handled = {sig: old for sig, old in previous.items() if callable(old)}

    def handler(signum: int, frame: Any) -> None:
        handled[signum](signum, frame)  # may raise itself (a second Ctrl-C's KeyboardInterrupt)
        raise Interrupted(signal.Signals(signum).name)

    for sig in handled:
        signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, old in handled.items():
            signal.signal(sig, old)


def child_pipes() -> tuple[BinaryIO, BinaryIO]:
    """In the child: (requests, answers), the pipes to the parent, moved off file descriptors 0 and 1 so that user
    code that reads stdin or prints cannot take a request or break an answer line (it reads nothing, and what it
    prints goes to stderr)."""
    requests, answers = os.fdopen(os.dup(0), "rb"), os.fdopen(os.dup(1), "wb")
    nothing = os.open(os.devnull, os.O_RDONLY)
    os.dup2(nothing, 0)
    os.close(nothing)
    sys.stdout.flush()
    os.dup2(2, 1)
    sys.stdout.reconfigure(line_buffering=True)  # (now a pipe's or a file's): each printed line shows as it comes
    return requests, answers


def exit_with_parent() -> None:
    """In the child: end this process, and the processes it started (its group, where it leads one), when its
    parent is gone (killed with SIGKILL, say), even while user code runs; a daemon thread polls, so a child stuck in
    a loop does not outlive the run that started it."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        if os.getpgrp() == os.getpid():  # LineWorker's children lead their group: it ends with them
            kill_group(os.getpid())
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def send_line(pipe: BinaryIO, message: dict[str, Any]) -> None:
    """In the child: write one answer as a JSON line and flush it."""
    pipe.write(json.dumps(message).encode() + b"\n")
    pipe.flush()
