"""Fixtures and settings for every test; the helpers the tests share are in helpers.py."""

from __future__ import annotations

import os
import time

import pytest
import torch
from helpers import VARIANTS

from gptkit.config import ModelConfig
from gptkit.native import build, cache, contention, library
from gptkit.native.cpu import isa_level

# The models here are tiny: one thread beats two (no thread hand-offs per small op), and the subprocesses the
# tests start inherit the setting through the environment. A worker of a parallel run (make test: pytest-xdist)
# takes one thread whatever the shell set: two workers of several threads each on two cores slow each other
# manyfold. A test that needs threads or processes of its own (DDP, FSDP, thread-count parity) still starts them.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)
# A first decode builds gptkit's CPU kernels in the background and takes them once built: the tests take them built
# (or ruled out) from the start, so that no test sees the switch between two of its calls. A build another process
# runs (a parallel worker of this run, another run) is waited for too: a test collected while the library was
# half-built would skip the kernels' tests as if the CPU had none.
KERNEL_BUILD_WAIT_S = 600.0  # a build takes about a minute on 2 cores; ten beside other work


def _await_another_build() -> None:
    if os.environ.get(build.DISABLE_VARIABLE) == "0" or isa_level() is None:
        return
    deadline = time.monotonic() + KERNEL_BUILD_WAIT_S
    while cache.verified_library(build.build_directory()) is None and cache.busy(build.build_directory()):
        if time.monotonic() > deadline:
            raise pytest.UsageError(
                f"gptkit's CPU kernels were still being built by another process after "
                f"{KERNEL_BUILD_WAIT_S:.0f} s ({build.build_directory()})"
            )
        time.sleep(1.0)


_await_another_build()
library.prepare()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--device",
        default="cpu",
        help="where the tests that take a `device` run: cpu (default), "
        "cuda, cuda:N or mps; `pytest -m device --device cuda` runs only those, on a GPU",
    )


def pytest_configure(config: pytest.Config) -> None:
    name = config.getoption("--device")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise pytest.UsageError(f"--device {name!r} is not a device; use cpu, cuda, cuda:N or mps") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise pytest.UsageError(f"--device {name}: no CUDA device is available here")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise pytest.UsageError(f"--device {name}: MPS is not available here")


# pytest-timeout's limit (pyproject's `timeout`) is for a default test; a slow one may take several minutes of work.
SLOW_TIMEOUT_S = 900


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "device" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.device)
        if item.get_closest_marker("slow") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(SLOW_TIMEOUT_S))


@pytest.fixture(scope="session")
def device(request) -> torch.device:
    """The device of --device: the CPU by default, so that CI runs every such test; a GPU when asked for."""
    return torch.device(request.config.getoption("--device"))


@pytest.fixture(params=list(VARIANTS), ids=list(VARIANTS))
def variant_config(request) -> ModelConfig:
    return ModelConfig(**VARIANTS[request.param])


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _quiet_machine(monkeypatch) -> None:
    """Kernel choices timed inside a test are kept as on a quiet machine: whether other programs share the machine
    running the suite is not what a test checks (test_cpu_kernels checks that rule with its own readings)."""
    monkeypatch.setattr(contention, "others_busy", lambda window=contention.QUIET_WINDOW_S: 0.0)
