"""benchmarks/bench_restart.py --smoke: a restarted server on the cold one's --cache-dir answers every prompt as the
cold server did, bit for bit, from blocks it read from disk (times are never asserted). Slow (two server processes,
about 18 s): tests/decoding/test_prefix_cache.py's restart test keeps the behaviour in the default suite."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_restarted_server_reads_every_block_from_disk_and_answers_the_same() -> None:
    command = [sys.executable, str(ROOT / "benchmarks" / "bench_restart.py"), "--smoke", "--json", "--threads", "1"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = json.loads(result.stdout)
    (only,) = out["rounds"]
    # The smoke prompts are 150 and 300 corpus characters (a byte tokenizer: a token each); a lookup uses the whole
    # 64-token blocks before a prompt's last token: 2 + 4 of them.
    assert [p["prompt_tokens"] for p in only["prompts"]] == [150, 300]
    assert out["expected_hit_tokens"] == only["hit_tokens"] == 6 * 64
    assert only["disk_reads"] == 6  # the restarted server started with nothing in RAM
    assert only["namespaces"] == 1  # both servers named their blocks alike
    assert only["files_written"] == only["blocks_in_ram"] == 6  # every block the cold server kept reached the disk
    assert all(p["same_disk"] and p["same_ram"] for p in only["prompts"])
