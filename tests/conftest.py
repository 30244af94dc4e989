"""Shared fixtures: tiny configurations of every architecture variant in docs/spec.md section 1."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from gptkit.config import ModelConfig
from gptkit.native import contention, library

TINY = dict(vocab_size=50, block_size=16, n_layer=2, n_head=4, n_embd=32)

# One entry per variant worth telling apart; together they cover every value of every enum field.
VARIANTS: dict[str, dict] = {
    "gpt2": dict(TINY),
    "llama-gqa": dict(
        TINY,
        norm="rmsnorm",
        position="rope",
        activation="swiglu",
        n_kv_head=2,
        attn_bias=False,
        mlp_bias=False,
        norm_bias=False,
        tie_embeddings=False,
    ),
    "original-decoder": dict(TINY, norm_position="post", position="sinusoidal", activation="relu"),
    "gpt1-style": dict(TINY, norm_position="post", position="learned", activation="gelu"),
    "mqa-no-position": dict(TINY, n_kv_head=1, position="none"),
    "nanogpt-no-bias": dict(TINY, attn_bias=False, mlp_bias=False, norm_bias=False, activation="gelu"),
    "untied-head-bias": dict(TINY, tie_embeddings=False, lm_head_bias=True, ffn_hidden=40),
    "rmsnorm-post-rope": dict(TINY, norm="rmsnorm", norm_position="post", position="rope", rope_theta=500.0),
}


# The models here are tiny: one thread beats two (no thread hand-offs per small op), and the subprocesses the
# tests start inherit the setting through the environment.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)
# A first decode builds gptkit's CPU kernels in the background and takes them once built: the tests take them built
# (or ruled out) from the start, so that no test sees the switch between two of its calls.
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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "device" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.device)


@pytest.fixture(scope="session")
def device(request) -> torch.device:
    """The device of --device: the CPU by default, so that CI runs every such test; a GPU when asked for."""
    return torch.device(request.config.getoption("--device"))


def same_run(device: torch.device) -> dict[str, float]:
    """assert_close tolerances for two runs of one computation: bit for bit on the CPU; on a GPU, whose attention
    backward adds its partial sums in no fixed order, within float32 rounding."""
    return dict(atol=0.0, rtol=0.0) if device.type == "cpu" else dict(atol=1e-6, rtol=1e-5)


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


def write_char_data_dir(path: Path, characters: int) -> Path:
    """A char-level data directory (90/10 split) from the first `characters` characters of the bundled corpus."""
    from gptkit.tokenizer import CharTokenizer

    text = (Path(__file__).resolve().parents[1] / "gptkit" / "corpora" / "tinyshakespeare.txt").read_text()
    text = text[:characters]
    tokenizer = CharTokenizer.train([text])
    ids = np.asarray(tokenizer.encode(text), dtype=np.uint16)
    split = int(0.9 * len(ids))
    ids[:split].tofile(path / "train.bin")
    ids[split:].tofile(path / "val.bin")
    tokenizer.save(path)
    meta = {
        "vocab_size": tokenizer.vocab_size,
        "dtype": "uint16",
        "train_tokens": split,
        "val_tokens": len(ids) - split,
        "tokenizer": "char",
    }
    (path / "meta.json").write_text(json.dumps(meta))
    return path
