"""gptkit train: exact resume (also after kill -9 and SIGTERM), fault skipping, checkpoints, compile, config errors."""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from gptkit.checkpoint import CHECKPOINTS, latest_checkpoint
from gptkit.modeldir import load_model_dir, load_tensors
from gptkit.tokenizer import load_tokenizer
from gptkit.train import TrainingStopped, measured_cpu_matmul_flops, peak_flops, train
from gptkit.train_config import from_sources

from conftest import write_char_data_dir

TINY_MODEL = {"n_layer": 2, "n_head": 2, "n_embd": 16, "block_size": 16, "dropout": 0.1, "activation": "gelu"}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    """A char-level data directory from the first 60k characters of the bundled corpus."""
    return write_char_data_dir(tmp_path_factory.mktemp("data"), 60_000)


def tiny(data_dir: Path, out: Path, **train_overrides):
    """A few-step run of a 2-layer, 16-wide model with dropout (so the RNG state matters for resume)."""
    settings = dict(data_dir=str(data_dir), out_dir=str(out), max_steps=8, batch_size=4, eval_interval=4,
                    eval_iters=2, log_interval=1, checkpoint_interval=3, device="cpu", plot=False)  # fmt: skip
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


def _wait_for_step(run_dir: Path, process: subprocess.Popen, at_least: int, timeout: float = 120) -> int:
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


def test_kill9_and_sigterm_then_resume_are_bit_identical(data_dir, tmp_path):
    steps = 150
    ref, out = tmp_path / "ref", tmp_path / "run"
    settings = dict(max_steps=steps, checkpoint_interval=7, eval_interval=100)
    train(tiny(data_dir, ref, **settings), progress=False)
    flags = ["--data", str(data_dir), "--out", str(out), "--quiet", "--train.device", "cpu",
             "--train.max_steps", str(steps), "--train.batch_size", "4", "--train.eval_interval", "100",
             "--train.eval_iters", "2", "--train.log_interval", "1", "--train.checkpoint_interval", "7",
             "--train.plot", "false", "--optim.warmup_steps", "2", "--optim.decay_steps", "8", "--optim.lr", "3e-3"]
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

    train(tiny(data_dir, out, **settings), resume=True, progress=False)
    assert losses(out) == losses(ref)
    assert len(losses(out)) == steps
    assert_same_weights(latest_checkpoint(out), latest_checkpoint(ref))


def _poisoned_loss(monkeypatch, bad_steps: set[int]) -> None:
    """Make the training loss (not the evaluation loss) NaN at the given 1-based steps."""
    import gptkit.model

    real = gptkit.model.linear_cross_entropy
    calls = {"n": 0}

    def loss(*args):
        value = real(*args)
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


def test_failed_checkpoint_write_leaves_latest_intact(data_dir, tmp_path, monkeypatch):
    import gptkit.checkpoint

    out = tmp_path / "run"
    real = gptkit.checkpoint.save_tensors
    calls = {"n": 0}

    def failing(tensors, path, metadata=None):
        calls["n"] += path.name == "optimizer.safetensors"
        if calls["n"] == 2:  # the second checkpoint dies half-written
            raise OSError("disk full")
        return real(tensors, path, metadata)

    monkeypatch.setattr(gptkit.checkpoint, "save_tensors", failing)
    with pytest.raises(OSError, match="disk full"):
        train(tiny(data_dir, out), progress=False)
    assert latest_checkpoint(out).name == "step-000003"
    load_model_dir(latest_checkpoint(out))
    assert sorted(p.name for p in (out / CHECKPOINTS).iterdir()) == ["step-000003"]


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
    (other / "gptkit_tokenizer.json").write_text(json.dumps({
        "format": "gptkit-tokenizer", "format_version": 1, "kind": "char", "chars": "".join(reversed(alphabet)),
        "specials": []}))  # fmt: skip
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


def test_bfloat16_autocast_with_gradient_accumulation(data_dir, tmp_path):
    result = train(tiny(data_dir, tmp_path / "run", max_steps=4, dtype="bfloat16", grad_accum=2), progress=False)
    records = losses(tmp_path / "run")
    assert result.step == 4 and result.skipped_steps == 0
    assert all(np.isfinite(loss) for loss, _, _ in records.values())
    assert weights(result.checkpoint)["tok_emb.weight"].dtype == torch.float32  # autocast keeps fp32 master weights


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
