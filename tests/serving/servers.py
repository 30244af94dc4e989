"""Helpers (no tests here): a tiny model directory, and a live server on a free loopback port (in a thread of the
test process, or as a `gptkit serve` child process)."""

from __future__ import annotations

import socket
import string
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import httpx
import torch
import uvicorn

from gptkit.config import ModelConfig
from gptkit.formats.modeldir import save_model_dir
from gptkit.model import GPT
from gptkit.serving.server import ServeOptions, uvicorn_config
from gptkit.tokenizer import EOT, CharTokenizer

ALPHABET = string.ascii_letters + string.digits + " .,:!?'\n"


def make_model_dir(path: Path, block_size: int = 96) -> Path:
    """A random 2-layer model with a char tokenizer; weights wide enough that greedy picks are clear-cut."""
    tokenizer = CharTokenizer.train([ALPHABET], specials=[EOT])
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=tokenizer.vocab_size, block_size=block_size, n_layer=2, n_head=4, n_embd=32))
    with torch.no_grad():  # std 0.5 keeps the top-2 logit gap far above float rounding, so batching can't flip it
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.5)
    return save_model_dir(model, path, tokenizer=tokenizer)


@contextmanager
def live_server(app, options: ServeOptions | None = None) -> Iterator[str]:
    """Run app on uvicorn as `gptkit serve` configures it (options: its defaults), in a thread, bound to
    127.0.0.1 on a free port; yield its base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn_config(app, options or ServeOptions(), log_level="warning"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model runs fastest on one thread, and a busy machine hurts OpenMP's barriers
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
        torch.set_num_threads(threads)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serve_process(model_dir: Path, flags: list[str], seconds: float = 120) -> Iterator[str]:
    """`gptkit serve model_dir *flags` as a child process on a free loopback port; yield its base URL once /health
    answers, and kill it on the way out. For a test whose failure could leave the server stuck in a system call:
    a thread of the test process could not be stopped, a child process can."""
    port = free_port()
    command = [sys.executable, "-m", "gptkit", "serve", str(model_dir), "--port", str(port), *flags]
    with tempfile.TemporaryFile("w+") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, text=True)
        try:
            url = f"http://127.0.0.1:{port}"
            _wait_for_health(process, url, seconds, log)
            yield url
        finally:
            process.kill()
            process.wait(timeout=30)


def _wait_for_health(process: subprocess.Popen, url: str, seconds: float, log) -> None:
    """Return once url/health answers 200; raise with the server's output when it exits or seconds pass first."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass  # not listening yet
        time.sleep(0.1)
    log.seek(0)
    raise RuntimeError(f"gptkit serve did not come up within {seconds:.0f} s: {log.read()[-2000:]}")
