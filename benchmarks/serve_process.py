"""Servers under test as child processes: `gptkit serve` on a free loopback port, a free port for others, and the
random model they serve when no model is given.

The serving benchmarks (bench_serve.py, serve_workloads.py, serve_lora.py, bench_lm_eval.py, bench_restart.py)
import from here, so none of them imports another benchmark script back.
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


def build_model_dir(path: Path, n_layer: int, n_embd: int, block_size: int) -> Path:
    """A random GPT-2-style model with a byte tokenizer (its speed, not its text, is what is measured)."""
    import torch

    from gptkit.config import ModelConfig
    from gptkit.formats.modeldir import save_model_dir
    from gptkit.model import GPT
    from gptkit.tokenizer import ByteTokenizer

    tokenizer = ByteTokenizer(specials=())  # no end-of-text token: every request generates max_tokens
    torch.manual_seed(0)
    config = ModelConfig(
        vocab_size=tokenizer.vocab_size,
        block_size=block_size,
        n_layer=n_layer,
        n_head=max(1, n_embd // 64),
        n_embd=n_embd,
    )
    return save_model_dir(GPT(config), path / "bench-model", tokenizer=tokenizer)


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
