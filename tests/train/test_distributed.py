"""Data-parallel training under torchrun on 2 CPU processes (gloo): same losses as 1 process, exact resume, FSDP."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import same_run, write_char_data_dir

from gptkit.checkpoint import LATEST, latest_checkpoint
from gptkit.data import TrainBatches
from gptkit.distributed import RankBatches, World, device_for, world_from_env
from gptkit.errors import ConfigError
from gptkit.formats.modeldir import load_model_dir
from gptkit.run_sources import from_sources
from gptkit.tensors import load_tensors
from gptkit.train import train

MODEL = {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 16, "dropout": 0.0, "activation": "gelu"}
OPTIM = {"warmup_steps": 2, "decay_steps": 6, "lr": 3e-3}


def settings(data: Path, out: Path, **train) -> dict[str, dict]:
    return {
        "model": dict(MODEL),
        "optim": dict(OPTIM),
        "train": {
            "data_dir": str(data),
            "out_dir": str(out),
            "max_steps": 6,
            "batch_size": 4,
            "grad_accum": 1,
            "eval_interval": 6,
            "eval_iters": 2,
            "log_interval": 1,
            "checkpoint_interval": 3,
            "keep_checkpoints": 3,
            "device": "cpu",
            "plot": False,
            "sample_every": 0,  # samples: tests/observe/test_observe_training.py (most of such a run's time)
            **train,
        },
    }


def flags(config: dict[str, dict]) -> list[str]:
    return [f"--{section}.{key}={value}" for section, values in config.items() for key, value in values.items()]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    """A char-level data directory from the first 30k characters of the bundled corpus."""
    return write_char_data_dir(tmp_path_factory.mktemp("data"), 30_000)


def torchrun(config: dict[str, dict], *extra: str) -> None:
    """`torchrun --nproc_per_node 2 -m gptkit train ...` on 127.0.0.1 and a free port; fails with the ranks' stderr."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--nnodes",
        "1",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(port),
        "-m",
        "gptkit",
        "train",
        "--quiet",
        *flags(config),
        *extra,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stderr[-3000:]


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records(run_dir) if "loss" in r}


@pytest.fixture(scope="module")
def one_process(data_dir, tmp_path_factory) -> Path:
    """1 process with grad_accum 2: the run 2 processes with grad_accum 1 must reproduce."""
    out = tmp_path_factory.mktemp("one") / "run"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train(from_sources(None, settings(data_dir, out, grad_accum=2)), progress=False)
    finally:
        torch.set_num_threads(threads)
    return out


def test_rank_batches_split_one_stream():
    tokens = np.arange(1000, dtype=np.uint16)
    whole = TrainBatches(tokens, 8, 2, seed=5)
    stream = [whole.next_batch()[0] for _ in range(6)]
    ranks = [RankBatches(TrainBatches(tokens, 8, 2, seed=5), World(r, 2)) for r in range(2)]
    mine = [[rank.next_batch()[0] for _ in range(3)] for rank in ranks]
    for k in range(3):  # rank r's k-th batch is the stream's batch 2k + r
        assert torch.equal(mine[0][k], stream[2 * k]) and torch.equal(mine[1][k], stream[2 * k + 1])
    assert ranks[0].state_dict() == ranks[1].state_dict() == whole.state_dict() == {"seed": 5, "step": 6}
    resumed = RankBatches(TrainBatches(tokens, 8, 2, seed=0), World(1, 2))
    resumed.load_state_dict({"seed": 5, "step": 4})
    assert torch.equal(resumed.next_batch()[0], stream[5])
    with pytest.raises(Exception, match="multiple of the 2 processes"):
        resumed.load_state_dict({"seed": 5, "step": 3})


def test_a_plain_cuda_device_becomes_the_current_gpu(monkeypatch):
    """torch.cuda.set_device refuses a device without an index: `--train.device cuda` names the current GPU."""
    chosen = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    assert device_for(World(), torch.device("cuda")) == torch.device("cuda", 0)
    assert device_for(World(rank=1, world_size=2, local_rank=1), torch.device("cuda:1")) == torch.device("cuda", 1)
    assert chosen == [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert device_for(World(), torch.device("cpu")) == torch.device("cpu") and len(chosen) == 2


def test_world_from_env():
    assert world_from_env({}) == World(0, 1, 0)
    assert world_from_env({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"}) == World(3, 4, 1)
    with pytest.raises(ConfigError, match="RANK 4 is not in"):
        world_from_env({"RANK": "4", "WORLD_SIZE": "4", "LOCAL_RANK": "0"})


# FSDP's variant runs in the slow suite (11 s); FSDP stays covered by default through the fine-tuning and Muon tests.
@pytest.mark.parametrize("parallel", ["ddp", pytest.param("fsdp", marks=pytest.mark.slow)])
def test_two_processes_match_one_and_resume_exactly(parallel, data_dir, one_process, tmp_path):
    out = tmp_path / parallel
    torchrun(settings(data_dir, out, parallel=parallel))
    one, two = losses(one_process), losses(out)
    assert sorted(two) == list(range(1, 7))
    assert max(abs(one[s] - two[s]) for s in one) < 1e-5, (one, two)
    first = records(out)
    # Only rank 0 writes: each step is logged once, and the checkpoints (FSDP's gathered whole) are plain model
    # directories that load into one process.
    assert [r["step"] for r in first] == list(range(7))
    final = latest_checkpoint(out)
    single = load_tensors(latest_checkpoint(one_process) / "model.safetensors")
    double = load_tensors(final / "model.safetensors")
    assert max((single[k] - double[k]).abs().max().item() for k in single) < 1e-5
    assert load_model_dir(final).config.n_embd == 32

    # Crash after step 3: keep only that checkpoint, then resume on 2 processes.
    crashed = tmp_path / "crashed"
    shutil.copytree(out, crashed)
    shutil.rmtree(crashed / "checkpoints" / "step-000006")
    (crashed / LATEST).write_text("checkpoints/step-000003\n")
    torchrun(settings(data_dir, crashed, parallel=parallel), "--resume")
    assert losses(crashed) == losses(out)
    resumed = load_tensors(latest_checkpoint(crashed) / "model.safetensors")
    assert all(torch.equal(resumed[k], double[k]) for k in double)
    opt_a = load_tensors(latest_checkpoint(crashed) / "optimizer.safetensors")
    opt_b = load_tensors(final / "optimizer.safetensors")
    assert opt_a.keys() == opt_b.keys() and all(torch.equal(opt_a[k], opt_b[k]) for k in opt_a)


# DDP steps the all-reduced gradients on every rank, the easy case: the slow suite checks it.
@pytest.mark.parametrize("parallel", [pytest.param("ddp", marks=pytest.mark.slow), "fsdp"])
def test_muon_under_two_processes_matches_one(parallel, data_dir, tmp_path):
    # FSDP shards each matrix by rows: Muon's Newton-Schulz products on the DTensor shards gather what they need,
    # so each rank's update is its rows of the whole matrix's update. Those bf16 products sum in another order, so
    # FSDP's losses drift from one process's by up to 5.0e-5 by step 6 (measured; a 128 x 32 update's entries agree
    # to 0.013 with the whole matrix's, where orthogonalising each rank's rows alone is 0.2 off).
    tolerance = 1e-5 if parallel == "ddp" else 1e-4
    muon = {"optim": {**OPTIM, "name": "muon"}}
    one = tmp_path / "one"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train(from_sources(None, {**settings(data_dir, one, grad_accum=2), **muon}), progress=False)
    finally:
        torch.set_num_threads(threads)
    two = tmp_path / parallel
    torchrun({**settings(data_dir, two, parallel=parallel), **muon})
    single, double = losses(one), losses(two)
    assert sorted(double) == list(range(1, 7))
    assert max(abs(single[s] - double[s]) for s in single) < tolerance, (single, double)
    state = load_tensors(latest_checkpoint(two) / "optimizer.safetensors")
    assert state["blocks.1.mlp.fc.weight.momentum_buffer"].shape == (128, 32)  # saved whole, as one process keeps it


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_sliced_lm_head_loss_under_two_processes_matches_one(parallel, tmp_path):
    """GPT-2's vocabulary on 4 x 256 tokens per micro-step is past SLICE_LOGITS: the loss runs in slices."""
    from gptkit.loss import SLICE_LOGITS

    vocab, block = 50257, 256
    assert 4 * block * vocab > SLICE_LOGITS
    data = tmp_path / "data"
    data.mkdir()
    tokens = np.random.default_rng(0).integers(0, vocab, size=200_000).astype(np.uint16)
    tokens.tofile(data / "train.bin")
    tokens[:20_000].tofile(data / "val.bin")
    meta = {"vocab_size": vocab, "dtype": "uint16", "train_tokens": 200_000, "val_tokens": 20_000, "tokenizer": "none"}
    (data / "meta.json").write_text(json.dumps(meta))

    def config(out: Path, **train) -> dict[str, dict]:
        c = settings(data, out, max_steps=3, eval_interval=3, checkpoint_interval=3, **train)
        c["model"].update(n_layer=1, block_size=block, vocab_size=vocab)
        return c

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train(from_sources(None, config(tmp_path / "one", grad_accum=2)), progress=False)
    finally:
        torch.set_num_threads(threads)
    torchrun(config(tmp_path / "two", parallel=parallel))
    one, two = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert one.keys() == two.keys() == {1, 2, 3}
    assert all(abs(one[step] - two[step]) < 1e-5 for step in one)


@pytest.mark.parametrize("method, parallel", [("lora", "ddp"), ("full", "fsdp")])
def test_two_processes_fine_tune_on_examples_as_one(method, parallel, tmp_path):
    """Micro-batches of examples hold different numbers of trained tokens: each rank weighs its own by the
    update's total, so 2 processes match 1 process with twice the accumulation."""
    from helpers import byte_model_dir, reversal_rows, write_jsonl

    import gptkit.cli

    base = byte_model_dir(tmp_path / "base")
    data = tmp_path / "data"
    rows = write_jsonl(tmp_path / "chat.jsonl", reversal_rows(40))
    assert gptkit.cli.main(["prepare", "--input", str(rows), "--tokenizer", str(base), "--out", str(data)]) == 0
    config = settings(data, tmp_path / "one", grad_accum=2, batch_size=3)
    config["model"] = {"init_from": str(base)}
    config["finetune"] = {"method": method, "packing": True}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train(from_sources(None, config), progress=False)
    finally:
        torch.set_num_threads(threads)
    config["train"].update(grad_accum=1, out_dir=str(tmp_path / "two"), parallel=parallel)
    torchrun(config)
    one, two = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert sorted(two) == list(range(1, 7)) and max(abs(one[s] - two[s]) for s in one) < 1e-5, (one, two)
    weights = "adapters.safetensors" if method == "lora" else "model.safetensors"
    a, b = (load_tensors(latest_checkpoint(tmp_path / run) / weights) for run in ("one", "two"))
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5


def test_a_one_process_group_trains_as_one_process(data_dir, tmp_path, device, monkeypatch):
    """DDP over a process group of one (NCCL on CUDA, gloo on the CPU): the wrapper and every collective of the loop
    run as across processes, and the run equals a plain one."""
    import gptkit.train

    plain = train(from_sources(None, settings(data_dir, tmp_path / "plain", device=device.type)), progress=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(World, "distributed", property(lambda world: True))  # one rank, taken as many
    wrappers = []
    real_wrap = gptkit.train.wrap
    monkeypatch.setattr(gptkit.train, "wrap", lambda *a: wrappers.append(real_wrap(*a)) or wrappers[-1])
    grouped = train(from_sources(None, settings(data_dir, tmp_path / "grouped", device=device.type)), progress=False)
    assert [type(w).__name__ for w in wrappers] == ["DistributedDataParallel"]
    assert not torch.distributed.is_initialized()  # the run left the group it joined
    torch.testing.assert_close(losses(grouped.run_dir), losses(plain.run_dir), **same_run(device))
