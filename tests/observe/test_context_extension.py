"""benchmarks/context_extension.py: its flags, the switch of a model to a longer context, its table."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import torch

from gptkit.config import ModelConfig
from gptkit.formats.modeldir import load_model_dir, save_model_dir
from gptkit.model import GPT
from gptkit.weights import model_state

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "context_extension.py"


def script():
    spec = importlib.util.spec_from_file_location("context_extension", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_help_runs():
    result = subprocess.run([sys.executable, str(SCRIPT), "--help"], check=False, capture_output=True, text=True)
    assert result.returncode == 0 and "--tune-steps" in result.stdout, result.stderr


def test_switched_model_keeps_its_weights_at_the_longer_context(tmp_path):
    bench = script()
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=65, block_size=bench.BASE_BLOCK, n_layer=1, n_head=2, n_embd=16, position="rope")
    base = save_model_dir(GPT(config), tmp_path / "base")
    switched = load_model_dir(bench.switched(base, tmp_path / "yarn", bench.YARN))
    assert switched.config.block_size == bench.LONG_BLOCK
    assert switched.config.rope_scaling.to_dict() == bench.YARN
    old = model_state(load_model_dir(base))
    assert all(torch.equal(old[name], tensor) for name, tensor in model_state(switched).items())


def test_table_has_a_column_per_bucket():
    buckets = [{"start": 0, "end": 256, "loss": 1.5}, {"start": 256, "end": 512, "loss": 2.25}]
    text = script().table([{"model": "base", "loss": 1.875, "by_position": buckets}])
    assert text.splitlines()[0] == "| model (evaluated at 1024) | 0-256 | 256-512 | all |"
    assert text.splitlines()[2] == "| base | 1.500 | 2.250 | 1.875 |"
