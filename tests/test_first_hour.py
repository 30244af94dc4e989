"""The frictions a newcomer met in the first hour (issue 44): each one as it should now be."""

from __future__ import annotations

import importlib.util
import json
import logging
import re
import socket
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import write_char_data_dir
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from gptkit.cli import build_parser, main
from gptkit.config import ModelConfig
from gptkit.devices import gpu_recipe_on_cpu
from gptkit.formats.modeldir import save_model_dir
from gptkit.model import GPT
from gptkit.observe.figures import draw_induction
from gptkit.observe.report import icl_picture
from gptkit.observe.training import Observer, _draw_losses, plot_run
from gptkit.run_sources import from_sources
from gptkit.tokenizer import CharTokenizer
from gptkit.train import Trainer, train
from gptkit.train_config import TrainConfig

ROOT = Path(__file__).resolve().parents[1]
TEXT = (ROOT / "gptkit" / "corpora" / "tinyshakespeare.txt").read_text()[:4000]
MODEL = {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 16, "dropout": 0.0}


def tiny_model_dir(path: Path) -> Path:
    tokenizer = CharTokenizer.train([TEXT])
    torch.manual_seed(0)
    return save_model_dir(GPT(ModelConfig(vocab_size=tokenizer.vocab_size, **MODEL)), path, tokenizer=tokenizer)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A finished 4-step run (checkpoints at steps 2 and 4) with its metrics and samples."""
    root = tmp_path_factory.mktemp("first-hour")
    data = write_char_data_dir(root, 20_000)
    settings = {
        "model": dict(MODEL),
        "optim": {"warmup_steps": 1},
        "train": {
            "data_dir": str(data),
            "out_dir": str(root / "run"),
            "max_steps": 4,
            "batch_size": 4,
            "eval_interval": 2,
            "eval_iters": 1,
            "log_interval": 1,
            "checkpoint_interval": 2,
            "device": "cpu",
            "sample_tokens": 8,
        },
    }
    return train(from_sources(None, settings), progress=False).run_dir


def test_generate_ends_its_output_with_a_newline(tmp_path, capsys):
    model_dir = tiny_model_dir(tmp_path / "m")
    assert main(["generate", str(model_dir), "--prompt", "ROMEO:", "--max-new-tokens", "5", "--stop", "\n"]) == 0
    out = capsys.readouterr().out
    assert out.endswith("\n") and out.count("\n") == 1  # (a stop at a newline prints none of its own)


def test_a_run_directory_or_its_latest_file_means_its_newest_checkpoint(run_dir, capsys):
    for given in (run_dir, run_dir / "latest"):
        assert main(["generate", str(given), "--prompt", "ROMEO:", "--max-new-tokens", "3"]) == 0
        err = capsys.readouterr().err
        assert f"using its newest checkpoint, {run_dir / 'checkpoints' / 'step-000004'}" in err


def test_a_missing_checkpoint_lists_those_that_exist(run_dir, capsys):
    assert main(["generate", str(run_dir / "checkpoints" / "step-2000"), "--prompt", "a"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "does not exist" in err and "holds step-000002, step-000004" in err


def test_eval_given_a_data_file_names_its_directory_not_a_prepare_into_it(run_dir, capsys):
    data = run_dir.parent  # the fixture's data directory
    assert main(["eval", str(run_dir), "--data", str(data / "val.bin")]) == 2
    err = capsys.readouterr().err
    assert f"give the prepared data directory that holds it ({data})" in err and "prepare --out" not in err


def test_serve_finds_a_busy_port_before_loading_the_model(tmp_path, capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", str(tmp_path / "not-loaded"), "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port}" in err and "loading" not in err and err.count("\n") == 1


def test_prepare_says_what_rows_it_recognised(tmp_path, capsys):
    pairs = [{"prompt": f"Q{i}?", "chosen": "yes.", "rejected": "no"} for i in range(10)]
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in pairs))
    labelled = [{"text": f"text {i}", "label": "odd" if i % 2 else "even"} for i in range(10)]
    (tmp_path / "labels.jsonl").write_text("".join(json.dumps(r) + "\n" for r in labelled))
    for name in ("pairs", "labels"):
        assert (
            main(
                [
                    "prepare",
                    "--input",
                    str(tmp_path / f"{name}.jsonl"),
                    "--tokenizer",
                    "byte",
                    "--out",
                    str(tmp_path / name),
                    "--val-fraction",
                    "0.2",
                ]
            )
            == 0
        )
    out = capsys.readouterr().out.splitlines()
    assert "recognised prompt/chosen/rejected rows: 10 preference pairs (train 8, val 2)" in out[0]
    assert "recognised text/label rows: 10 labelled texts of the labels even, odd (train 8, val 2)" in out[1]


def test_a_run_without_validation_prompts_says_nothing_about_samples(tmp_path, caplog):
    model = GPT(ModelConfig(vocab_size=20, **MODEL))
    with caplog.at_level(logging.DEBUG, logger="gptkit"):
        Observer(TrainConfig(), tmp_path, model, CharTokenizer.train(["abc"]), None, None, "classify", True, False)
    assert "no samples" not in "".join(r.getMessage() for r in caplog.records if r.levelno >= logging.INFO)


def test_the_loss_panel_is_scaled_to_the_training_curves(run_dir):
    history = [
        {
            "step": s,
            "loss": 4.0 - s / 1000,
            "val_loss": 4.1 - s / 1000,
            "induction_loss": 4.2 + s / 500,
            "icl_score": -0.001 * s,
            "induction_score": 0.02,
            "induction_chance": 0.021,
        }
        for s in range(0, 2001, 250)
    ]
    figure = Figure()
    axes = figure.add_subplot()
    _draw_losses(axes, history)
    assert axes.get_ylim()[1] < 4.5  # the repeated half's 8.2 is drawn beside the induction score instead
    plot_run(history, run_dir / "plot-check.png")
    assert (run_dir / "plot-check.png").stat().st_size > 0


def test_the_induction_picture_turns_colour_at_the_chance_level():
    scores = torch.tensor([[0.0, 0.02], [0.021, 0.9]])
    figure = draw_induction(scores, chance=0.021)
    image = figure.axes[0].images[0]
    colours = image.cmap(image.norm(scores.numpy()))
    white = np.array([image.cmap(0.5)[:3]])
    assert np.abs(colours[1, 0, :3] - white).max() < 0.02  # chance: the middle of the scale
    assert np.abs(colours[0, 0, :3] - colours[1, 0, :3]).max() > 0.3  # 0 and chance are told apart


def test_the_icl_pictures_titles_fit_the_figure():
    tokenizer = CharTokenizer.train([TEXT])
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=tokenizer.vocab_size, **dict(MODEL, block_size=64))).eval()
    data = np.asarray(tokenizer.encode(TEXT), dtype=np.int64)
    figure, *_ = icl_picture(model, tokenizer, "ROMEO: But soft", "cat cat\ndog dog\nsun ", data, 48)
    FigureCanvasAgg(figure)
    figure.canvas.draw()
    for axes in figure.axes:
        box = axes.title.get_window_extent()
        assert not axes.title.get_text() or (box.x0 >= 0 and box.x1 <= figure.bbox.x1), axes.title.get_text()


def test_every_train_flag_has_a_description():
    parser = build_parser(["train"])
    train_parser = next(a for a in parser._actions if a.dest == "command").choices["train"]
    flags = [a for a in train_parser._actions if a.dest.startswith("cfg:")]
    assert len(flags) > 80
    for action in flags:
        description = action.help.split("; ")[0]
        assert "; " in action.help and len(description) > 8, action.option_strings


def test_a_gpu_recipe_on_a_cpu_warns_with_what_it_costs(tmp_path, caplog):
    data = write_char_data_dir(tmp_path, 20_000)
    settings = {
        "model": dict(MODEL),
        "train": {
            "data_dir": str(data),
            "out_dir": str(tmp_path / "run"),
            "device": "auto",
            "dtype": "bfloat16",
            "max_steps": 100,
        },
    }
    if torch.cuda.is_available() or torch.backends.mps.is_available():
        pytest.skip("auto finds an accelerator here")
    with caplog.at_level(logging.WARNING, logger="gptkit"):
        Trainer(from_sources(None, settings), resume=False)
    assert re.search(r"set up for a GPU \(device auto, dtype bfloat16\) .* FLOPs, at least \d+ s", caplog.text)
    assert gpu_recipe_on_cpu("cpu", torch.device("cpu"), "bfloat16", True, 1e12, 1e9) is None  # asked for a CPU
    assert gpu_recipe_on_cpu("auto", torch.device("cpu"), "float32", False, 1e12, 1e9) is None  # a CPU recipe
    assert "at least 17 min" in gpu_recipe_on_cpu("auto", torch.device("cpu"), "float32", True, 1e12, 1e9)
    # dtype auto trains in bfloat16 on a CPU only where that is faster: nothing to warn about, unless compiled.
    assert gpu_recipe_on_cpu("auto", torch.device("cpu"), "auto", False, 1e12, 1e9) is None
    assert "(device auto, compile)" in gpu_recipe_on_cpu("auto", torch.device("cpu"), "auto", True, 1e12, 1e9)


def test_make_run_installs_no_test_extras_and_shows_its_progress(tmp_path):
    plan = subprocess.run(
        ["make", "-n", "-C", str(ROOT), "run", f"VENV={tmp_path / 'venv'}"], capture_output=True, text=True, check=True
    ).stdout
    installs = [line for line in plan.splitlines() if " install " in line]
    assert installs and not any("[test]" in line for line in installs)
    assert not any("--quiet" in line for line in installs if "torch" in line or "-e ." in line)


def load_watch_it_learn():
    spec = importlib.util.spec_from_file_location("watch_it_learn", ROOT / "examples" / "watch_it_learn.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_watch_it_learn_draws_into_its_run_and_scales_the_schedule(run_dir, monkeypatch, capsys):
    watch = load_watch_it_learn()
    flags = watch.scaled_schedule(500)
    # The recipe: 8000 steps, warm-up 50, decay over 8000, evaluations every 100, a checkpoint at the end.
    assert flags == [
        "--train.max_steps",
        "500",
        "--optim.warmup_steps",
        "3",
        "--optim.decay_steps",
        "500",
        "--train.eval_interval",
        "6",
        "--train.checkpoint_interval",
        "500",
    ]
    reference = (ROOT / "docs" / "watch_it_learn.png").read_bytes()
    monkeypatch.setattr("sys.argv", ["watch_it_learn.py", "--plot-only", "--out", str(run_dir)])
    watch.main()
    assert (run_dir / "watch_it_learn.png").stat().st_size > 0
    assert (ROOT / "docs" / "watch_it_learn.png").read_bytes() == reference
    assert f"wrote {run_dir / 'watch_it_learn.png'}" in capsys.readouterr().out


def test_watch_it_learn_copy_documents_write_each_random_string_twice():
    watch = load_watch_it_learn()
    speeches = [f"Speaker {i}:\nWords, words, words." for i in range(200)]
    text = "\n\n".join(speeches)
    copied = watch.with_copies(text)
    assert copied == watch.with_copies(text)  # seeded: the same data on every machine
    parts = copied.split("\n\n")
    documents = [p for p in parts if p not in speeches]
    assert [p for p in parts if p in speeches] == speeches  # the text, in order, nothing lost
    assert 0.2 < len(documents) / len(speeches) < 0.4  # after about COPY_CHANCE of the speeches
    alphabet = set(text) - {"\n"}
    for document in documents:
        assert len(document) >= watch.COPY_DOCUMENT and set(document) <= alphabet
        rest = document  # a document is spans, each written twice back to back, 8-32 characters long
        while rest:
            length = next(n for n in range(watch.SPAN[0], watch.SPAN[1] + 1) if rest[:n] == rest[n : 2 * n])
            rest = rest[2 * length :]


def test_watch_it_learn_shows_samples_either_side_of_the_phase_change():
    watch = load_watch_it_learn()
    steps = [0, 1000, 2000, 3000, 4000, 5000, 6000, 7000, 8000]
    assert watch.four_moments(steps, phase=4700) == [0, 4000, 5000, 8000]
    assert watch.four_moments(steps, phase=None) == [0, 1000, 4000, 8000]
    assert watch.four_moments(steps, phase=8000) == [0, 1000, 4000, 8000]  # no sample after it
