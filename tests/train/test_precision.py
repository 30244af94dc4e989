"""gptkit.precision: train.dtype auto and attention's precision follow the hardware and the shape, never a timing;
two runs of one command on one machine give the same losses, whatever else the machine is doing."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import write_char_data_dir

from gptkit import precision
from gptkit.checkpoint import latest_checkpoint
from gptkit.cli import main
from gptkit.distributed import World
from gptkit.precision import Precision, choose_precision
from gptkit.run_sources import from_sources
from gptkit.train import Trainer, train

CPU, SHAPE = torch.device("cpu"), (12, 4, 64, 32)  # (batch, heads, block, head_dim)
TINY_MODEL = {"n_layer": 2, "n_head": 2, "n_embd": 16, "block_size": 16, "dropout": 0.1, "activation": "gelu"}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    return write_char_data_dir(tmp_path_factory.mktemp("data"), 20_000)


def tiny(data_dir: Path, out: Path, **train_overrides):
    settings = dict(
        data_dir=str(data_dir),
        out_dir=str(out),
        max_steps=4,
        batch_size=4,
        eval_interval=4,
        eval_iters=1,
        log_interval=1,
        checkpoint_interval=2,
        device="cpu",
        plot=False,
        sample_every=0,  # samples: tests/observe/test_observe_training.py (most of such a run's time)
    )
    settings.update(train_overrides)
    optim = {"warmup_steps": 1, "decay_steps": 4, "lr": 3e-3}
    return from_sources(None, {"model": dict(TINY_MODEL), "optim": optim, "train": settings})


def losses(run_dir: Path) -> dict[int, tuple]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in records if "loss" in r}


@pytest.fixture
def flags(monkeypatch):
    """Make this CPU list the given /proc/cpuinfo flags (as far as precision reads them)."""

    def have(*names: str) -> None:
        monkeypatch.setattr(precision, "cpu_flags", lambda: set(names), raising=False)  # (before: none read)

    return have


def test_dtype_auto_does_not_follow_a_timing(monkeypatch, flags):
    # Timings taken under another program's load came out either way minutes apart: the choice must not move.
    from gptkit import devices

    for names in [(), ("avx2", "avx512_bf16")]:
        flags(*names)
        chosen = set()
        for bf16_rate in (1e9, 1e11, 1e13):  # emulated, as fast as fp32, far faster: as a loaded machine measures
            rates = {torch.float32: 1e11, torch.bfloat16: bf16_rate}
            monkeypatch.setattr(devices, "measured_cpu_matmul_flops", rates.get)
            monkeypatch.setattr(precision, "measured_cpu_matmul_flops", rates.get, raising=False)
            chosen.add(choose_precision("auto", CPU, World(), SHAPE))
        assert len(chosen) == 1, chosen


def test_dtype_auto_takes_bfloat16_on_a_cpu_with_bf16_matmul_instructions(flags):
    for names, dtype in [
        (("avx2", "avx512_bf16"), "bfloat16"),
        (("amx_bf16",), "bfloat16"),
        (("avx2",), "float32"),
        ((), "float32"),
    ]:
        flags(*names)
        assert precision.training_dtype("auto", CPU) == dtype, names
    for asked in ("float32", "bfloat16", "float16"):
        assert precision.training_dtype(asked, CPU) == asked  # an explicit dtype is never second-guessed
    assert precision.training_dtype("auto", torch.device("mps")) == "float32"


def test_dtype_auto_on_a_gpu_takes_bfloat16_where_it_has_it(monkeypatch):
    for has_bf16, dtype in [(True, "bfloat16"), (False, "float16")]:
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda has=has_bf16: has)
        assert precision.training_dtype("auto", torch.device("cuda")) == dtype


def test_attention_runs_in_fp32_under_cpu_bf16_at_short_contexts_only(flags):
    flags("avx512_bf16")
    limit = precision.FP32_ATTENTION_MAX_CONTEXT
    short, long = (12, 4, limit, 32), (4, 12, 2 * limit, 64)
    assert choose_precision("bfloat16", CPU, World(), short).fp32_attention is True
    assert choose_precision("bfloat16", CPU, World(), long).fp32_attention is False
    assert choose_precision("auto", CPU, World(), short) == Precision(
        "bfloat16",
        True,
        f"train.dtype auto: this CPU lists avx512_bf16 (bf16 matmul in hardware); attention in "
        f"float32: context {limit} <= {limit}",
    )
    assert choose_precision("float32", CPU, World(), short) == Precision("float32", False)


def test_a_saved_choice_holds_on_its_device_kind(flags):
    flags()  # this CPU would choose float32 now: the checkpoint's bf16 holds all the same
    saved = Precision("bfloat16", False, "train.dtype auto: this CPU lists avx512_bf16").state(CPU)
    kept = choose_precision("auto", CPU, World(), SHAPE, saved)
    assert (kept.dtype, kept.fp32_attention) == ("bfloat16", False)
    assert kept.reason == "train.dtype auto: this CPU lists avx512_bf16"  # the run's own, however many resumes on
    assert choose_precision("bfloat16", CPU, World(), SHAPE, saved).fp32_attention is False
    elsewhere = {**saved, "device": "cuda"}  # a checkpoint from a GPU is chosen afresh on a CPU
    assert choose_precision("bfloat16", CPU, World(), SHAPE, elsewhere).fp32_attention is True
    assert choose_precision("auto", CPU, World(), SHAPE, elsewhere).dtype == "float32"


@pytest.mark.parametrize("bf16", [True, False])
def test_a_run_with_dtype_auto_records_what_it_chose_and_why(data_dir, tmp_path, flags, caplog, capsys, bf16):
    flags(*(["avx512_bf16"] if bf16 else ["avx2"]))
    with caplog.at_level(logging.INFO, logger="gptkit"):
        trainer = Trainer(tiny(data_dir, tmp_path / "run", max_steps=2, dtype="auto"), resume=False)
    chosen = "bfloat16" if bf16 else "float32"
    said = trainer.precision.describe()
    assert trainer.settings.dtype == chosen and f"training in {said} on cpu" in caplog.text
    assert said.startswith(f"{chosen}{', attention in float32' if bf16 else ''} (train.dtype auto: this CPU lists")
    # config.yaml keeps what was asked (a resume from it takes the checkpoint's choice) and says what it became.
    written = (trainer.run_dir / "config.yaml").read_text()
    assert "dtype: auto" in written and f"# precision: this run trains in {said} on cpu." in written
    assert [block.attn.fp32_attention for block in trainer.gpt.blocks] == [bf16] * 2
    trainer.run(progress=False)
    assert len(losses(trainer.run_dir)) == 2
    # gptkit info of the checkpoint says it too.
    capsys.readouterr()
    assert main(["info", str(latest_checkpoint(trainer.run_dir))]) == 0
    assert f"trained in {said}" in capsys.readouterr().out


def test_a_resumed_run_keeps_the_precision_it_chose(data_dir, tmp_path, flags):
    flags("avx512_bf16")
    whole = losses(train(tiny(data_dir, tmp_path / "whole", dtype="auto"), progress=False).run_dir)
    train(tiny(data_dir, tmp_path / "resumed", dtype="auto", max_steps=2), progress=False)
    flags()  # the machine now says float32: the run keeps what it chose, and replays its steps exactly
    trainer = Trainer(from_sources(tmp_path / "resumed" / "config.yaml", {"train": {"max_steps": 4}}), resume=True)
    assert trainer.requested_dtype == "auto" and trainer.settings.dtype == "bfloat16"
    assert all(block.attn.fp32_attention for block in trainer.gpt.blocks)
    trainer.run(progress=False)
    assert losses(trainer.run_dir) == whole


def test_two_runs_of_one_command_beside_a_busy_neighbour_give_the_same_losses(data_dir, tmp_path):
    # A neighbour spins on a core through both runs (on a machine perhaps busy with more): whatever the machine is
    # doing, one command gives one run.
    neighbour = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        runs = [train(tiny(data_dir, tmp_path / f"run{i}", dtype="auto"), progress=False).run_dir for i in range(2)]
    finally:
        neighbour.kill()
        neighbour.wait()
    first, second = (losses(run) for run in runs)
    assert first == second and len(first) == 4
    assert [(run / "config.yaml").read_text().splitlines()[:3] for run in runs] == [
        (runs[0] / "config.yaml").read_text().splitlines()[:3]
    ] * 2
