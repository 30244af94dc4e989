"""benchmarks/serve_batch_sizes.py (bench_serve.py --max-batch-sizes): its list of sizes, its refusal of a bad one,
and a smoke run serving two settings in turn (timings are never asserted)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCH_SERVE = REPO / "benchmarks" / "bench_serve.py"


def sweep_module():
    """benchmarks/serve_batch_sizes.py as a module (its benchmarks/ neighbours importable, as when a script runs)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        spec = importlib.util.spec_from_file_location("serve_batch_sizes", REPO / "benchmarks" / "serve_batch_sizes.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    return module


def test_the_sizes_are_read_in_order_and_a_bad_one_is_one_line():
    sweep = sweep_module()
    assert sweep.batch_sizes("8,16,32") == [8, 16, 32]
    for bad in ("8,,16", "0,8", "eight"):
        with pytest.raises(SystemExit, match="--max-batch-sizes takes sizes >= 1 separated by commas"):
            sweep.batch_sizes(bad)


def test_a_rows_kv_bytes_are_the_block_size_of_the_model(tmp_path):
    from gptkit.accounting import kv_cache_bytes
    from gptkit.config import ModelConfig
    from gptkit.formats.modeldir import save_model_dir
    from gptkit.model import GPT
    from gptkit.tokenizer import ByteTokenizer

    tokenizer = ByteTokenizer(specials=())
    config = ModelConfig(vocab_size=tokenizer.vocab_size, block_size=48, n_layer=2, n_head=2, n_embd=32)
    model_dir = save_model_dir(GPT(config), tmp_path / "m", tokenizer=tokenizer)
    assert sweep_module().row_bytes(model_dir) == (48, kv_cache_bytes(config, 1, 48, "float32"))


def test_the_table_gives_each_settings_kv_cache_and_rates(capsys):
    result = {"cpu": "a CPU", "model": "random", "block_size": 64, "kv_bytes_per_row": 2**20, "requests_per_client": 1}
    result |= {"max_tokens": 4, "rounds_run": 3, "tokens_per_s": {8: {1: 10.0, 8: 50.0}, 16: {1: 9.5, 8: 61.25}}}
    sweep_module().print_table(result, [1, 8])
    lines = capsys.readouterr().out.splitlines()
    assert "KV cache per batch row at block_size 64: 1.0 MiB (float32); median of 3 round(s)" in lines[1]
    assert lines[3].split() == ["8", "8.0", "10.0", "50.0"] and lines[4].split() == ["16", "16.0", "9.5", "61.2"]


@pytest.mark.slow  # two server starts of a few seconds each
def test_two_batch_sizes_are_served_in_turn():
    command = [sys.executable, str(BENCH_SERVE), "--max-batch-sizes", "1,2", "--concurrency", "1", "2"]
    command += ["--requests", "1", "--max-tokens", "2", "--n-layer", "1", "--n-embd", "32", "--block-size", "32"]
    result = subprocess.run([*command, "--json"], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert set(report["tokens_per_s"]) == {"1", "2"}
    assert all(set(rates) == {"1", "2"} and min(rates.values()) > 0 for rates in report["tokens_per_s"].values())
    assert report["kv_bytes_per_row"] == 2 * 32 * 32 * 4  # keys and values, 1 layer, 32 positions, width 32, fp32
