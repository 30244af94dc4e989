"""What is inside a model (SPEC section 5): the data behind each picture, the pictures, and an index.html.

The data functions (prompt_insight, attention_maps, hidden_state_norms, layer_similarity,
next_token_distributions, token_probabilities, parameter_parts, causal_mask) return plain tensors and lists, so
that other front ends (the HTTP playground) can reuse them; the draw_* functions turn them into matplotlib
Figures; write_report saves the PNGs and an index.html that shows them with captions.
"""

from __future__ import annotations

import html
import json
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from matplotlib.figure import Figure
from torch import Tensor

from gptkit.accounting import attention_params, mlp_params, norm_params, param_breakdown
from gptkit.atomic import atomic_write, atomic_write_text
from gptkit.config import ModelConfig
from gptkit.errors import InputError
from gptkit.model import GPT, Trace
from gptkit.observe import measures
from gptkit.observe.ablation import ablation_study

TEMPERATURES = (0.5, 1.0, 2.0)
MAX_HEATMAP_TOKENS = 48  # beyond this, token labels become unreadable: heatmaps show the last positions only
TOP_TOKENS = 10
DEFAULT_PROMPT = "First Citizen:\nBefore we proceed any further, hear me speak."
DPI = 100
ICL_DEMONSTRATIONS = 4  # word pairs before the query in the default few-shot prompt
MAX_ANNOTATED_CELLS = 700  # heatmaps write each cell's token in it up to this many cells


@dataclass(frozen=True)
class PromptInsight:
    """One traced forward pass over a prompt, as float32 CPU tensors."""

    ids: list[int]  # the tokens the model saw (the prompt's last block_size tokens for learned positions)
    dropped: int  # prompt tokens cut from the front to fit the context
    attentions: list[Tensor]  # per layer: (n_head, T, T), row i = how query i spreads over keys 0..i
    hidden_states: list[Tensor]  # (T, d) after the embedding, each block and (pre-norm) the final norm
    state_labels: list[str]  # a name for each hidden state
    logits: Tensor  # (T, vocab_size)


@dataclass(frozen=True)
class Picture:
    """A written PNG and what index.html says about it."""

    file: str
    title: str
    caption: str
    data: str | None = None  # a JSON file beside the PNG holding the numbers drawn


# --- data ---------------------------------------------------------------------------------------------------


def state_labels(config: ModelConfig) -> list[str]:
    """Names of the hidden states a Trace records, in order."""
    labels = ["embedding"] + [f"layer {i}" for i in range(config.n_layer)]  # numbered from 0, as everywhere
    return labels + (["final norm"] if config.norm_position == "pre" else [])


@torch.no_grad()
def prompt_insight(model: GPT, ids: Sequence[int]) -> PromptInsight:
    """Run ids (one sequence) through model with a Trace; the context keeps its last block_size tokens."""
    if len(ids) == 0:
        raise InputError("the prompt encodes to no tokens; give a non-empty --prompt")
    config = model.config
    keep = list(ids)[-config.block_size :]
    trace = Trace()
    logits = measures.eval_forward(model, torch.tensor([keep]), trace)
    return PromptInsight(
        ids=keep,
        dropped=len(ids) - len(keep),
        attentions=[a[0].float().cpu() for a in trace.attentions],
        hidden_states=[h[0].float().cpu() for h in trace.hidden_states],
        state_labels=state_labels(config),
        logits=logits[0].float().cpu(),
    )


def attention_maps(insight: PromptInsight) -> list[Tensor]:
    """Per layer, the (n_head, T, T) attention weights: rows sum to 1, zero above the diagonal."""
    return insight.attentions


def hidden_state_norms(hidden_states: Sequence[Tensor]) -> Tensor:
    """(states, T): the L2 norm of each position's hidden state after each stage."""
    return torch.stack([h.norm(dim=-1) for h in hidden_states])


def layer_similarity(hidden_states: Sequence[Tensor], position: int = -1) -> Tensor:
    """(states, states): cosine similarity between the stages' representations of one position."""
    vectors = torch.stack([h[position] for h in hidden_states])  # (states, d)
    unit = vectors / vectors.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    return unit @ unit.T


def next_token_distributions(logits: Tensor, temperatures: Sequence[float] = TEMPERATURES) -> dict[float, Tensor]:
    """softmax(z / tau) of one position's logits (V,) for each temperature tau > 0."""
    if any(t <= 0 for t in temperatures):
        raise InputError(f"temperatures must be > 0, got {list(temperatures)}")
    return {t: torch.softmax(logits.float() / t, dim=-1) for t in temperatures}


def token_probabilities(logits: Tensor, ids: Sequence[int]) -> Tensor:
    """(T-1,): the probability the model gave each actual next token ids[1:], from logits (T, V)."""
    targets = torch.tensor(list(ids[1:]), dtype=torch.long)
    probs = torch.softmax(logits[: len(targets)].float(), dim=-1)
    return probs.gather(1, targets[:, None])[:, 0]


def causal_mask(size: int) -> Tensor:
    """(size, size) booleans: True where query i may attend to key j (j <= i)."""
    return torch.ones(size, size, dtype=torch.bool).tril()


def parameter_parts(config: ModelConfig) -> list[tuple[str, int]]:
    """Parameter counts by part: embeddings, each block's attention and MLP, all norms, the head (from accounting)."""
    totals = param_breakdown(config)
    parts = [("token embedding" + (" (tied head)" if config.tie_embeddings else ""), totals.token_embedding)]
    if totals.position_embedding:
        parts.append(("position embedding", totals.position_embedding))
    for i in range(config.n_layer):
        parts += [(f"layer {i} attention", attention_params(config)), (f"layer {i} MLP", mlp_params(config))]
    parts.append((f"norms ({totals.norms // norm_params(config)})", totals.norms))
    if totals.lm_head:
        parts.append(("LM head", totals.lm_head))
    return parts


def token_label(text: str, width: int = 12) -> str:
    """A token's text made visible and safe for a plot label: spaces as ␣, control characters escaped."""
    out = []
    for ch in text:
        if ch == " ":
            out.append("\u2423")
        elif ch in "\n\t\r":
            out.append({"\n": "\\n", "\t": "\\t", "\r": "\\r"}[ch])
        elif ord(ch) < 32 or ord(ch) == 127:
            out.append(f"\\x{ord(ch):02x}")
        elif ch == "$":
            out.append("\\$")  # a bare $ would start matplotlib's mathtext
        else:
            out.append(ch)
    label = "".join(out) or "\u2205"
    return label if len(label) <= width else label[: width - 1] + "\u2026"


def token_labels(tokenizer: Any, ids: Sequence[int]) -> list[str]:
    """The display label of each token, decoded one by one; a token holding part of a character shows its bytes."""
    labels = []
    for i in ids:
        text, data = tokenizer.decode([i]), tokenizer.token_bytes(i)
        if "\ufffd" in text and data != text.encode("utf-8"):
            text = "".join(f"<{b:02X}>" for b in data)  # bytes of an incomplete character
        labels.append(token_label(text))
    return labels


def _encodes(tokenizer: Any, text: str) -> bool:
    """Whether tokenizer encodes text and decodes it back unchanged (a char vocabulary may lack a character)."""
    try:
        return tokenizer.decode(tokenizer.encode(text)) == text
    except InputError:
        return False


def default_icl_prompt(prompt: str, tokenizer: Any) -> tuple[str, str]:
    """A few-shot copying prompt built from the prompt's own words, and its expected answer: demonstrations
    "w1 w1", "w2 w2", ... one a line, then the query "wq " whose answer is wq. Only the prompt's characters and
    separators the tokenizer round-trips are used, so it works for char, byte and BPE tokenizers alike."""
    words = list(dict.fromkeys(prompt.split()))  # distinct words, in order
    if len(words) < 2:
        chars = list(dict.fromkeys(ch for ch in prompt if not ch.isspace()))  # one word: its characters
        words = chars if len(chars) >= 2 else words
    if not words:
        raise InputError("the prompt is only white space; give --icl-prompt for the few-shot picture")
    pair = next((sep for sep in (" ", ":", "") if not sep or _encodes(tokenizer, sep)), "")
    line = next((sep for sep in ("\n", " ", ";", "") if not sep or (sep != pair and _encodes(tokenizer, sep))), "")
    count = min(ICL_DEMONSTRATIONS, max(1, len(words) - 1))
    demos, query = words[:count], words[count % len(words)]  # a single word is its own query
    return "".join(f"{w}{pair}{w}{line}" for w in demos) + f"{query}{pair}", query


def lens_rows(config: ModelConfig) -> list[str]:
    """Names of the logit lens's rows: the residual stream after the embedding and after each layer (from 0)."""
    return ["embedding"] + [f"layer {i}" for i in range(config.n_layer)]


# --- drawing ------------------------------------------------------------------------------------------------


def _figure(width: float, height: float) -> Figure:
    return Figure(figsize=(min(width, 40), min(height, 60)), dpi=DPI, layout="constrained")


def _tick_labels(ax: Any, labels: Sequence[str], x: bool = True, y: bool = True) -> None:
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
    fig = _figure(9, 1.5 + 0.28 * len(parts))
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
    fig = _figure(cols * panel, rows * panel + 0.5)
    upper = np.triu(np.ones((T, T), dtype=bool), k=1)
    for h in range(n_head):
        ax = fig.add_subplot(rows, cols, h + 1)
        image = ax.imshow(np.ma.masked_array(weights[h].numpy(), mask=upper), cmap="viridis", vmin=0, vmax=1)
        ax.set_title(f"head {h}", fontsize=9)
        _tick_labels(ax, labels, x=h // cols == rows - 1 or h + cols >= n_head, y=h % cols == 0)
    fig.colorbar(image, ax=fig.axes, shrink=0.6, label="attention weight")
    fig.suptitle(f"layer {layer}: query (row) attends to key (column)")
    return fig


def draw_norms(norms: Tensor, state_names: Sequence[str], labels: Sequence[str]) -> Figure:
    """Heatmap of hidden-state norms: one row per stage, one column per position."""
    S, T = norms.shape
    fig = _figure(max(6, 0.22 * T + 3), max(3, 0.3 * S + 2))
    ax = fig.add_subplot()
    from matplotlib.colors import LogNorm

    # log colours: a final norm often has norms many times the residual stream's, which would flatten the rest
    image = ax.imshow(norms.clamp_min(1e-6).numpy(), aspect="auto", cmap="magma", norm=LogNorm())
    _tick_labels(ax, labels, y=False)
    ax.set_yticks(range(S), state_names, fontsize=8)
    ax.set_xlabel("position (token)")
    fig.colorbar(image, ax=ax, label="L2 norm (log scale)")
    ax.set_title("norm of each position's hidden state")
    return fig


def draw_similarity(similarity: Tensor, state_names: Sequence[str], token: str) -> Figure:
    """Heatmap of the cosine similarity between stages at one position, annotated when small."""
    S = similarity.size(0)
    size = max(4.5, 0.35 * S + 2.5)
    fig = _figure(size + 1, size)
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


def draw_distributions(distributions: dict[float, Tensor], tokenizer: Any, k: int = TOP_TOKENS) -> Figure:
    """Bars of the top-k next tokens under each temperature (temperature keeps the order, so one token set)."""
    temps = list(distributions)
    first = distributions[temps[0]]
    top = torch.topk(first, min(k, first.numel())).indices
    labels = token_labels(tokenizer, top.tolist())
    fig = _figure(4 * len(temps), 4.2)
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
    fig = _figure(max(4, 0.16 * size + 2), max(4, 0.16 * size + 2))
    ax = fig.add_subplot()
    ax.imshow(causal_mask(size).numpy(), cmap="Greys_r", vmin=0, vmax=1)
    _tick_labels(ax, labels)
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
    fig = _figure(6, 4)
    ax = fig.add_subplot()
    ax.plot(x.numpy(), torch.relu(x).numpy(), label="ReLU max(0, x)", linestyle="--", color="grey")
    ax.plot(x.numpy(), y.numpy(), label=name, color="#c44e52")
    ax.axhline(0, color="black", linewidth=0.5)
    ax.axvline(0, color="black", linewidth=0.5)
    ax.legend()
    ax.set_xlabel("x")
    ax.set_title(f"{name.split(' ')[0]} against ReLU")
    return fig


def draw_logit_lens(final_prob: Tensor, top_labels: Sequence[Sequence[str]], rows: Sequence[str],
                    labels: Sequence[str]) -> Figure:  # fmt: skip
    """Heatmap of the logit lens: per stage (row) and position (column) the probability of the model's eventual
    prediction, each cell labelled with that stage's own top token."""
    S, T = final_prob.shape
    fig = _figure(max(6, 0.42 * T + 3), max(3, 0.4 * S + 2.5))
    ax = fig.add_subplot()
    image = ax.imshow(final_prob.numpy(), aspect="auto", cmap="Blues", vmin=0, vmax=1, origin="lower")
    if S * T <= MAX_ANNOTATED_CELLS:
        for i in range(S):
            for j in range(T):
                colour = "white" if final_prob[i, j] > 0.6 else "black"
                text = top_labels[i][j] if len(top_labels[i][j]) <= 5 else top_labels[i][j][:4] + "\u2026"
                ax.text(j, i, text, ha="center", va="center", fontsize=6.5, color=colour)
    _tick_labels(ax, labels, y=False)
    ax.set_yticks(range(S), rows, fontsize=8)
    ax.set_xlabel("input position (token)")
    fig.colorbar(image, ax=ax, label="probability of the final prediction")
    ax.set_title("logit lens: each stage's top next token (text) and its probability of the final prediction")
    return fig


def draw_head_contributions(contributions: Tensor, token: str) -> Figure:
    """Layer x head heatmap of each head's direct contribution to one logit, centred on zero."""
    L, H = contributions.shape
    fig = _figure(max(6, 0.6 * H + 3), max(3.5, 0.45 * L + 2))
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


def _layer_head_axes(ax: Any, n_layer: int, n_head: int) -> None:
    step_h, step_l = max(1, n_head // 16), max(1, n_layer // 24)
    ax.set_xticks(range(0, n_head, step_h), [str(h) for h in range(0, n_head, step_h)], fontsize=8)
    ax.set_yticks(range(0, n_layer, step_l), [str(i) for i in range(0, n_layer, step_l)], fontsize=8)
    ax.set_xlabel("head")
    ax.set_ylabel("layer")


def draw_induction(scores: Tensor, chance: float) -> Figure:
    """Layer x head heatmap of induction scores on a 0..1 scale that turns at the chance level (white): blue
    below it, red above, so that heads near chance stay apart; each cell annotated when there are few."""
    from matplotlib.colors import TwoSlopeNorm

    L, H = scores.shape
    fig = _figure(max(6, 0.6 * H + 3), max(3.5, 0.45 * L + 2))
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
    fig = _figure(max(7, 0.22 * T + 3), 3 + 0.35 * L + 3.2)
    top, bottom = fig.subplots(2, 1, height_ratios=[1 + 0.35 * L, 3.2])
    image = top.imshow(attention.numpy(), aspect="auto", cmap="viridis", vmin=0, vmax=float(attention.max()))
    _tick_labels(top, labels, y=False)
    top.set_yticks(range(L), [f"layer {i}" for i in range(L)], fontsize=8)
    top.set_title("attention from the answer position (last token)\nto the few-shot prompt, mean over heads",
                  fontsize=10)  # two lines: one is wider than the figure of a short prompt
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


# --- the report ---------------------------------------------------------------------------------------------


def write_report(
    model: GPT,
    tokenizer: Any,
    prompt: str,
    out_dir: str | Path,
    title: str = "model",
    max_tokens: int = MAX_HEATMAP_TOKENS,
    icl_prompt: str | None = None,
    data_tokens: np.ndarray | None = None,
) -> list[Picture]:
    """Write every picture of the prompt's pass through model into out_dir, then index.html showing them.

    Heatmaps over positions draw at most the last max_tokens positions (the captions say so). icl_prompt is the
    few-shot prompt of the ICL picture (default: one built from prompt); data_tokens, running text such as a
    val.bin, gives its loss-along-the-context curve (default: the few-shot prompt's own losses).
    """
    if max_tokens < 1:
        raise InputError(f"--max-tokens must be >= 1, got {max_tokens}")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {out} is a file; give a directory for the report")
    out.mkdir(parents=True, exist_ok=True)
    config = model.config
    ids = tokenizer.encode(prompt)
    insight = prompt_insight(model, ids)
    shown = min(len(insight.ids), max_tokens)
    cut = len(insight.ids) - shown
    labels = token_labels(tokenizer, insight.ids)[cut:]
    context_note = (
        f" The prompt's first {insight.dropped} tokens were dropped to fit the {config.block_size}-token context."
        if insight.dropped
        else ""
    )
    shown_note = f" Only the last {shown} of the {len(insight.ids)} positions are drawn." if cut else ""
    rows_note = " The weights on earlier keys are left out, so a drawn row can sum to less than 1." if cut else ""
    pictures: list[Picture] = []

    def add(fig: Figure, file: str, heading: str, caption: str, data: dict | None = None) -> None:
        save_png(fig, out / file)
        data_file = None
        if data is not None:
            data_file = Path(file).with_suffix(".json").name
            atomic_write_text(out / data_file, json.dumps(data))
        pictures.append(Picture(file, heading, caption, data_file))

    total = param_breakdown(config).total
    add(draw_parameters(config), "parameters.png", "Parameter breakdown",
        f"{total:,} parameters: the token embedding, each block's attention (fused q, k, v and output "
        "projections) and MLP, all norms together, and the LM head when it is not tied to the embedding.")
    for layer, weights in enumerate(attention_maps(insight)):  # layers and heads are numbered from 0
        add(draw_attention(weights[:, cut:, cut:], labels, layer), f"attention_layer{layer}.png",
            f"Attention, layer {layer}",
            f"softmax(QK^T/sqrt(d_k) + M) for each of the {config.n_head} heads: row i shows how query token i "
            "spreads its attention over keys 0..i; each full row sums to 1 and nothing lies above the diagonal."
            + shown_note + rows_note + context_note)  # fmt: skip
    add(draw_norms(hidden_state_norms(insight.hidden_states)[:, cut:], insight.state_labels, labels),
        "hidden_norms.png", "Hidden-state norms",
        "The L2 norm of each position's hidden state after the embedding, after each block"
        + (" and after the final norm." if config.norm_position == "pre" else " (post-norm: each block ends in a "
           "norm).") + shown_note + context_note)  # fmt: skip
    last = token_labels(tokenizer, insight.ids[-1:])[0]
    add(draw_similarity(layer_similarity(insight.hidden_states), insight.state_labels, last),
        "layer_similarity.png", "Similarity between layers",
        "Cosine similarity between the representations of the last prompt token after each stage: how much each "
        "block changes the residual stream.")  # fmt: skip
    distributions = next_token_distributions(insight.logits[-1])
    add(draw_distributions(distributions, tokenizer), "next_token.png", "Next-token distribution",
        f"The top {TOP_TOKENS} next tokens after the prompt under softmax(z / tau) for tau = "
        + ", ".join(f"{t:g}" for t in TEMPERATURES) + ": a low temperature sharpens the distribution, a high one "
        "flattens it (the order never changes).")  # fmt: skip
    add(draw_mask(shown, labels), "causal_mask.png", "Causal mask",
        "M_ij = 0 where key j <= query i and -inf above the diagonal, so no position sees the future."
        + shown_note)  # fmt: skip
    if config.activation != "relu":
        add(draw_activation(config.activation), "activation.png", "Activation function",
            f"This model's MLP uses {config.activation}; ReLU (the original Transformer's) for comparison.")
    add(*_lens_picture(model, tokenizer, insight.ids, cut, labels, shown_note + context_note))
    if config.norm_position == "pre":
        add(*_contributions_picture(model, tokenizer, insight.ids))
    add(*_icl_picture(model, tokenizer, prompt, icl_prompt, data_tokens, max_tokens))
    add(*_induction_picture(model, data_tokens))
    atomic_write_text(out / "index.html", render_index(pictures, title, prompt, config))
    return pictures


def _texts(tokenizer: Any, ids: Sequence[int]) -> list[str]:
    """Each token's own text, for the JSON files (the pictures use token_labels)."""
    return [tokenizer.decode([i]) for i in ids]


def _lens_picture(model: GPT, tokenizer: Any, ids: list[int], cut: int, labels: list[str],
                  notes: str) -> tuple[Figure, str, str, str, dict]:  # fmt: skip
    """The logit lens over the prompt: each stage's top token and its probability of the final prediction."""
    config = model.config
    top, top_prob, final_prob = measures.lens_predictions(measures.logit_lens(model, ids, first=cut))
    rows = lens_rows(config)
    top_labels = [token_labels(tokenizer, row.tolist()) for row in top]
    norm = ("the final norm and " if config.norm_position == "pre" else "") + "the LM head"
    skipped = "" if config.norm_position == "pre" else (
        " Head contributions are not drawn: in a post-norm model every block ends in a norm, so a head's output "
        "reaches the logits only through the norms after it and no head has a direct path of its own.")
    data = {"rows": rows, "positions": list(range(cut, len(ids))), "tokens": _texts(tokenizer, ids[cut:]),
            "top_token_ids": top.tolist(), "top_tokens": [_texts(tokenizer, row.tolist()) for row in top],
            "top_probability": top_prob.tolist(), "final_prediction_probability": final_prob.tolist()}  # fmt: skip
    caption = (
        f"The residual stream after the embedding and after each block, read out through {norm} as if the model "
        "ended there. Each cell's text is the token that stage would predict next at that position; its colour is "
        "the probability that stage gives the model's eventual prediction (the top row), so a column darkens "
        "upward from where the model settles on its answer. The numbers are in logit_lens.json." + notes + skipped)
    return draw_logit_lens(final_prob, top_labels, rows, labels), "logit_lens.png", "Logit lens", caption, data


def _contributions_picture(model: GPT, tokenizer: Any, ids: list[int]) -> tuple[Figure, str, str, str, dict]:
    """Each head's direct contribution to the logit of the model's prediction after the prompt."""
    contributions = measures.head_contributions(model, ids)
    with torch.no_grad():
        token = int(model(torch.tensor([ids], device=next(model.parameters()).device))[0, -1].argmax())
    label = token_labels(tokenizer, [token])[0]
    data = {"token_id": token, "token": tokenizer.decode([token]), "position": len(ids) - 1,
            "contributions": contributions.tolist()}  # fmt: skip
    caption = (
        f"Direct logit attribution: how much each head's output at the last position, passed through the output "
        f"projection, the final norm (its scale at that position held fixed) and the LM head, adds to the logit of "
        f"the predicted next token {label}. Red heads push the prediction up, blue ones down; the embeddings, MLPs "
        "and biases make up the rest of the logit. The numbers are in head_contributions.json.")
    return draw_head_contributions(contributions, label), "head_contributions.png", "Head contributions", \
        caption, data


def _icl_picture(model: GPT, tokenizer: Any, prompt: str, icl_prompt: str | None, data_tokens: np.ndarray | None,
                 max_tokens: int) -> tuple[Figure, str, str, str, dict]:  # fmt: skip
    """Attention from a few-shot prompt's answer position, per layer, and the loss along the context."""
    config = model.config
    answer = None
    if icl_prompt is None:
        icl_prompt, answer = default_icl_prompt(prompt, tokenizer)
    elif not icl_prompt:
        raise InputError("--icl-prompt is empty; give a few-shot prompt (demonstrations, then a query)")
    ids = tokenizer.encode(icl_prompt)[-config.block_size :]
    if not ids:
        raise InputError("--icl-prompt encodes to no tokens; give a few-shot prompt")
    attention = measures.attention_from(model, ids)
    shown = min(len(ids), max(max_tokens, 128))  # the whole few-shot prompt where it fits: its demonstrations matter
    data: dict[str, Any] = {"prompt": icl_prompt, "expected_answer": answer, "tokens": _texts(tokenizer, ids),
                            "attention_from_last": attention.tolist()}  # fmt: skip
    if data_tokens is not None:
        losses = measures.position_losses(model, data_tokens)
        early, late = measures.early_late_losses(losses)
        data.update(losses_over="data", icl_score=late - early, early_loss=early, late_loss=late)
        source = f"mean over {measures.ICL_WINDOWS} windows of the data"
        loss_note = (f" The loss curve is the mean over {measures.ICL_WINDOWS} {config.block_size}-token windows "
                     f"of the data: ICL score {late - early:+.3f} (late loss {late:.3f} minus early loss "
                     f"{early:.3f}; negative when the model uses its context).")  # fmt: skip
    else:
        losses = measures.sequence_losses(model, ids) if len(ids) > 1 else torch.zeros(0)
        data["losses_over"] = "prompt"
        source = "the few-shot prompt itself"
        loss_note = (" The loss curve is over the few-shot prompt itself (give --data for the mean over windows of "
                     "real text and the ICL score): a model that learns in context predicts later demonstrations "
                     "better than the first.")  # fmt: skip
    data["position_losses"] = losses.tolist()
    with torch.no_grad():
        last = model(torch.tensor([ids], device=next(model.parameters()).device))[0, -1].float().softmax(-1)
    predicted = int(last.argmax())
    data["predicted"] = {"token_id": predicted, "token": tokenizer.decode([predicted]),
                         "probability": float(last[predicted])}  # fmt: skip
    expected = f" (the expected answer is {answer!r})" if answer is not None else ""
    caption = (
        f"In-context learning. Top: for the few-shot prompt {icl_prompt!r}, how the last position, where the "
        f"answer is predicted, spreads its attention over the earlier tokens in each layer (mean over heads): "
        f"bright columns are the demonstration tokens it copies from. The model predicts "
        f"{tokenizer.decode([predicted])!r} with probability {float(last[predicted]):.2f}{expected}."
        + (f" Only the last {shown} of its {len(ids)} tokens are drawn." if shown < len(ids) else "")
        + loss_note + " The numbers are in icl.json.")
    labels = token_labels(tokenizer, ids)[len(ids) - shown :]
    return draw_icl(attention[:, len(ids) - shown :], labels, losses, source), "icl.png", "In-context learning", \
        caption, data


def _induction_picture(model: GPT, tokens: Any | None) -> tuple[Figure, str, str, str, dict]:
    """The induction test: each head's score on a random sequence repeated twice, and what mean-ablating the
    strongest head (and each head of its layer) changes."""
    test = measures.induction_test(model)
    chance = measures.chance_induction_score(test.length)
    strongest = ", ".join(f"layer {l} head {h} ({v:.2f})" for l, h, v in measures.top_heads(test.scores, 3))
    text = tokens if tokens is not None and len(tokens) > model.config.block_size else None  # (ICL needs a window)
    ablation = ablation_study(model, test.scores, text)
    data = {"length": test.length, "chance": chance, "first_half_loss": test.first_half_loss,
            "repeated_half_loss": test.repeated_half_loss, "scores": test.scores.tolist(), "ablation": ablation}
    on_text = "" if ablation["icl_change"] is None else f" and the ICL score by {ablation['icl_change']:+.3f}"
    caption = (
        f"Induction heads. {measures.INDUCTION_BATCH} random sequences of {test.length} tokens, each repeated "
        "twice: a head's score is the attention it pays from each token of the second copy to the token that "
        "followed the same token in the first copy. 1 is a perfect induction head; uniform attention scores "
        f"{chance:.3f} (the chance level), about 1 / position. Strongest: {strongest}. The loss is "
        f"{test.first_half_loss:.3f} on the first copy and {test.repeated_half_loss:.3f} on the repeat, which "
        "falls well below the first once induction heads copy from the context. Mean-ablating the strongest head "
        f"(its output replaced by its mean over the batch) changes the repeated-half loss by "
        f"{ablation['repeat_change']:+.3f}{on_text}: a head that scores high but changes little is not the one the "
        "model copies with. The numbers, each head of its layer's ablation included, are in induction.json.")
    return draw_induction(test.scores, chance), "induction.png", "Induction heads", caption, data


def render_index(pictures: Sequence[Picture], title: str, prompt: str, config: ModelConfig) -> str:
    """A self-contained HTML page (no external resources) showing each picture with its caption."""
    esc = html.escape
    summary = (
        f"{config.n_layer} layers, {config.n_head} heads ({config.n_kv_head} kv), width {config.n_embd}, "
        f"{config.activation}, {config.norm} {config.norm_position}-norm, {config.position} positions, "
        f"context {config.block_size}, vocabulary {config.vocab_size}"
    )
    toc = "\n".join(f'<li><a href="#{esc(Path(p.file).stem)}">{esc(p.title)}</a></li>' for p in pictures)
    figures = "\n".join(
        f'<figure id="{esc(Path(p.file).stem)}"><h2>{esc(p.title)}</h2>'
        f'<img src="{esc(p.file)}" alt="{esc(p.title)}"><figcaption>{esc(p.caption)}'
        + (f' <a href="{esc(p.data)}">{esc(p.data)}</a>' if p.data else "")
        + "</figcaption></figure>"
        for p in pictures
    )
    return f"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>gptkit inspect: {esc(title)}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px; padding: 0 1em; color: #222; }}
img {{ max-width: 100%; height: auto; border: 1px solid #ddd; }}
figure {{ margin: 2em 0; }}
figcaption {{ color: #555; margin-top: 0.5em; }}
pre {{ background: #f4f4f4; padding: 0.8em; white-space: pre-wrap; }}
</style>
</head>
<body>
<h1>gptkit inspect: {esc(title)}</h1>
<p>{esc(summary)}</p>
<p>Prompt:</p>
<pre>{esc(prompt)}</pre>
<ul>
{toc}
</ul>
{figures}
</body>
</html>
"""
