"""`benchmarks/bench_serve.py --vllm` (benchmarks/serve_vllm.py) starts, refuses a missing vLLM in one line, and
with vLLM's venv present (`make vllm`) prints its table (timings are never asserted)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH_SERVE = ROOT / "benchmarks" / "bench_serve.py"
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"


def test_a_missing_vllm_python_is_one_line(tmp_path: Path) -> None:
    missing = tmp_path / "no-venv" / "python"
    result = subprocess.run(
        [sys.executable, str(BENCH_SERVE), "--vllm", str(missing)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode != 0
    assert result.stderr.strip() == f"bench_serve: no Python at {missing} (make vllm creates .venv-vllm/bin/python)"


@pytest.mark.slow  # vLLM's server takes a minute or more to start on 2 cores
@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="vLLM is not installed: `make vllm`")
def test_the_vllm_comparison_prints_its_table() -> None:
    command = [sys.executable, str(BENCH_SERVE), "--vllm", str(VLLM_PYTHON), "--only", "1 client"]
    command += ["--requests", "1", "--n-layer", "2", "--n-embd", "64"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "defaults | vLLM (CPU) | gptkit serve | gptkit / vLLM" in result.stdout
    assert "1 client, tokens/s |" in result.stdout
