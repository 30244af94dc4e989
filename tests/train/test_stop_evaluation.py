"""Ctrl-C during an evaluation: answered at once, the evaluation stopped where it is, and the checkpoint written; an
evaluation shows its progress."""

from __future__ import annotations

import json
import logging
import os
import signal
from pathlib import Path

from helpers import write_char_data_dir

from gptkit.checkpoint import latest_checkpoint
from gptkit.run_sources import from_sources
from gptkit.train import Trainer

MODEL = {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 16, "dropout": 0.0}


def trainer(tmp_path: Path, **train) -> Trainer:
    data = write_char_data_dir(tmp_path, 20_000)
    settings = {
        "model": dict(MODEL),
        "optim": {"warmup_steps": 1},
        "train": {
            "data_dir": str(data),
            "out_dir": str(tmp_path / "run"),
            "max_steps": 4,
            "batch_size": 4,
            "eval_interval": 2,
            "eval_iters": 2,
            "eval_at_start": False,
            "log_interval": 1,
            "checkpoint_interval": 100,
            "device": "cpu",
            "plot": False,
            **train,
        },
    }
    return Trainer(from_sources(None, settings), resume=False)


def interrupt_at_evaluation_pass(run: Trainer, number: int) -> list[int]:
    """Send this process SIGINT from inside the number-th forward pass of an evaluation; returns the passes seen."""
    passes: list[int] = []

    def hook(module, args, output) -> None:
        if not module.training:
            passes.append(run.step)
            if len(passes) == number:
                os.kill(os.getpid(), signal.SIGINT)

    run.gpt.register_forward_hook(hook)
    return passes


def test_ctrl_c_in_an_evaluation_stops_it_there_and_writes_the_checkpoint(tmp_path, caplog):
    run = trainer(tmp_path)
    passes = interrupt_at_evaluation_pass(run, 1)
    with caplog.at_level(logging.WARNING, logger="gptkit"):
        result = run.run(progress=False)
    assert passes == [2]  # the evaluation at step 2 ran no pass after the signal (it has a dozen)
    assert result.interrupted and result.step == 2
    assert latest_checkpoint(run.run_dir).name == "step-000002" == result.checkpoint.name
    assert "this evaluation is cut short" in caplog.text and "Ctrl-C again to abort without saving" in caplog.text
    last = json.loads((run.run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["step"] == 2 and last["evaluation"] == "stopped" and "val_loss" not in last and "loss" in last


def test_ctrl_c_between_steps_is_acknowledged_at_once(tmp_path, caplog):
    run = trainer(tmp_path, eval_interval=100)

    def hook(module, args, output) -> None:
        if module.training and run.step == 1 and not hook.sent:
            hook.sent = True
            os.kill(os.getpid(), signal.SIGINT)

    hook.sent = False
    run.gpt.register_forward_hook(hook)
    with caplog.at_level(logging.WARNING, logger="gptkit"):
        result = run.run(progress=False)
    assert result.interrupted and result.step == 2 and result.checkpoint.name == "step-000002"
    assert "stopping after this step" in caplog.text


def test_an_evaluation_shows_its_passes_as_they_run(tmp_path, capsys):
    run = trainer(tmp_path, max_steps=2)
    run.run(progress=True)
    err = capsys.readouterr().err
    assert "evaluating step 2" in err and " passes" in err
