"""A data-parallel run interrupted and resumed: the hint names the torchrun command, and a resume on another number of
processes keeps the global batch (more accumulation per process) or is refused in one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import write_char_data_dir

from gptkit.checkpoint import LATEST, RNG_FILE, TRAINER_FILE, saved_world
from gptkit.cli.train import resume_command
from gptkit.distributed import resumed_grad_accum
from gptkit.errors import ConfigError
from gptkit.manifest import write_manifest
from gptkit.run_sources import from_sources
from gptkit.tensors import load_tensors, save_tensors
from gptkit.train import train

MODEL = {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 16, "dropout": 0.0}


def settings(data: Path, out: Path, grad_accum: int) -> dict[str, dict]:
    return {
        "model": dict(MODEL),
        "optim": {"warmup_steps": 2, "decay_steps": 6, "lr": 3e-3},
        "train": {
            "data_dir": str(data),
            "out_dir": str(out),
            "max_steps": 6,
            "batch_size": 4,
            "grad_accum": grad_accum,
            "eval_interval": 6,
            "eval_iters": 1,
            "log_interval": 1,
            "checkpoint_interval": 3,
            "device": "cpu",
            "plot": False,
            "observe": False,
            "sample_every": 0,
        },
    }


def losses(run_dir: Path) -> dict[int, float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if "loss" in r}


def test_the_interrupted_hint_is_the_command_that_launched_the_run():
    assert resume_command(Path("runs/ddp"), {}) == "gptkit train --resume --out runs/ddp"
    torchrun = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "RANK": "0"}
    expected = "torchrun --nproc_per_node 2 -m gptkit train --resume --out runs/ddp"
    assert resume_command(Path("runs/ddp"), torchrun) == expected
    nodes = resume_command(Path("runs/big"), {"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"})
    assert nodes.startswith("torchrun --nnodes 2 --nproc_per_node 8 -m gptkit train --resume --out runs/big")


def test_another_process_count_keeps_the_micro_batches_of_an_update():
    assert resumed_grad_accum(2, 1, 1, 1) == 2  # 2 processes x 1 -> 1 process x 2
    assert resumed_grad_accum(1, 4, 2, 4) == 2  # 1 x 4 -> 2 x 2
    assert resumed_grad_accum(2, None, 2, 3) == 3  # the same processes: the run's own setting
    assert resumed_grad_accum(2, 1, 1, 5) == 5  # a grad_accum given on the resume is the user's
    with pytest.raises(ConfigError, match="3 micro-batches an update .* 2 processes cannot share evenly"):
        resumed_grad_accum(3, 1, 2, 1)


def test_a_two_process_checkpoint_resumed_in_one_process_trains_as_before(tmp_path):
    """A 2-process run with grad_accum 1 computes what 1 process with grad_accum 2 does (tests/test_distributed.py);
    its checkpoint, written by a gptkit that stored no process count (only rank 1's generators tell it), resumed in
    one process continues with the same losses."""
    data = write_char_data_dir(tmp_path, 20_000)
    whole = tmp_path / "whole"
    train(from_sources(None, settings(data, whole, grad_accum=2)), progress=False)
    # The checkpoint of step 3 as the 2-process run (grad_accum 1 in its config.yaml) leaves it.
    two = tmp_path / "two"
    shutil.copytree(whole, two)
    shutil.rmtree(two / "checkpoints" / "step-000006")
    (two / LATEST).write_text("checkpoints/step-000003\n")
    checkpoint = two / "checkpoints" / "step-000003"
    record = json.loads((checkpoint / TRAINER_FILE).read_text())
    record.pop("world_size", None), record.pop("grad_accum", None)
    (checkpoint / TRAINER_FILE).write_text(json.dumps(record))
    rng = load_tensors(checkpoint / RNG_FILE)
    save_tensors({**rng, "rank1.torch_cpu": rng["torch_cpu"].clone()}, checkpoint / RNG_FILE)
    (checkpoint / "manifest.json").unlink()
    write_manifest(checkpoint)
    config_yaml = two / "config.yaml"
    config_yaml.write_text(config_yaml.read_text().replace("grad_accum: 2", "grad_accum: 1"))
    assert saved_world(checkpoint) == (2, None)

    resumed = from_sources(config_yaml, {"train": {"out_dir": str(two)}})
    assert resumed.train.grad_accum == 1
    train(resumed, resume=True, progress=False)
    assert losses(two) == losses(whole)
    assert "grad_accum: 2" in config_yaml.read_text()
    assert saved_world(two / "checkpoints" / "step-000006") == (1, 2)
    assert torch.equal(
        load_tensors(two / "checkpoints" / "step-000006" / "model.safetensors")["tok_emb.weight"],
        load_tensors(whole / "checkpoints" / "step-000006" / "model.safetensors")["tok_emb.weight"],
    )
