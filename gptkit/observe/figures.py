"""The pictures of what is inside a model: each draw_* function turns the data of gptkit.observe.prompt (or of
the measures) into a matplotlib Figure; save_png writes one."""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from matplotlib.colors import LogNorm, TwoSlopeNorm
from matplotlib.figure import Figure
from torch import Tensor

from gptkit.accounting import param_breakdown
from gptkit.atomic import atomic_write
from gptkit.config import ModelConfig
from gptkit.observe.prompt import (
    causal_mask,
    parameter_parts,
    token_labels,
)
from gptkit.tokenizer import Tokenizer

if TYPE_CHECKING:  # matplotlib is loaded where a figure is drawn, not for a hint
    from matplotlib.axes import Axes

TOP_TOKENS = 10


DPI = 100


MAX_ANNOTATED_CELLS = 700  # heatmaps write each cell's token in it up to this many cells


def new_figure(width: float, height: float) -> Figure:
    return Figure(figsize=(min(width, 40), min(height, 60)), dpi=DPI, layout="constrained")


def tick_labels(ax: Axes, labels: Sequence[str], x: bool = True, y: bool = True) -> None:
    """Token labels on an axis of a heatmap, their size shrinking with their count (x: the columns, y: the rows)."""
    size = max(4.0, min(9.0, 300 / max(1, len(labels))))
    ticks = range(len(labels))
    if x:
        ax.set_xticks(ticks, labels, rotation=90, fontsize=size)
    else:
        ax.set_xticks([])
    if y:
        ax.set_yticks(ticks, labels, fontsize=size)
    else:
        ax.set_yticks([])


def draw_parameters(config: ModelConfig) -> Figure:
    """Horizontal bars of parameter_parts, with each count and share and the total in the title."""
    parts = parameter_parts(config)
    total = param_breakdown(config).total
    fig = new_figure(9, 1.5 + 0.28 * len(parts))
    ax = fig.add_subplot()
    labels, counts = [p[0] for p in parts], [p[1] for p in parts]
    colours = ["#4c72b0" if "attention" in lab else "#dd8452" if "MLP" in lab else "#55a868" for lab in labels]
    ax.barh(range(len(parts)), counts, color=colours)
    ax.set_yticks(range(len(parts)), labels, fontsize=8)
    ax.invert_yaxis()
    for i, count in enumerate(counts):
        ax.text(count, i, f" {count:,} ({100 * count / total:.1f}%)", va="center", fontsize=7)
    ax.set_xlim(0, max(counts) * 1.35)
    ax.set_xlabel("parameters")
    ax.set_title(f"{total:,} parameters in all")
    return fig


def draw_attention(weights: Tensor, labels: Sequence[str], layer: int) -> Figure:
    """One lower-triangular heatmap per head of one layer's (n_head, T, T) weights."""
    n_head, T = weights.size(0), weights.size(-1)
    cols = min(n_head, 4)
    rows = math.ceil(n_head / cols)
    panel = min(6.0, max(2.5, 0.14 * T + 1.2))
    fig = new_figure(cols * panel, rows * panel + 0.5)
    upper = np.triu(np.ones((T, T), dtype=bool), k=1)
    for h in range(n_head):
        ax = fig.add_subplot(rows, cols, h + 1)
        image = ax.imshow(np.ma.masked_array(weights[h].numpy(), mask=upper), cmap="viridis", vmin=0, vmax=1)
        ax.set_title(f"head {h}", fontsize=9)
        tick_labels(ax, labels, x=h // cols == rows - 1 or h + cols >= n_head, y=h % cols == 0)
    fig.colorbar(image, ax=fig.axes, shrink=0.6, label="attention weight")
    fig.suptitle(f"layer {layer}: query (row) attends to key (column)")
    return fig


def draw_norms(norms: Tensor, state_names: Sequence[str], labels: Sequence[str]) -> Figure:
    """Heatmap of hidden-state norms: one row per stage, one column per position."""
    S, T = norms.shape
    fig = new_figure(max(6, 0.22 * T + 3), max(3, 0.3 * S + 2))
    ax = fig.add_subplot()
    # log colours: a final norm often has norms many times the residual stream's, which would flatten the rest
    image = ax.imshow(norms.clamp_min(1e-6).numpy(), aspect="auto", cmap="magma", norm=LogNorm())
    tick_labels(ax, labels, y=False)
    ax.set_yticks(range(S), state_names, fontsize=8)
    ax.set_xlabel("position (token)")
    fig.colorbar(image, ax=ax, label="L2 norm (log scale)")
    ax.set_title("norm of each position's hidden state")
    return fig


def draw_similarity(similarity: Tensor, state_names: Sequence[str], token: str) -> Figure:
    """Heatmap of the cosine similarity between stages at one position, annotated when small."""
    S = similarity.size(0)
    size = max(4.5, 0.35 * S + 2.5)
    fig = new_figure(size + 1, size)
    ax = fig.add_subplot()
    image = ax.imshow(similarity.numpy(), cmap="coolwarm", vmin=-1, vmax=1)
    ax.set_xticks(range(S), state_names, rotation=90, fontsize=8)
    ax.set_yticks(range(S), state_names, fontsize=8)
    if S <= 14:
        for i in range(S):
            for j in range(S):
                ax.text(j, i, f"{similarity[i, j]:.2f}", ha="center", va="center", fontsize=7)
    fig.colorbar(image, ax=ax, label="cosine similarity")
    ax.set_title(f"similarity of the representations of the last token ({token})")
    return fig


def draw_distributions(distributions: dict[float, Tensor], tokenizer: Tokenizer, k: int = TOP_TOKENS) -> Figure:
    """Bars of the top-k next tokens under each temperature (temperature keeps the order, so one token set)."""
    temps = list(distributions)
    first = distributions[temps[0]]
    top = torch.topk(first, min(k, first.numel())).indices
    labels = token_labels(tokenizer, top.tolist())
    fig = new_figure(4 * len(temps), 4.2)
    ceiling = min(1.0, 1.15 * max(float(distributions[t][top].max()) for t in temps))  # one scale for all panels
    for n, t in enumerate(temps):
        ax = fig.add_subplot(1, len(temps), n + 1)
        probs = distributions[t][top].numpy()
        ax.bar(range(len(top)), probs, color="#4c72b0")
        ax.set_xticks(range(len(top)), labels, rotation=90, fontsize=8)
        ax.set_ylim(0, ceiling)
        ax.set_title(f"temperature {t:g}: top {len(top)} hold {probs.sum():.0%}", fontsize=9)
        if n == 0:
            ax.set_ylabel("probability")
    fig.suptitle("next-token distribution after the prompt")
    return fig


def draw_mask(size: int, labels: Sequence[str]) -> Figure:
    """The causal mask as an image: light where attention is allowed (key j <= query i)."""
    fig = new_figure(max(4, 0.16 * size + 2), max(4, 0.16 * size + 2))
    ax = fig.add_subplot()
    ax.imshow(causal_mask(size).numpy(), cmap="Greys_r", vmin=0, vmax=1)
    tick_labels(ax, labels)
    ax.set_xlabel("key")
    ax.set_ylabel("query")
    ax.set_title("causal mask: white = may attend, black = -inf before the softmax")
    return fig


def draw_activation(activation: str) -> Figure:
    """The model's nonlinearity (GELU, its tanh approximation, SwiGLU's SiLU gate or squared ReLU) against ReLU."""
    x = torch.linspace(-4, 4, 401)
    curves = {
        "gelu": ("GELU x·Φ(x)", torch.nn.functional.gelu(x)),
        "gelu_tanh": ("GELU (tanh approximation)", torch.nn.functional.gelu(x, approximate="tanh")),
        "swiglu": ("SiLU x·σ(x) (SwiGLU's gate)", torch.nn.functional.silu(x)),
        "relu2": ("ReLU² max(0, x)^2", torch.relu(x).square()),
    }
    name, y = curves[activation]
    fig = new_figure(6, 4)
    ax = fig.add_subplot()
    ax.plot(x.numpy(), torch.relu(x).numpy(), label="ReLU max(0, x)", linestyle="--", color="grey")
    ax.plot(x.numpy(), y.numpy(), label=name, color="#c44e52")
    ax.axhline(0, color="black", linewidth=0.5)
    ax.axvline(0, color="black", linewidth=0.5)
    ax.legend()
    ax.set_xlabel("x")
    ax.set_title(f"{name.split(' ')[0]} against ReLU")
    return fig


def draw_logit_lens(
    final_prob: Tensor, top_labels: Sequence[Sequence[str]], rows: Sequence[str], labels: Sequence[str]
) -> Figure:
    """Heatmap of the logit lens: per stage (row) and position (column) the probability of the model's eventual
    prediction, each cell labelled with that stage's own top token."""
    S, T = final_prob.shape
    fig = new_figure(max(6, 0.42 * T + 3), max(3, 0.4 * S + 2.5))
    ax = fig.add_subplot()
    image = ax.imshow(final_prob.numpy(), aspect="auto", cmap="Blues", vmin=0, vmax=1, origin="lower")
    if S * T <= MAX_ANNOTATED_CELLS:
        for i in range(S):
            for j in range(T):
                colour = "white" if final_prob[i, j] > 0.6 else "black"
                text = top_labels[i][j] if len(top_labels[i][j]) <= 5 else top_labels[i][j][:4] + "\u2026"
                ax.text(j, i, text, ha="center", va="center", fontsize=6.5, color=colour)
    tick_labels(ax, labels, y=False)
    ax.set_yticks(range(S), rows, fontsize=8)
    ax.set_xlabel("input position (token)")
    fig.colorbar(image, ax=ax, label="probability of the final prediction")
    ax.set_title("logit lens: each stage's top next token (text) and its probability of the final prediction")
    return fig


def draw_head_contributions(contributions: Tensor, token: str) -> Figure:
    """Layer x head heatmap of each head's direct contribution to one logit, centred on zero."""
    L, H = contributions.shape
    fig = new_figure(max(6, 0.6 * H + 3), max(3.5, 0.45 * L + 2))
    ax = fig.add_subplot()
    bound = max(float(contributions.abs().max()), 1e-6)
    image = ax.imshow(contributions.numpy(), cmap="RdBu_r", vmin=-bound, vmax=bound, aspect="auto")
    _layer_head_axes(ax, L, H)
    if L * H <= 200:
        for i in range(L):
            for j in range(H):
                colour = "white" if abs(float(contributions[i, j])) > 0.6 * bound else "black"
                ax.text(j, i, f"{contributions[i, j]:+.3g}", ha="center", va="center", fontsize=7, color=colour)
    fig.colorbar(image, ax=ax, label="direct contribution to the logit")
    ax.set_title(f"each head's direct push on the logit of {token}\n(the prediction at the last position)", fontsize=10)
    return fig


def _layer_head_axes(ax: Axes, n_layer: int, n_head: int) -> None:
    step_h, step_l = max(1, n_head // 16), max(1, n_layer // 24)
    ax.set_xticks(range(0, n_head, step_h), [str(h) for h in range(0, n_head, step_h)], fontsize=8)
    ax.set_yticks(range(0, n_layer, step_l), [str(i) for i in range(0, n_layer, step_l)], fontsize=8)
    ax.set_xlabel("head")
    ax.set_ylabel("layer")


def draw_induction(scores: Tensor, chance: float) -> Figure:
    """Layer x head heatmap of induction scores on a 0..1 scale that turns at the chance level (white): blue
    below it, red above, so that heads near chance stay apart; each cell annotated when there are few."""
    L, H = scores.shape
    fig = new_figure(max(6, 0.6 * H + 3), max(3.5, 0.45 * L + 2))
    ax = fig.add_subplot()
    norm = TwoSlopeNorm(vmin=0.0, vcenter=min(max(chance, 1e-6), 1 - 1e-6), vmax=1.0)
    image = ax.imshow(scores.numpy(), cmap="RdBu_r", norm=norm, aspect="auto")
    _layer_head_axes(ax, L, H)
    if L * H <= 200:
        for i in range(L):
            for j in range(H):
                colour = "white" if abs(float(norm(float(scores[i, j]))) - 0.5) > 0.35 else "black"
                ax.text(j, i, f"{scores[i, j]:.3f}", ha="center", va="center", fontsize=7, color=colour)
    bar = fig.colorbar(image, ax=ax, label="induction score (white: uniform attention)")
    bar.set_ticks([0.0, chance, 0.5, 1.0], labels=["0", f"{chance:.3f}", "0.5", "1"])
    ax.set_title(f"induction score per head\n(uniform attention: {chance:.3f}, perfect induction head: 1)", fontsize=10)
    return fig


def draw_icl(attention: Tensor, labels: Sequence[str], losses: Tensor, loss_source: str) -> Figure:
    """Two panels: per layer, how the answer (last) position of a few-shot prompt spreads its attention over the
    earlier tokens (mean over heads); and the next-token loss at each position along the context."""
    L, T = attention.shape
    fig = new_figure(max(7, 0.22 * T + 3), 3 + 0.35 * L + 3.2)
    top, bottom = fig.subplots(2, 1, height_ratios=[1 + 0.35 * L, 3.2])
    image = top.imshow(attention.numpy(), aspect="auto", cmap="viridis", vmin=0, vmax=float(attention.max()))
    tick_labels(top, labels, y=False)
    top.set_yticks(range(L), [f"layer {i}" for i in range(L)], fontsize=8)
    top.set_title(
        "attention from the answer position (last token)\nto the few-shot prompt, mean over heads", fontsize=10
    )  # two lines: one is wider than the figure of a short prompt
    fig.colorbar(image, ax=top, label="attention weight")
    positions = np.arange(1, len(losses) + 1)
    bottom.plot(positions, losses.numpy(), color="#c44e52", linewidth=1)
    if len(losses) >= 20:  # a running mean shows the trend through the per-token noise
        width = max(3, len(losses) // 20)
        smooth = np.convolve(losses.numpy(), np.ones(width) / width, mode="valid")
        bottom.plot(positions[width - 1 :], smooth, color="black", linewidth=1.5, label=f"mean of {width}")
        bottom.legend(fontsize=8)
    bottom.set_xlabel("tokens of context seen (position + 1)")
    bottom.set_ylabel("next-token loss (nats)")
    bottom.set_title(f"loss along the context ({loss_source})", fontsize=9)
    return fig


def save_png(fig: Figure, path: Path) -> None:
    """Render a figure to a PNG file atomically (Agg, no global backend)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Glyph \d+ .*missing from")  # tokens in scripts the font lacks
        atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=DPI))
