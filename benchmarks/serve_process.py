"""Servers under test as child processes: `gptkit serve` on a free loopback port, and a free port for others.

The serving benchmarks (bench_serve.py, serve_workloads.py, serve_lora.py, bench_lm_eval.py) import from here, so
none of them imports another benchmark script back.
"""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(
    model_dir: Path, max_batch_size: int | None, threads: int | None, compile: bool = False, extra: tuple[str, ...] = ()
) -> tuple[subprocess.Popen, str]:
    """`gptkit serve` on 127.0.0.1 with a free port; returns the process and its base URL."""
    extra = (
        (["--threads", str(threads)] if threads else [])
        + (["--compile"] if compile else [])
        + (["--max-batch-size", str(max_batch_size)] if max_batch_size else [])
        + list(extra)
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "gptkit", "serve", str(model_dir), "--port", "0", "--device", "cpu", *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + (900 if compile else 120)  # compiling every batch shape comes before ready
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            break
        match = re.search(r"Uvicorn running on (http://127\.0\.0\.1:\d+)", line)
        if match:
            # Keep reading what the server writes (a line per request): a full pipe would stall it mid-measurement.
            threading.Thread(target=_discard, args=(proc.stdout,), daemon=True).start()
            return proc, match.group(1)
    proc.kill()
    raise SystemExit("bench_serve: the server did not start")


def _discard(stream: IO[str]) -> None:
    """Read a stream to its end, keeping nothing."""
    for _ in stream:
        pass
