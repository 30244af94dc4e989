"""Runs checkpointed by an older gptkit (tests/fixtures/old_runs, made at commit eb8bd92 before training methods
became parts) resume here: the steps after the checkpoint give the losses that gptkit gave running on, whether the
settings are given afresh or read back from the run's own config.yaml by `gptkit train --resume`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from gptkit.cli import main
from gptkit.manifest import write_manifest
from gptkit.run_sources import from_sources
from gptkit.train import train

FIXTURES = Path(__file__).parent / "fixtures" / "old_runs"
# run -> (data directory, starts from the base model, finetune settings), as make_old_runs.py trained them
RUNS = {
    "text": ("data-text", False, {}),
    "lora": ("data-chat", True, {"method": "lora", "lora_rank": 4, "lora_dropout": 0.1}),
    "classify": ("data-labelled", True, {"objective": "classify"}),
}


def _config(root: Path, name: str) -> object:
    data, from_base, finetune = RUNS[name]
    train_settings = dict(
        data_dir=str(root / data),
        out_dir=str(root / f"run-{name}"),
        max_steps=6,
        batch_size=4,
        eval_interval=3,
        eval_iters=2,
        log_interval=1,
        checkpoint_interval=3,
        device="cpu",
        plot=False,
    )
    model = (
        {"init_from": str(root / "base")}
        if from_base
        else {"n_layer": 1, "n_head": 2, "n_embd": 16, "block_size": 16, "dropout": 0.1}
    )
    optim = {"warmup_steps": 1, "lr": 3e-3, "decay_steps": 6}
    return from_sources(None, {"model": model, "optim": optim, "train": train_settings, "finetune": finetune})


def _records(path: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, path.read_text().splitlines()) if "loss" in r}


@pytest.mark.parametrize("name", list(RUNS))
def test_a_run_checkpointed_by_an_older_gptkit_resumes_where_it_would_have_gone(name, tmp_path):
    root = _moved_runs(tmp_path)
    result = train(_config(root, name), resume=True, progress=False)
    assert result.step == 6
    _check_losses(root, name)


def _moved_runs(tmp_path: Path) -> Path:
    """A copy of the fixtures with the absolute paths that machine had (OLD_RUNS) made this copy's, as a user who
    moves a run would."""
    root = tmp_path / "old_runs"
    shutil.copytree(FIXTURES, root)
    for name in RUNS:
        config = root / f"run-{name}" / "config.yaml"
        config.write_text(config.read_text().replace("OLD_RUNS", str(root)))
        checkpoint = root / f"run-{name}" / "checkpoints" / "step-000003"
        lora_config = checkpoint / "lora_config.json"
        if lora_config.exists():  # the base's path is in the checkpoint too, which the manifest covers
            lora_config.write_text(lora_config.read_text().replace("OLD_RUNS", str(root)))
            write_manifest(checkpoint)
    return root


def _check_losses(root: Path, name: str) -> None:
    """The resumed run's records equal those the older gptkit wrote running on to step 6."""
    got, want = _records(root / f"run-{name}" / "metrics.jsonl"), _records(root / f"expected-{name}.jsonl")
    assert got.keys() == want.keys() == set(range(1, 7))
    for step in (4, 5, 6):  # the steps after the checkpoint; float sums may differ by CPU kind in the last bits
        assert got[step]["loss"] == pytest.approx(want[step]["loss"], rel=1e-5), step
        assert got[step]["grad_norm"] == pytest.approx(want[step]["grad_norm"], rel=1e-4), step
    assert got[6]["val_loss"] == pytest.approx(want[6]["val_loss"], rel=1e-5)


@pytest.mark.parametrize("name", list(RUNS))
def test_gptkit_train_resume_reads_an_older_runs_config_yaml_and_goes_on_alike(name, tmp_path):
    """The way a user resumes: the run's config.yaml as the older gptkit wrote it is the settings' base (its keys,
    sections and values all still read), and a flag of the time extends the run."""
    root = _moved_runs(tmp_path)
    run_dir = root / f"run-{name}"
    assert main(["train", "--resume", "--out", str(run_dir), "--train.max_steps", "6", "--quiet"]) == 0
    _check_losses(root, name)
