"""gptkit train: exact resume (also after kill -9 and SIGTERM), fault skipping, checkpoints, compile, config errors."""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import same_run, write_char_data_dir

from gptkit.checkpoint import CHECKPOINTS, checkpoint_dirs, latest_checkpoint, read_latest, verify_checkpoint
from gptkit.cli import main
from gptkit.devices import measured_cpu_matmul_flops, peak_flops
from gptkit.errors import ConfigError
from gptkit.formats.modeldir import load_model_dir
from gptkit.loading import load
from gptkit.manifest import write_manifest
from gptkit.run_sources import from_sources
from gptkit.tensors import load_tensors
from gptkit.tokenizer import load_tokenizer
from gptkit.train import Trainer, TrainingStopped, train

TINY_MODEL = {"n_layer": 2, "n_head": 2, "n_embd": 16, "block_size": 16, "dropout": 0.1, "activation": "gelu"}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    """A char-level data directory from the first 60k characters of the bundled corpus."""
    return write_char_data_dir(tmp_path_factory.mktemp("data"), 60_000)


def tiny(data_dir: Path, out: Path, **train_overrides):
    """A few-step run of a 2-layer, 16-wide model with dropout (so the RNG state matters for resume)."""
    settings = dict(
        data_dir=str(data_dir),
        out_dir=str(out),
        max_steps=8,
        batch_size=4,
        eval_interval=4,
        eval_iters=2,
        log_interval=1,
        checkpoint_interval=3,
        device="cpu",
        plot=False,
        sample_every=0,  # samples: tests/observe/test_observe_training.py (most of such a run's time)
    )
    settings.update(train_overrides)
    optim = {"warmup_steps": 2, "decay_steps": 8, "lr": 3e-3}
    return from_sources(None, {"model": dict(TINY_MODEL), "optim": optim, "train": settings})


def losses(run_dir: Path) -> dict[int, tuple]:
    """step -> (loss, grad_norm, lr) for every logged training step of a run."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: (r["loss"], r["grad_norm"], r["lr"]) for r in records if "loss" in r}


def weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    return load_tensors(checkpoint / "model.safetensors")


def assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name


@pytest.fixture(scope="module")
def reference(data_dir, tmp_path_factory) -> Path:
    """An uninterrupted 8-step run that resumed runs must reproduce bit for bit."""
    out = tmp_path_factory.mktemp("ref") / "run"
    train(tiny(data_dir, out), progress=False)
    return out


def test_resume_is_bit_identical(data_dir, reference, tmp_path):
    out = tmp_path / "run"
    first = train(tiny(data_dir, out, max_steps=5), progress=False)  # checkpoints at 3 and at the end, 5
    assert first.step == 5 and latest_checkpoint(out).name == "step-000005"
    second = train(tiny(data_dir, out), resume=True, progress=False)
    assert second.step == 8
    assert losses(out) == losses(reference)
    assert len(losses(out)) == 8
    assert_same_weights(latest_checkpoint(out), latest_checkpoint(reference))
    ref_opt = load_tensors(latest_checkpoint(reference) / "optimizer.safetensors")
    opt = load_tensors(latest_checkpoint(out) / "optimizer.safetensors")
    assert all(torch.equal(ref_opt[k], opt[k]) for k in ref_opt) and ref_opt.keys() == opt.keys()


def test_resume_with_muon_is_bit_identical(data_dir, tmp_path, capsys):
    def muon(out: Path, **overrides):
        config = tiny(data_dir, out, **overrides)
        config.optim.name, config.optim.schedule = "muon", "wsd"
        return config

    reference_run = train(muon(tmp_path / "ref"), progress=False).run_dir
    out = tmp_path / "run"
    train(muon(out, max_steps=5), progress=False)
    train(muon(out), resume=True, progress=False)
    assert losses(out) == losses(reference_run) and len(losses(out)) == 8
    assert_same_weights(latest_checkpoint(out), latest_checkpoint(reference_run))
    state = load_tensors(latest_checkpoint(out) / "optimizer.safetensors")
    assert "blocks.0.attn.qkv.weight.momentum_buffer" in state and "blocks.0.attn.qkv.weight.exp_avg" not in state
    assert "tok_emb.weight.exp_avg" in state  # the embedding stays with AdamW
    # A Muon checkpoint does not resume under AdamW: one line, not a traceback.
    assert main(["train", *_cli_flags(data_dir, out, max_steps=10), "--resume"]) == 2
    assert (
        capsys.readouterr()
        .err.strip()
        .endswith("trained with optim.name muon, this run has adamw; resume with --optim.name muon")
    )


def test_run_directory_contents(data_dir, reference):
    metrics = [json.loads(line) for line in (reference / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(9))  # step 0 is the evaluation before training
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "elapsed_s"):
        assert all(isinstance(m[key], float) for m in metrics[1:]), key
    evals = [m for m in metrics if "val_loss" in m]
    assert [m["step"] for m in evals] == [0, 4, 8]
    for m in evals:  # a char tokenizer of ASCII text: one byte per token, so bpb = loss / ln 2
        assert m["val_bpb"] == pytest.approx(m["val_loss"] / np.log(2), rel=1e-9)
        assert m["val_ppl"] == pytest.approx(np.exp(m["val_loss"]))
        assert m["train_eval_ppl"] == pytest.approx(np.exp(m["train_eval_loss"]))
    assert evals[-1]["val_loss"] < evals[0]["val_loss"]
    # keep_checkpoints 3: steps 3, 6 and 8 remain; the latest is a model directory with the data's tokenizer.
    assert sorted(p.name for p in (reference / CHECKPOINTS).iterdir()) == ["step-000003", "step-000006", "step-000008"]
    vocab = json.loads((data_dir / "meta.json").read_text())["vocab_size"]
    model = load_model_dir(latest_checkpoint(reference))
    assert model.config.vocab_size == vocab and model.config.n_layer == 2
    assert load_tokenizer(latest_checkpoint(reference)).vocab_size == vocab
    saved = from_sources(reference / "config.yaml", {})
    assert saved.model.fields["vocab_size"] == vocab and saved.train.max_steps == 8


def _wait_for_step(run_dir: Path, process: subprocess.Popen, at_least: int, timeout: float = 600) -> int:
    """Poll metrics.jsonl until it shows a step >= at_least; return the last step seen."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, process.communicate()[1][-2000:]
        path = run_dir / "metrics.jsonl"
        if path.is_file():
            steps = [json.loads(line)["step"] for line in path.read_text().splitlines() if line.endswith("}")]
            if steps and steps[-1] >= at_least:
                return steps[-1]
        time.sleep(0.005)
    raise AssertionError(f"the run did not reach step {at_least} in {timeout} s")


@contextlib.contextmanager
def threads(count: int) -> Iterator[None]:
    """Run the block with `count` torch threads (a sum split over other threads rounds otherwise)."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def test_kill9_and_sigterm_then_resume_are_bit_identical(data_dir, tmp_path):
    # Every part runs on one thread: the reference and the last part here, whatever thread count this process has
    # (another test, or the machine, may have set it), the killed ones in processes told so.
    steps = 150
    ref, out = tmp_path / "ref", tmp_path / "run"
    settings = dict(max_steps=steps, checkpoint_interval=7, eval_interval=100)
    with threads(1):
        train(tiny(data_dir, ref, **settings), progress=False)
    flags = [
        "--data",
        str(data_dir),
        "--out",
        str(out),
        "--quiet",
        "--train.device",
        "cpu",
        "--train.max_steps",
        str(steps),
        "--train.batch_size",
        "4",
        "--train.eval_interval",
        "100",
        "--train.eval_iters",
        "2",
        "--train.log_interval",
        "1",
        "--train.checkpoint_interval",
        "7",
        "--train.plot",
        "false",
        "--train.sample_every",
        "0",
        "--optim.warmup_steps",
        "2",
        "--optim.decay_steps",
        "8",
        "--optim.lr",
        "3e-3",
    ]
    flags += [arg for key, value in TINY_MODEL.items() for arg in (f"--model.{key}", str(value))]
    command = [sys.executable, "-m", "gptkit", "train"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    process = subprocess.Popen(command + flags, stderr=subprocess.PIPE, text=True, env=env)
    _wait_for_step(out, process, 20)
    process.kill()  # SIGKILL: no handler runs, whatever it was doing (maybe writing a checkpoint) is cut short
    process.wait()
    assert process.returncode == -signal.SIGKILL
    killed_at = latest_checkpoint(out)
    load_model_dir(killed_at)  # the latest checkpoint is complete and loadable
    assert int(killed_at.name.split("-")[1]) % 7 == 0

    last_logged = max(losses(out))  # the resumed run first cuts the records after its checkpoint
    process = subprocess.Popen(command + ["--resume"] + flags, stderr=subprocess.PIPE, text=True, env=env)
    seen = _wait_for_step(out, process, last_logged + 5)
    process.send_signal(signal.SIGTERM)  # asks for a checkpoint at the current step, then exit 130
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 130, stderr[-2000:]
    stopped_at = int(latest_checkpoint(out).name.split("-")[1])
    assert stopped_at >= seen and "--resume" in stderr
    assert not [p for p in (out / CHECKPOINTS).iterdir() if p.name.startswith(".tmp")]

    with threads(1):
        train(tiny(data_dir, out, **settings), resume=True, progress=False)
    assert losses(out) == losses(ref)
    assert len(losses(out)) == steps
    assert_same_weights(latest_checkpoint(out), latest_checkpoint(ref))


def _poisoned_loss(monkeypatch, bad_steps: set[int]) -> None:
    """Make the training loss (not the evaluation loss) NaN at the given 1-based steps."""
    import gptkit.model

    real = gptkit.model.linear_cross_entropy
    calls = {"n": 0}

    def loss(*args, **kwargs):
        value = real(*args, **kwargs)
        if torch.is_grad_enabled():
            calls["n"] += 1
            if calls["n"] in bad_steps:
                return value * float("nan")
        return value

    monkeypatch.setattr(gptkit.model, "linear_cross_entropy", loss)


def test_non_finite_step_is_skipped(data_dir, tmp_path, monkeypatch):
    clean = train(tiny(data_dir, tmp_path / "clean", max_steps=2), progress=False)
    _poisoned_loss(monkeypatch, {3})
    result = train(tiny(data_dir, tmp_path / "bad", max_steps=3), progress=False)
    assert result.skipped_steps == 1 and result.step == 3
    record = losses(tmp_path / "bad")
    assert record[3][0] is None and record[2][0] is not None  # NaN is written as null
    # The skipped update left weights and AdamW moments exactly as after step 2.
    assert_same_weights(result.checkpoint, clean.checkpoint)
    a = load_tensors(result.checkpoint / "optimizer.safetensors")
    b = load_tensors(clean.checkpoint / "optimizer.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_non_finite_streak_stops_and_keeps_last_good_checkpoint(data_dir, tmp_path, monkeypatch):
    _poisoned_loss(monkeypatch, set(range(5, 100)))
    out = tmp_path / "run"
    with pytest.raises(TrainingStopped, match=r"3 non-finite steps in a row.*last good checkpoint"):
        train(tiny(data_dir, out, max_steps=20, checkpoint_interval=2, max_bad_steps=3), progress=False)
    latest = latest_checkpoint(out)
    assert latest.name == "step-000006"  # written while the streak was 2: its weights are step 4's
    assert_same_weights(latest, out / CHECKPOINTS / "step-000004")
    assert all(torch.isfinite(t).all() for t in weights(latest).values())
    assert not (out / CHECKPOINTS / "step-000008").exists()


def test_failed_checkpoint_write_leaves_latest_intact(data_dir, tmp_path, monkeypatch, capsys):
    import errno

    import gptkit.checkpoint

    out = tmp_path / "run"
    real = gptkit.checkpoint.save_tensors
    calls = {"n": 0}

    def failing(tensors, path, metadata=None):
        calls["n"] += path.name == "optimizer.safetensors"
        if calls["n"] == 2:  # the second checkpoint dies half-written, as on a full disk
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(tensors, path, metadata)

    monkeypatch.setattr(gptkit.checkpoint, "save_tensors", failing)
    assert main(["train", *_cli_flags(data_dir, out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.fullmatch(
        r"gptkit train: error: could not write the checkpoint of step 6: No space left on device "
        r"\(.*optimizer.safetensors\); the last intact checkpoint is .*/step-000003",
        err,
    ), err
    assert latest_checkpoint(out).name == "step-000003"
    load_model_dir(latest_checkpoint(out))
    assert sorted(p.name for p in (out / CHECKPOINTS).iterdir()) == ["step-000003"]


def _cli_flags(data_dir: Path, out: Path, **train) -> list[str]:
    """`gptkit train` flags for tiny()'s run (plus train.KEY VALUE overrides)."""
    config = tiny(data_dir, out, **train)
    flags = ["--quiet"] + [a for k, v in TINY_MODEL.items() for a in (f"--model.{k}", str(v))]
    for section in ("optim", "train"):
        for key, value in getattr(config, section).__dict__.items():
            if value is not None:
                flags += [f"--{section}.{key}", str(value).lower() if isinstance(value, bool) else str(value)]
    return flags


@pytest.fixture(scope="module")
def six_steps(data_dir, tmp_path_factory) -> Path:
    """A run stopped after step 6 (of tiny's 8), with intact checkpoints at steps 3 and 6."""
    out = tmp_path_factory.mktemp("six") / "run"
    train(tiny(data_dir, out, max_steps=6), progress=False)
    assert [p.name for p in checkpoint_dirs(out)] == ["step-000006", "step-000003"]
    return out


def _resume(run: Path, capsys, *flags: str) -> tuple[int, list[str]]:
    """`gptkit train --resume` of a copy of `run` to step 8: (exit code, stderr lines)."""
    code = main(["train", "--out", str(run), "--quiet", "--train.max_steps", "8", *flags])
    return code, capsys.readouterr().err.strip().splitlines()


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _empty_trainer_json(checkpoint: Path) -> None:
    (checkpoint / "trainer.json").write_text("{}")
    write_manifest(checkpoint)  # consistent with the damage: only the content check can tell


# Damage to the newest checkpoint (step 6), and what the warning must say about it.
FALLBACK_DAMAGE = {
    "truncated weights": (lambda c: os.truncate(c / "model.safetensors", 1000), r"model.safetensors has 1000 bytes"),
    "missing optimizer": (lambda c: (c / "optimizer.safetensors").unlink(), r"optimizer.safetensors is missing"),
    "flipped byte": (lambda c: _flip_byte(c / "model.safetensors"), r"model.safetensors does not match its checksum"),
    "foreign tensor file": (
        lambda c: shutil.copy(c / "rng.safetensors", c / "optimizer.safetensors"),
        r"optimizer.safetensors has \d+ bytes, the manifest says",
    ),
    "trainer.json without keys": (_empty_trainer_json, r"trainer.json has no int 'step'"),
    "garbage manifest": (
        lambda c: (c / "manifest.json").write_bytes(b"\xff\xfe\x00garbage"),
        r"manifest.json is unreadable",
    ),
    "incomplete": (lambda c: [(c / f).unlink() for f in ("manifest.json", "trainer.json")], r"is incomplete"),
    # Unverifiable: without its manifest the flipped byte cannot be seen, so the older verified checkpoint is taken.
    "deleted manifest, flipped byte": (
        lambda c: [(c / "manifest.json").unlink(), _flip_byte(c / "model.safetensors")],
        r"step-000006 has no manifest.json, so its files cannot be verified",
    ),
}


@pytest.mark.parametrize("damage", list(FALLBACK_DAMAGE))
def test_a_damaged_newest_checkpoint_falls_back_to_the_one_before(
    data_dir, reference, six_steps, tmp_path, capsys, damage
):
    run = tmp_path / "run"
    shutil.copytree(six_steps, run)
    harm, said = FALLBACK_DAMAGE[damage]
    harm(run / CHECKPOINTS / "step-000006")
    code, err = _resume(run, capsys, "--resume")
    assert code == 0, err
    warnings = [line for line in err if line.startswith("gptkit: ")]
    assert len(warnings) == 1 and re.search(said, warnings[0]), err
    assert warnings[0].endswith(
        "resuming from " + str(run / CHECKPOINTS / "step-000003") + ", the newest checkpoint "
        "that verifies (the newer ones are removed)"
    )
    assert losses(run) == losses(reference)  # the lines of the abandoned steps 4-6 were dropped and redone
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(set(steps))  # no step twice
    assert_same_weights(latest_checkpoint(run), latest_checkpoint(reference))
    verify_checkpoint(run / CHECKPOINTS / "step-000006")  # rewritten whole by the resumed run


@pytest.mark.parametrize(
    "latest",
    [b"\xff\xfe\x00\x01binary", b"../../../elsewhere/step-000001\n", b"/etc\n", b"checkpoints/../../step-000006\n"],
)
def test_garbage_or_an_escape_in_latest_is_ignored(data_dir, reference, six_steps, tmp_path, capsys, latest):
    run = tmp_path / "run"
    shutil.copytree(six_steps, run)
    (run / "latest").write_bytes(latest)
    assert read_latest(run) is None
    code, err = _resume(run, capsys, "--resume")
    assert code == 0, err
    assert [line for line in err if line.startswith("gptkit: ")] == [
        f"gptkit: {run / 'latest'} does not name a checkpoint inside checkpoints (ignored); resuming from "
        f"{run / CHECKPOINTS / 'step-000006'}"
    ]
    assert losses(run) == losses(reference) and (run / "latest").read_text() == "checkpoints/step-000008\n"


def test_latest_naming_a_missing_checkpoint_is_warned_about(data_dir, reference, six_steps, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(six_steps, run)
    (run / "latest").write_text("checkpoints/step-000009\n")  # a checkpoint deleted by hand, say
    code, err = _resume(run, capsys, "--resume")
    assert code == 0, err
    assert [line for line in err if line.startswith("gptkit: ")] == [
        f"gptkit: {run / 'latest'} names {run / CHECKPOINTS / 'step-000009'}, which does not exist (ignored); "
        f"resuming from {run / CHECKPOINTS / 'step-000006'}"
    ]
    assert losses(run) == losses(reference) and (run / "latest").read_text() == "checkpoints/step-000008\n"


def test_a_checkpoint_without_manifest_is_taken_when_named_or_when_none_verifies(
    data_dir, reference, six_steps, tmp_path, capsys
):
    run = tmp_path / "named"
    shutil.copytree(six_steps, run)
    newest = run / CHECKPOINTS / "step-000006"
    (newest / "manifest.json").unlink()
    code, err = _resume(run, capsys, "--resume-from", str(newest))
    assert code == 0, err
    assert [line for line in err if line.startswith("gptkit: ")] == [
        f"gptkit: {newest} has no manifest.json, so its files cannot be verified (a damaged byte would go "
        "unnoticed); continuing from it all the same, as --resume-from names it"
    ]
    assert losses(run) == losses(reference)  # it was whole, so the run goes on from step 6 exactly
    run = tmp_path / "none"  # an older gptkit's run: no checkpoint has a manifest
    shutil.copytree(six_steps, run)
    for checkpoint in checkpoint_dirs(run):
        (checkpoint / "manifest.json").unlink()
    code, err = _resume(run, capsys, "--resume")
    assert code == 0, err
    newest = run / CHECKPOINTS / "step-000006"
    assert [line for line in err if line.startswith("gptkit: ")] == [
        f"gptkit: {newest} has no manifest.json, so its files cannot be verified (a damaged byte would go "
        f"unnoticed); resuming from {newest} all the same, as no checkpoint of the run verifies"
    ]
    assert losses(run) == losses(reference)


def test_a_resume_drops_the_metrics_lines_after_its_checkpoint(data_dir, reference, six_steps, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(six_steps, run)
    with open(run / "metrics.jsonl", "a") as f:  # a run killed after logging steps 7 and 8, before their checkpoint
        f.write(
            '{"step": 7, "loss": 99.0, "lr": 0.0, "grad_norm": 0.0}\n{"step": 8, "loss": 99.0, "lr": 0.0, '
            '"grad_norm": 0.0}\n'
        )
    code, err = _resume(run, capsys, "--resume")
    assert code == 0, err
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(9))  # each step once: the stray lines were dropped, not kept beside the redone ones
    assert losses(run) == losses(reference)


def test_a_checkpoint_renamed_into_place_counts_before_latest_names_it(
    data_dir, reference, six_steps, tmp_path, capsys
):
    run = tmp_path / "run"
    shutil.copytree(six_steps, run)
    (run / "latest").write_text("checkpoints/step-000003\n")  # a kill after step 6's rename, before `latest` moved
    assert latest_checkpoint(run).name == "step-000006"
    code, err = _resume(run, capsys, "--resume")
    assert code == 0 and not [line for line in err if line.startswith("gptkit")], err
    assert losses(run) == losses(reference)
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == list(range(9))


def test_a_damaged_metrics_file_is_read_past(data_dir, reference, six_steps, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(six_steps, run)
    with open(run / "metrics.jsonl", "ab") as f:
        f.write(b'{"step": 2, "loss": \xff\xfe}\n{"step": 7, "loss": 1.')  # invalid UTF-8, then a torn last line
    code, err = _resume(run, capsys, "--resume")
    assert code == 0, err
    lines = (run / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(9)) and losses(run) == losses(reference)


@pytest.mark.parametrize(
    "line",
    [
        '{"step": true, "loss": 99.0, "lr": 0.0, "grad_norm": 0.0}',  # true is an int to Python: it was kept as step 1
        '{"step": 4, "loss": 99.0, "lr": 0.0, "grad_norm": 0.0}',  # a step the file already has, again
        '{"step": 9, "step": 2, "loss": 99.0, "lr": 0.0, "grad_norm": 0.0}',  # "step" twice: JSON keeps the last
        '{"step": -1, "loss": 99.0, "lr": 0.0, "grad_norm": 0.0}',
    ],
)
def test_a_well_formed_but_wrong_metrics_line_never_repeats_a_step(
    data_dir, reference, six_steps, tmp_path, capsys, line
):
    run = tmp_path / "run"
    shutil.copytree(six_steps, run)
    with open(run / "metrics.jsonl", "a") as f:
        f.write(line + "\n")
    code, err = _resume(run, capsys, "--resume")
    assert code == 0, err
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(9)) and all(type(r["step"]) is int for r in records)
    assert losses(run) == losses(reference)  # the stray line's loss of 99 is nowhere


def test_a_sample_longer_than_any_run_needs_is_refused_before_any_work(data_dir, tmp_path):
    with pytest.raises(ConfigError) as caught:  # (it was taken: the first evaluation stalled for good, silently)
        Trainer(tiny(data_dir, tmp_path / "run", sample_tokens=10_000_000, sample_every=1), resume=False)
    assert str(caught.value) == (
        "train.sample_tokens 10000000 is longer than a sample may be: at most 4096 (the "
        "model's block_size 16 or 4096, whichever is more); lower it, or set "
        "train.sample_every 0 for no samples"
    )
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # nothing started
    Trainer(tiny(data_dir, tmp_path / "off", sample_tokens=10_000_000, sample_every=0), resume=False)  # unused


def test_resume_from_an_older_checkpoint_rewinds_the_run(data_dir, reference, six_steps, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(six_steps, run)
    code, err = _resume(run, capsys, "--resume-from", str(run / CHECKPOINTS / "step-000003"))
    assert code == 0, err
    assert [line for line in err if line.startswith("gptkit: ")] == [
        "gptkit: continuing from step-000003: removed the later checkpoint(s) step-000006"
    ]
    assert losses(run) == losses(reference)
    assert_same_weights(latest_checkpoint(run), latest_checkpoint(reference))


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--resume-from", "{run}/checkpoints/step-000006"],
            r"{run}/checkpoints/step-000006/model.safetensors does "
            r"not match its checksum in the manifest \(changed or damaged\)",
        ),
        (
            ["--resume-from", "{run}/checkpoints/step-000009"],
            r"--resume-from {run}/checkpoints/step-000009 does not "
            "exist",
        ),
        (["--resume-from", "{run}/config.yaml"], r"--resume-from {run}/config.yaml is not a checkpoint directory .*"),
        (
            ["--resume-from", "{run}/checkpoints/step-000003", "--out", "{run}/../other"],
            r"--resume-from {run}/checkpoints/step-000003 belongs to the run {run}, not to --out {run}/../other",
        ),
    ],
)
def test_resume_from_a_damaged_or_wrong_checkpoint_is_one_line(six_steps, tmp_path, capsys, flags, message):
    run = tmp_path / "run"
    shutil.copytree(six_steps, run)
    _flip_byte(run / CHECKPOINTS / "step-000006" / "model.safetensors")
    flags = [f.replace("{run}", str(run)) for f in flags]
    code = main(["train", "--quiet", *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        code == 2
        and len(err) == 1
        and re.fullmatch("gptkit train: error: " + message.replace("{run}", str(run)), err[0])
    ), err


def test_every_checkpoint_damaged_or_a_foreign_file_ends_in_one_line(six_steps, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(six_steps, run)
    for step in ("step-000003", "step-000006"):
        _flip_byte(run / CHECKPOINTS / step / "optimizer.safetensors")
    code, err = _resume(run, capsys, "--resume")
    assert code == 2 and len(err) == 1, err
    assert re.fullmatch(
        r"gptkit train: error: no checkpoint of .*run can be resumed from: .*step-000006/optimizer"
        r".safetensors does not match .*; .*step-000003/optimizer.safetensors does not match .*",
        err[0],
    )
    # Another tensor file in place of the optimiser's, with a manifest that agrees: the load names it.
    shutil.rmtree(run)
    shutil.copytree(six_steps, run)
    newest = run / CHECKPOINTS / "step-000006"
    shutil.copy(newest / "rng.safetensors", newest / "optimizer.safetensors")
    write_manifest(newest)
    code, err = _resume(run, capsys, "--resume")
    assert code == 2 and len(err) == 1, err
    assert re.fullmatch(
        r"gptkit train: error: .*step-000006/optimizer.safetensors does not fit this run's optimiser "
        r"\(KeyError: .*\); is it another run's file\?",
        err[0],
    ), err


def test_a_run_killed_before_its_first_checkpoint(data_dir, tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()  # killed before config.yaml was written
    code = main(["train", "--out", str(run), "--resume", "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == [
        f"gptkit train: error: {run} has no checkpoint to resume from (the run stopped before "
        "its first checkpoint): start it again without --resume"
    ]
    (run / "metrics.jsonl").write_text('{"step": 0, "val_loss": 4.0}\n')  # a first run's step-0 line
    assert main(["train", *_cli_flags(data_dir, run, max_steps=2)]) == 0
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2]  # the restart's own step-0 line only


def test_conflicting_flags_are_one_line_usage_errors(data_dir, tmp_path, capsys):
    for alias, field in (("--data", "--train.data_dir"), ("--out", "--train.out_dir")):
        code = main(["train", alias, str(tmp_path / "a"), field, str(tmp_path / "b")])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and err == [f"gptkit train: error: {alias} and {field} both set {field[2:]}; give one of them"]


def test_the_manifest_lists_every_file_and_save_verifies(data_dir, reference):
    checkpoint = latest_checkpoint(reference)
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    files = sorted(p.name for p in checkpoint.iterdir() if p.name != "manifest.json")
    assert sorted(manifest["files"]) == files and "trainer.json" in files and manifest["checksum"] == "xxh3_64"
    for name, entry in manifest["files"].items():
        assert entry["bytes"] == (checkpoint / name).stat().st_size
    verify_checkpoint(checkpoint)


# In a private mount namespace: a small tmpfs, the run on it, then which checkpoint of the run verifies.
TMPFS_CHILD = """mount -t tmpfs -o size={size}k tmpfs {mount} || exit 99
{python} -m gptkit train {flags} 2> {err}
echo "exit $?"
{python} -c 'import sys; from gptkit.checkpoint import latest_checkpoint; print(latest_checkpoint(sys.argv[1], True))' {run}
"""


def test_a_full_tmpfs_during_a_save_is_one_line_naming_the_intact_checkpoint(data_dir, reference, tmp_path):
    """A real full disk: a tmpfs with room for about one and a half checkpoints."""
    import shlex

    mount = tmp_path / "small"
    mount.mkdir()
    namespace = ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c"]
    try:
        probe = subprocess.run(
            [*namespace, f"mount -t tmpfs -o size=64k tmpfs {mount}"], capture_output=True, timeout=60
        )
    except FileNotFoundError:
        pytest.skip("no unshare command")
    if probe.returncode != 0:
        pytest.skip("cannot mount a tmpfs here (no user namespaces)")
    one = sum(-(-p.stat().st_size // 4096) * 4 for p in latest_checkpoint(reference).iterdir())  # KiB, in pages
    out, err = mount / "run", tmp_path / "stderr.txt"
    child = TMPFS_CHILD.format(
        size=int(one * 1.5) + 32,
        mount=mount,
        python=shlex.quote(sys.executable),
        err=err,
        run=out,
        flags=" ".join(shlex.quote(f) for f in _cli_flags(data_dir, out)),
    )
    result = subprocess.run([*namespace, child], capture_output=True, text=True, timeout=300)
    assert result.stdout.startswith("exit 2\n"), (result.stdout, result.stderr, err.read_text()[-3000:])
    intact = result.stdout.splitlines()[1]  # the newest checkpoint that verifies, seen inside the namespace
    assert intact.endswith(("step-000003", "step-000006")), result.stdout
    last = err.read_text().strip().splitlines()[-1]
    assert re.fullmatch(
        r"gptkit train: error: could not (write the checkpoint of step \d|append to .*metrics.jsonl): "
        r"No space left on device.*; the last intact checkpoint is " + re.escape(intact),
        last,
    ), last


def test_compiled_model_checkpoints_without_orig_mod(data_dir, tmp_path, monkeypatch):
    # The eager backend still wraps the model in OptimizedModule (the source of `_orig_mod.`) but skips codegen.
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    out = tmp_path / "run"
    train(tiny(data_dir, out, max_steps=3, compile=True), progress=False)
    train(tiny(data_dir, out, max_steps=4, compile=True), resume=True, progress=False)
    latest = latest_checkpoint(out)
    for file in ("model.safetensors", "optimizer.safetensors"):
        names = load_tensors(latest / file)
        assert names and not [n for n in names if "_orig_mod" in n], file
    assert load_model_dir(latest).config.n_layer == 2


def test_prune_orders_checkpoints_by_step_number_past_six_digits(tmp_path):
    from gptkit.checkpoint import TRAINER_FILE, prune

    steps = [998_000, 999_000, 1_000_000, 1_001_000]
    for step in steps:
        (tmp_path / CHECKPOINTS / f"step-{step:06d}").mkdir(parents=True)
        (tmp_path / CHECKPOINTS / f"step-{step:06d}" / TRAINER_FILE).write_text("{}")
    (tmp_path / "latest").write_text(f"{CHECKPOINTS}/step-1001000")
    prune(tmp_path, keep=2)
    assert sorted(p.name for p in (tmp_path / CHECKPOINTS).iterdir()) == ["step-1000000", "step-1001000"]


def test_data_of_another_tokenizer_with_as_many_ids_is_refused(data_dir, reference, tmp_path):
    from gptkit.errors import InputError

    (tmp_path / "other").mkdir()
    other = write_char_data_dir(tmp_path / "other", 60_000)
    alphabet = load_tokenizer(data_dir).chars
    (other / "gptkit_tokenizer.json").write_text(
        json.dumps(
            {
                "format": "gptkit-tokenizer",
                "format_version": 1,
                "kind": "char",
                "chars": "".join(reversed(alphabet)),
                "specials": [],
            }
        )
    )
    config = tiny(other, tmp_path / "ft", max_steps=1)
    config.model.init_from = str(latest_checkpoint(reference))
    with pytest.raises(InputError, match="different tokenizer"):
        train(config, progress=False)
    shutil.copytree(reference, tmp_path / "run")
    with pytest.raises(InputError, match="different tokenizer"):  # resuming a run on such data
        train(tiny(other, tmp_path / "run", max_steps=9), resume=True, progress=False)


def test_fine_tune_from_model_dir(data_dir, reference, tmp_path):
    config = tiny(data_dir, tmp_path / "ft", max_steps=1)
    config.model.fields = {"dropout": 0.0}
    config.model.init_from = str(latest_checkpoint(reference))
    result = train(config, progress=False)
    before = weights(latest_checkpoint(reference))
    after = weights(result.checkpoint)
    assert load_model_dir(result.checkpoint).config.dropout == 0.0
    # One small step from the reference weights: close to them, but not equal.
    assert all(torch.allclose(before[k], after[k], atol=0.05) for k in before)
    assert not all(torch.equal(before[k], after[k]) for k in before)


def test_bfloat16_autocast_with_gradient_accumulation(data_dir, tmp_path, device):
    runs = {}
    for dtype in ("float32", "bfloat16"):
        config = tiny(data_dir, tmp_path / dtype, max_steps=4, dtype=dtype, grad_accum=2, device=device.type)
        config.model.fields["dropout"] = 0.0  # the same masks in both runs
        result = train(config, progress=False)
        assert result.step == 4 and result.skipped_steps == 0
        runs[dtype] = losses(result.run_dir)
    assert weights(result.checkpoint)["tok_emb.weight"].dtype == torch.float32  # autocast keeps fp32 master weights
    # bf16 keeps 8 significant bits: one rounding moves a number by up to 2^-8 of it. The losses, and the first
    # step's gradient norm (of both micro-batches, averaged: a lost or unscaled micro-batch shows here), agree with
    # fp32's within that (measured on CPU: losses within 1.2e-5, the gradient norm within 1.5e-4).
    fp32, bf16 = runs["float32"], runs["bfloat16"]
    assert fp32.keys() == bf16.keys() == {1, 2, 3, 4}
    for step in fp32:
        assert bf16[step][0] == pytest.approx(fp32[step][0], rel=2**-8), step
    assert bf16[1][1] == pytest.approx(fp32[1][1], rel=2**-8)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_muon_trains_in_every_precision(data_dir, tmp_path, device, dtype):
    if dtype == "float16" and device.type != "cuda":
        pytest.skip("float16 trains with a gradient scaler, which needs CUDA")
    config = tiny(data_dir, tmp_path / dtype, max_steps=6, dtype=dtype, grad_accum=2, device=device.type)
    config.model.fields["dropout"] = 0.0
    config.optim.name = "muon"
    result = train(config, progress=False)
    assert result.step == 6 and result.skipped_steps == 0
    run = losses(result.run_dir)
    assert all(math.isfinite(loss) for loss, _, _ in run.values())
    assert run[6][0] < run[1][0] - 0.1  # measured on the CPU: 4.069 -> 3.902 in fp32 and in bf16


def test_tensorboard_logs_the_same_metrics(data_dir, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = train(tiny(data_dir, tmp_path / "tb", tensorboard=True), progress=False).run_dir
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    logged = {e.step: e.value for e in events.Scalars("loss")}
    assert logged.keys() == {step for step in losses(run_dir) if step > 0}
    for step, (loss, _, _) in losses(run_dir).items():
        assert logged[step] == pytest.approx(loss, rel=1e-6)
    assert [e.step for e in events.Scalars("val_loss")] == [0, 4, 8]


def test_mfu_peak_is_measured_on_cpu_and_overridable():
    fp32 = measured_cpu_matmul_flops(torch.float32)
    assert 1e8 < fp32 < 1e14  # a real CPU's matmul, not a constant: from 0.1 GFLOP/s to 100 TFLOP/s
    assert peak_flops(torch.device("cpu"), "float32", 5e12) == 5e12
    assert peak_flops(torch.device("meta"), "float32", None) is None  # unknown devices show no MFU


def test_mfu_peak_of_a_known_gpu_is_its_datasheet_rate(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    assert peak_flops(torch.device("cuda"), "bfloat16", None) == 989.4e12  # dense, without sparsity
    assert peak_flops(torch.device("cuda"), "float16", None) == 989.4e12
    assert peak_flops(torch.device("cuda"), "float32", None) == 66.9e12  # no TF32: PyTorch leaves it off
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some Future GPU")
    assert peak_flops(torch.device("cuda"), "bfloat16", None) is None


def test_float16_with_its_gradient_scaler_follows_float32_and_resumes_exactly(data_dir, tmp_path, device):
    config = tiny(data_dir, tmp_path / "run", max_steps=4, dtype="float16", device=device.type)
    if device.type != "cuda":
        with pytest.raises(ConfigError, match="float16 needs CUDA"):
            train(config, progress=False)
        return
    runs = {}
    for dtype in ("float32", "float16"):
        config = tiny(data_dir, tmp_path / dtype, max_steps=4, dtype=dtype, grad_accum=2, device="cuda")
        config.model.fields["dropout"] = 0.0  # fp16 and fp32 tensors may draw their dropout masks differently
        result = train(config, progress=False)
        assert result.step == 4 and result.skipped_steps == 0
        runs[dtype] = losses(result.run_dir)
    # GradScaler starts at 2^16, halves at every overflow and grows only after 2,000 clean steps: still 2^16 means no
    # update of the four was skipped, so both runs made the same updates.
    assert json.loads((result.checkpoint / "trainer.json").read_text())["scaler"]["scale"] == 2.0**16
    # fp16 keeps 11 significant bits: one rounding moves a number by up to 2^-11 of it. The losses stay within one
    # rounding of fp32's; the first step's gradient norm (unscaled, of both micro-batches) within two, as backward
    # rounds each gradient once per layer it crosses. Measured with CPU autocast to fp16 and a CPU GradScaler on
    # these runs: losses within 1.1e-6 of fp32's, the gradient norm within 1.2e-4 (2^-10 is 9.8e-4); the scale
    # stayed 2^16.
    fp32, fp16 = runs["float32"], runs["float16"]
    assert fp32.keys() == fp16.keys() == {1, 2, 3, 4}
    for step in fp32:
        assert fp16[step][0] == pytest.approx(fp32[step][0], rel=2**-11), step
    assert fp16[1][1] == pytest.approx(fp32[1][1], rel=2**-10)
    # Exact resume: the scaler's state (scale, growth tracker) travels with the checkpoint, with dropout's generator.
    whole = train(tiny(data_dir, tmp_path / "whole", max_steps=6, dtype="float16", device="cuda"), progress=False)
    train(tiny(data_dir, tmp_path / "part", max_steps=4, dtype="float16", device="cuda"), progress=False)
    resumed = train(
        tiny(data_dir, tmp_path / "part", max_steps=6, dtype="float16", device="cuda"), resume=True, progress=False
    )
    assert resumed.step == 6 and losses(resumed.run_dir).keys() == losses(whole.run_dir).keys() == set(range(1, 7))
    torch.testing.assert_close(losses(resumed.run_dir), losses(whole.run_dir), **same_run(device))
    scalers = [json.loads((r.checkpoint / "trainer.json").read_text())["scaler"] for r in (resumed, whole)]
    assert scalers[0] == scalers[1]
    torch.testing.assert_close(weights(resumed.checkpoint), weights(whole.checkpoint), **same_run(device))


def test_a_device_run_resumes_on_the_cpu_and_back(data_dir, tmp_path, device):
    """A checkpoint written on the device loads on the CPU (weights, AdamW moments) and back, and the run goes on."""

    def run(max_steps: int, on: str, resume: bool, out: Path):
        config = tiny(data_dir, out, max_steps=max_steps, device=on)
        config.model.fields["dropout"] = 0.0  # the CPU's and a GPU's dropout draw differently
        return train(config, resume=resume, progress=False)

    whole = run(8, device.type, False, tmp_path / "whole")
    run(3, device.type, False, tmp_path / "moved")
    run(5, "cpu", True, tmp_path / "moved")
    moved = run(8, device.type, True, tmp_path / "moved")
    got, want = losses(moved.run_dir), losses(whole.run_dir)
    assert got.keys() == want.keys() == set(range(1, 9))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)  # the CPU's kernels round differently
    on_cpu, _ = load(moved.checkpoint)
    on_device, _ = load(moved.checkpoint, device=device)
    ids = torch.randint(0, on_cpu.config.vocab_size, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(on_device(ids.to(device)).cpu(), on_cpu(ids), atol=1e-5, rtol=1e-5)


def test_compiled_training_follows_eager(data_dir, tmp_path, device):
    runs = {}
    for compile in (False, True):
        config = tiny(data_dir, tmp_path / f"compile-{compile}", max_steps=3, device=device.type, compile=compile)
        config.model.fields["dropout"] = 0.0  # compiled dropout draws its masks differently
        runs[compile] = losses(train(config, progress=False).run_dir)
    torch.testing.assert_close(runs[True], runs[False], atol=1e-5, rtol=1e-4)
