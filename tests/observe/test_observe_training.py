"""Watching a run learn: samples at evaluations (samples.jsonl), the ICL and induction measures in metrics.jsonl,
loss.png's panels, and the same samples from the same run, twice or resumed after a kill."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
from helpers import write_char_data_dir

from gptkit.checkpoint import CHECKPOINTS
from gptkit.data import Examples
from gptkit.errors import ConfigError
from gptkit.observe.samples import SAMPLES_FILE, example_prompts, read_samples
from gptkit.run_sources import add_flags, flag_overrides, from_sources
from gptkit.tokenizer import load_tokenizer
from gptkit.train import train

TINY_MODEL = {"n_layer": 2, "n_head": 2, "n_embd": 16, "block_size": 16, "dropout": 0.1, "activation": "gelu"}
MEASURES = ("icl_score", "induction_score", "induction_loss")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    return write_char_data_dir(tmp_path_factory.mktemp("data"), 30_000)


def tiny(data_dir: Path, out: Path, **train_overrides):
    """An 8-step run evaluating at steps 0, 4 and 8 (dropout on: the global RNG matters for resume)."""
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
        sample_tokens=12,
    )
    settings.update(train_overrides)
    optim = {"warmup_steps": 2, "decay_steps": 8, "lr": 3e-3}
    return from_sources(None, {"model": dict(TINY_MODEL), "optim": optim, "train": settings})


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def reference(data_dir, tmp_path_factory) -> Path:
    """An unbroken run with the defaults (validation prompts, observe on) and loss.png."""
    out = tmp_path_factory.mktemp("ref") / "run"
    train(tiny(data_dir, out, plot=True), progress=False)
    return out


def test_samples_at_each_evaluation_from_validation_windows(data_dir, reference):
    samples = read_samples(reference / SAMPLES_FILE)
    assert [s["step"] for s in samples] == [0] * 4 + [4] * 4 + [8] * 4  # 2 prompts x (greedy, sampled)
    assert [s["kind"] for s in samples[:4]] == ["greedy", "greedy", "sampled", "sampled"]
    tokenizer = load_tokenizer(data_dir)
    val_text = tokenizer.decode(np.fromfile(data_dir / "val.bin", dtype=np.uint16).tolist())
    prompts = {s["prompt"] for s in samples}
    assert len(prompts) == 2 and all(p in val_text and len(p) == 8 for p in prompts)  # block 16: 8-token prompts
    assert all(0 < len(s["completion"]) <= 12 for s in samples)  # char tokens: at most sample_tokens characters


def test_the_same_run_twice_gives_the_same_samples(data_dir, reference, tmp_path):
    train(tiny(data_dir, tmp_path / "again"), progress=False)
    assert read_samples(tmp_path / "again" / SAMPLES_FILE) == read_samples(reference / SAMPLES_FILE)
    other = tmp_path / "other-seed"
    train(tiny(data_dir, other, seed=7), progress=False)  # a different run samples differently
    assert read_samples(other / SAMPLES_FILE) != read_samples(reference / SAMPLES_FILE)


def test_a_killed_and_resumed_run_gives_the_same_samples(data_dir, reference, tmp_path):
    run = tmp_path / "run"
    train(tiny(data_dir, run), progress=False)
    # A kill after step 8's evaluation wrote its samples but before its checkpoint: resume redoes steps 7 and 8.
    shutil.rmtree(run / CHECKPOINTS / "step-000008")
    (run / "latest").write_text("checkpoints/step-000006\n")
    assert sum(s["step"] == 8 for s in read_samples(run / SAMPLES_FILE)) == 4
    train(tiny(data_dir, run), resume=True, progress=False)
    assert read_samples(run / SAMPLES_FILE) == read_samples(reference / SAMPLES_FILE)
    # what a live page reads: step 8's measures once, the same as the uninterrupted run's
    assert (run / "insight.jsonl").read_text() == (reference / "insight.jsonl").read_text()
    losses = lambda d: [(m["step"], m.get("loss"), m.get("icl_score")) for m in metrics(d)]  # noqa: E731
    assert losses(run) == losses(reference)  # sampling and measuring left the global RNG alone


def test_observing_leaves_training_unchanged(data_dir, reference, tmp_path):
    run = tmp_path / "run"
    train(tiny(data_dir, run, observe=False, sample_every=0), progress=False)
    losses = lambda d: [(m["step"], m.get("loss"), m.get("val_loss")) for m in metrics(d)]  # noqa: E731
    assert losses(run) == losses(reference)  # dropout draws from the global RNG: samples and measures must not


def test_configured_prompts_every_second_evaluation(data_dir, tmp_path):
    run = tmp_path / "run"
    train(
        tiny(
            data_dir,
            run,
            eval_interval=2,
            max_steps=7,
            sample_every=2,
            sample_prompts=["ROMEO:", "To be"],
            sample_tokens=5,
        ),
        progress=False,
    )
    samples = read_samples(run / SAMPLES_FILE)
    assert [s["step"] for s in samples] == [0] * 4 + [4] * 4 + [7] * 4  # evaluations at 0, 2, 4, 6, 7
    assert [s["prompt"] for s in samples[:4]] == ["ROMEO:", "To be"] * 2
    assert all(len(s["completion"]) == 5 for s in samples)


def test_measures_logged_at_evaluations_and_drawn(reference):
    records = metrics(reference)
    evals = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in evals] == [0, 4, 8]
    for record in evals:
        assert all(np.isfinite(record[key]) for key in MEASURES), record
        assert 0 <= record["induction_score"] <= 1 and record["induction_loss"] > 0
    assert not any(key in r for r in records if "val_loss" not in r for key in MEASURES)
    from PIL import Image

    assert Image.open(reference / "loss.png").size == (700, 1075)  # losses, ICL, induction, ablation
    assert all(np.isfinite(r["ablation_repeat_change"]) and np.isfinite(r["ablation_icl_change"]) for r in evals)
    insight = [json.loads(line) for line in (reference / "insight.jsonl").read_text().splitlines()]
    assert [line["step"] for line in insight] == [0, 4, 8]
    config = TINY_MODEL  # (the model of these runs)
    for line, record in zip(insight, evals):
        assert np.asarray(line["induction"]).shape == (config["n_layer"], config["n_head"])
        assert max(map(max, line["induction"])) == pytest.approx(record["induction_score"])
        assert len(line["position_loss"]) == config["block_size"]
        ablation = line["ablation"]
        assert [h["head"] for h in ablation["layer_heads"]] == list(range(config["n_head"]))
        assert ablation["repeat_change"] == record["ablation_repeat_change"]


def test_observe_false_and_sample_every_0_leave_them_out(data_dir, tmp_path):
    run = tmp_path / "run"
    train(tiny(data_dir, run, observe=False, sample_every=0, plot=True, max_steps=4), progress=False)
    assert not any(key in r for r in metrics(run) for key in MEASURES)
    assert not (run / SAMPLES_FILE).exists()
    from PIL import Image

    assert Image.open(run / "loss.png").size == (700, 400)  # the loss panel alone


def test_a_run_without_tokenizer_skips_samples_in_one_line(tmp_path, caplog):
    data = tmp_path / "data"
    data.mkdir()
    ids = np.random.default_rng(0).integers(0, 40, 5000).astype(np.uint16)
    ids[:4500].tofile(data / "train.bin")
    ids[4500:].tofile(data / "val.bin")
    (data / "meta.json").write_text(
        json.dumps({"vocab_size": 40, "dtype": "uint16", "train_tokens": 4500, "val_tokens": 500, "tokenizer": "none"})
    )
    with caplog.at_level(logging.INFO, logger="gptkit"):
        train(tiny(data, tmp_path / "run", max_steps=4), progress=False)
    assert [r.getMessage() for r in caplog.records if "samples" in r.getMessage()] == [
        "no samples during training: the run's data has no tokenizer"
    ]
    assert not (tmp_path / "run" / SAMPLES_FILE).exists()
    assert all(key in metrics(tmp_path / "run")[0] for key in MEASURES)  # the measures need no tokenizer


def test_example_prompts_are_the_untrained_prefixes():
    ids = np.arange(12, dtype=np.uint16)
    trained = np.array([0, 0, 1, 1, 1, 1, 1, 0, 0, 0, 1, 1], dtype=np.uint8)  # prefix 2, none trained, prefix 3
    examples = Examples(ids, trained, np.array([0, 4, 7, 12]))
    assert example_prompts(examples, block_size=16) == [[0, 1], [7, 8, 9]]
    assert example_prompts(examples, block_size=3) == [[0, 1]]  # a prompt must be shorter than the block


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"sample_tokens": 0}, "train.sample_tokens must be >= 1, got 0"),
        ({"sample_every": -1}, "train.sample_every must be >= 0 (0 takes no samples), got -1"),
        (
            {"sample_prompts": []},
            "train.sample_prompts is empty: give at least one prompt, or null for validation "
            "prompts (train.sample_every 0 turns samples off)",
        ),
        ({"sample_prompts": ["a", ""]}, "train.sample_prompts must be a list of non-empty strings, got ['a', '']"),
        (
            {"sample_prompts": ["ROMEO:", 3]},
            "train.sample_prompts must be a list of strings or null, got ['ROMEO:', 3]",
        ),
    ],
)
def test_bad_sample_settings_are_one_line_errors(data_dir, tmp_path, overrides, message):
    with pytest.raises(ConfigError) as err:
        train(tiny(data_dir, tmp_path / "run", **overrides), progress=False)
    assert str(err.value) == message


def test_a_sample_prompt_longer_than_the_block_is_an_error(data_dir, tmp_path):
    with pytest.raises(
        ConfigError,
        match=r"^train.sample_prompts\[0\] is 20 tokens; it must be shorter than the "
        r"model's block_size 16$",
    ):
        train(tiny(data_dir, tmp_path / "run", sample_prompts=["x" * 20]), progress=False)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_sample_prompts_flag_takes_one_prompt_or_a_list():
    import argparse

    parser = argparse.ArgumentParser()
    add_flags(parser)
    one = flag_overrides(parser.parse_args(["--train.sample_prompts", "ROMEO:"]))
    many = flag_overrides(parser.parse_args(["--train.sample_prompts", '["ROMEO:", "JULIET:"]']))
    assert from_sources(None, one).train.sample_prompts == ["ROMEO:"]
    assert from_sources(None, many).train.sample_prompts == ["ROMEO:", "JULIET:"]


@pytest.mark.parametrize(
    "parallel", ["ddp", pytest.param("fsdp", marks=pytest.mark.slow)]
)  # the rank logic is the same; FSDP's run costs 5 s
def test_under_two_processes_rank_0_alone_samples_and_measures(data_dir, tmp_path, parallel):
    from tests.train.test_distributed import settings, torchrun

    run = tmp_path / parallel
    torchrun(settings(data_dir, run, parallel=parallel, sample_every=1, sample_tokens=6))
    evals = [r for r in metrics(run) if "val_loss" in r]
    if parallel == "ddp":  # once each: rank 1 neither writes nor samples
        assert [s["step"] for s in read_samples(run / SAMPLES_FILE)] == [0] * 4 + [6] * 4
        assert all(np.isfinite(r[key]) for r in evals for key in MEASURES)
    else:  # FSDP's weights are sharded: neither is taken (one log line says so)
        assert not (run / SAMPLES_FILE).exists() and not any(key in r for r in evals for key in MEASURES)


def test_supervised_examples_sample_their_validation_prompts(tmp_path):
    from helpers import byte_model_dir, reversal_rows, write_jsonl

    from gptkit.cli import main
    from tests.finetune.test_finetune import _run_config

    base = byte_model_dir(tmp_path / "base")
    rows = write_jsonl(tmp_path / "chat.jsonl", reversal_rows(60))
    assert main(["prepare", "--input", str(rows), "--tokenizer", str(base), "--out", str(tmp_path / "data")]) == 0
    run = tmp_path / "run"
    train(
        _run_config(tmp_path / "data", run, base, train={"max_steps": 3, "sample_every": 1, "sample_tokens": 4}),
        progress=False,
    )
    samples = read_samples(run / SAMPLES_FILE)
    assert [s["step"] for s in samples] == [0] * 4 + [3] * 4
    # The prompt is the rendered conversation up to the reply: the question, not the answer.
    assert all("Reverse: " in s["prompt"] and s["prompt"].endswith("assistant:") for s in samples), samples[0]
    assert not any(key in r for r in metrics(run) for key in MEASURES)  # the measures read a text split


def test_olssons_map_draws_each_evaluation_at_its_step_and_each_position_on_a_log_axis():
    from matplotlib.figure import Figure

    from gptkit.observe.training import draw_position_map, mark_phase

    insight = [
        {"step": 0, "position_loss": [4.0, 3.0, 2.0]},
        {"step": 100, "position_loss": [4.0, 2.5, None]},
        {"step": 300, "position_loss": [3.5, 1.0, 0.5]},
        {"step": 350},
    ]
    figure = Figure()
    panels = figure.subplots(2, 1, sharex=True)
    draw_position_map(panels[1], insight)
    mesh = panels[1].collections[0]
    # Columns span halfway to their neighbours (the first and last as far out as their one neighbour's gap).
    assert mesh.get_coordinates()[0, :, 0].tolist() == [-50.0, 50.0, 200.0, 400.0]
    assert mesh.get_coordinates()[:, 0, 1].tolist() == [1.0, 2.0, 3.0, 4.0]  # position p spans p + 1 to p + 2
    values = np.ma.filled(mesh.get_array(), np.nan).reshape(3, 3)  # (positions, evaluations)
    np.testing.assert_array_equal(values, [[4.0, 4.0, 3.5], [3.0, 2.5, 1.0], [2.0, np.nan, 0.5]])
    assert panels[1].get_yscale() == "log"
    mark_phase(panels, [{"step": 100, "phase_change_step": 150}, {"step": 300, "phase_change_step": 250}])
    for axes in panels:
        assert [line.get_xdata()[0] for line in axes.lines] == [250]  # where it was last located
    assert panels[0].get_title() == "phase change (the ICL score's fastest fall): step 250"
