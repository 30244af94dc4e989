"""gptkit.serving.threads: the decode step runs on the cores other programs leave free; `gptkit serve` says in one
line where it is ready."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch

from gptkit.config import ModelConfig
from gptkit.decoding.request import Request
from gptkit.decoding.sampling import SamplingParams
from gptkit.formats.modeldir import save_model_dir
from gptkit.model import GPT
from gptkit.native import contention
from gptkit.serving import threads
from gptkit.serving.engine import Engine
from gptkit.serving.threads import ThreadGovernor
from gptkit.tokenizer import ByteTokenizer


@pytest.fixture
def machine(monkeypatch, tmp_path):
    """A 2-core machine read from a /proc/stat written here, on a fake clock: busy(cores) lets CHECK_S pass with
    other programs using that many cores (this process uses none), clock() reads the clock."""
    stat, clock, ticks = tmp_path / "stat", [0.0], [0, 0]  # busy and all ticks, 100 a second per core

    def write() -> None:
        stat.write_text(f"cpu  {ticks[0]} 0 0 {ticks[1] - ticks[0]} 0 0 0 0 0 0\n")

    def busy(cores: float) -> None:
        clock[0] += threads.CHECK_S
        ticks[0] += int(100 * cores * threads.CHECK_S)
        ticks[1] += int(200 * threads.CHECK_S)
        write()

    write()
    monkeypatch.setattr(contention, "PROC_STAT", stat)
    monkeypatch.setattr(threads.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(threads.os, "times", lambda: os.times_result((0.0, 0.0, 0.0, 0.0, 0.0)))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield SimpleNamespace(busy=busy, clock=lambda: clock[0])
    torch.set_num_threads(before)


def test_the_decode_threads_follow_the_cores_other_programs_leave_free(machine):
    governor = ThreadGovernor(most=2, clock=machine.clock)
    assert governor.adjust() == 2 and torch.get_num_threads() == 2  # no second has passed: nothing read yet
    machine.busy(cores=1.0)  # another program spins on a core: one thread never waits at a barrier for a second
    assert governor.adjust() == 1 and torch.get_num_threads() == 1
    machine.busy(cores=2.0)  # the machine is full: still one thread, never none
    assert governor.adjust() == 1
    machine.busy(cores=0.1)  # a monitor's blip leaves both cores free
    assert governor.adjust() == 2 and torch.get_num_threads() == 2
    capped = ThreadGovernor(most=1, clock=machine.clock)
    machine.busy(cores=0.0)
    assert capped.adjust() == 1  # never past the count the server started with


def test_at_start_the_count_follows_the_load_at_once(machine, monkeypatch):
    # Before the model loads, so that the kernels' choices are timed at the count decoding will use.
    monkeypatch.setattr(contention, "others_busy", lambda window=contention.QUIET_WINDOW_S: 1.5)
    assert ThreadGovernor(most=2, clock=machine.clock).settle() == 1 and torch.get_num_threads() == 1
    monkeypatch.setattr(contention, "others_busy", lambda window=contention.QUIET_WINDOW_S: 0.0)
    assert ThreadGovernor(most=2, clock=machine.clock).settle() == 2 and torch.get_num_threads() == 2
    monkeypatch.setattr(contention, "others_busy", lambda window=contention.QUIET_WINDOW_S: None)  # not Linux
    assert ThreadGovernor(most=2, clock=machine.clock).settle() == 2


def test_without_proc_stat_the_count_stays(machine, monkeypatch, tmp_path):
    monkeypatch.setattr(contention, "PROC_STAT", tmp_path / "missing")
    governor = ThreadGovernor(most=2, clock=machine.clock)
    machine.busy(cores=2.0)
    assert governor.adjust() == 2 and torch.get_num_threads() == 2


def test_a_window_restarted_when_decoding_resumes_counts_only_load_beside_decoding(machine):
    stale = ThreadGovernor(most=2, clock=machine.clock)
    fresh = ThreadGovernor(most=2, clock=machine.clock)
    machine.busy(cores=2.0)  # while the engine waited, another program used both cores, then stopped
    fresh.resume()
    assert fresh.adjust() == 2  # no second of decoding has passed: nothing read
    assert stale.adjust() == 1  # read over the wait, the other program's turn takes a thread
    machine.busy(cores=0.0)
    assert fresh.adjust() == 2
    fresh.resume()
    machine.busy(cores=1.0)  # load that goes on beside decoding still takes its thread
    assert fresh.adjust() == 1


def test_the_engine_restarts_the_window_only_after_waiting():
    class Recorder:
        def __init__(self) -> None:
            self.calls: list[str] = []

        def resume(self) -> None:
            self.calls.append("resume")

        def adjust(self) -> int:
            self.calls.append("adjust")
            return 1

    tokenizer = ByteTokenizer(specials=())
    config = ModelConfig(vocab_size=tokenizer.vocab_size, block_size=32, n_layer=1, n_head=2, n_embd=16)
    engine = Engine(GPT(config), tokenizer, max_batch_size=2)
    engine.governor = Recorder()
    engine.start()
    try:
        for _ in range(2):  # two requests, the engine idle before each
            done = threading.Event()
            params = SamplingParams(max_new_tokens=6, temperature=0)
            request = Request(tokenizer.encode("ab"), params, tokenizer.eos_ids, tokenizer.decode)
            engine.submit([(request, lambda delta: delta.finish_reason and done.set())])
            assert done.wait(timeout=60)
            time.sleep(0.05)  # the engine goes back to waiting
    finally:
        engine.stop()
    calls = engine.governor.calls
    # every step looks (adjust), and only the first step after each wait starts the window again (resume)
    second = calls.index("resume", 1)
    assert calls[0] == "resume" and calls[second + 1] == "adjust" and calls.count("resume") == 2, calls
    assert calls[1:second].count("adjust") >= 2 and "resume" not in calls[1:second], calls


def test_the_server_logs_one_line_with_its_url_once_it_listens(caplog):
    import asyncio

    import uvicorn
    from fastapi import FastAPI

    from gptkit.serving.server import announcing_server

    server = announcing_server(uvicorn.Config(FastAPI(), host="127.0.0.1", port=0, log_level="warning"))

    async def start_and_stop() -> None:
        serving = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.01)
        server.should_exit = True
        await serving

    with caplog.at_level(logging.INFO, logger="gptkit.serve"):
        asyncio.run(start_and_stop())
    lines = [r.getMessage() for r in caplog.records if r.name == "gptkit.serve"]
    assert len(lines) == 1 and re.fullmatch(
        r"ready at http://127\.0\.0\.1:\d+/ \(the playground; the API under /v1\)", lines[0]
    )
    assert not lines[0].startswith("ready at http://127.0.0.1:0/")  # the port the system gave, not 0


@pytest.mark.slow
def test_serve_says_in_one_line_where_it_is_ready(tmp_path: Path):
    tokenizer = ByteTokenizer(specials=())
    config = ModelConfig(vocab_size=tokenizer.vocab_size, block_size=16, n_layer=1, n_head=2, n_embd=16)
    model_dir = save_model_dir(GPT(config), tmp_path / "model", tokenizer=tokenizer)
    command = [sys.executable, "-m", "gptkit", "serve", str(model_dir), "--port", "0"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    try:
        ready, deadline = None, time.monotonic() + 600  # a busy machine may take long to import torch
        while ready is None and time.monotonic() < deadline:
            line = proc.stderr.readline()
            assert line or proc.poll() is None, "the server ended before it was ready"
            ready = re.fullmatch(
                r"gptkit: ready at (http://127\.0\.0\.1:\d+)/ \(the playground; the API under /v1\)\n", line
            )
        assert ready is not None
        assert httpx.get(ready.group(1) + "/health", timeout=60).status_code == 200  # it takes requests now
    finally:
        proc.terminate()
        proc.wait(timeout=30)
