"""The ICL picture without --data says on the figure that its loss curve, over one short prompt, is mostly noise."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg

from gptkit.config import ModelConfig
from gptkit.model import GPT
from gptkit.observe.report import icl_picture
from gptkit.tokenizer import CharTokenizer

TEXT = (Path(__file__).resolve().parents[2] / "gptkit" / "corpora" / "tinyshakespeare.txt").read_text()[:3000]


def picture(data: np.ndarray | None):
    tokenizer = CharTokenizer.train([TEXT])
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=tokenizer.vocab_size, block_size=64, n_layer=2, n_head=2, n_embd=32)).eval()
    return icl_picture(model, tokenizer, "ROMEO: But soft", "cat cat\ndog dog\nsun ", data, 48)


def loss_axes(figure):
    [axes] = [a for a in figure.axes if a.get_title().startswith("loss along the context")]
    return axes


def test_without_data_the_loss_panel_says_it_is_noise_and_how_to_average_it():
    figure, _, _, caption, data = picture(None)
    title = loss_axes(figure).get_title()
    assert "one short text" in title and "noise" in title and "--data" in title and data["losses_over"] == "prompt"
    assert "noise" in caption
    FigureCanvasAgg(figure)
    figure.canvas.draw()
    box = loss_axes(figure).title.get_window_extent()
    assert box.x0 >= 0 and box.x1 <= figure.bbox.x1  # the longer title still fits the narrowest figure


def test_with_data_the_curve_is_the_mean_over_windows():
    tokenizer = CharTokenizer.train([TEXT])
    figure, *_ = picture(np.asarray(tokenizer.encode(TEXT), dtype=np.int64))
    title = loss_axes(figure).get_title()
    assert "windows of the data" in title and "noise" not in title
