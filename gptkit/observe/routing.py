"""What a mixture of experts' routers do with a text: which experts each token goes to (and with what weight), each
expert's load, and whether experts specialise on kinds of token (punctuation, capitals, newlines, spaces) more than
the text's own mix of them; and the pictures of these for `gptkit inspect` and loss.png.

The routing is read by a forward hook on each MoE layer's router, and the choice recomputed with gptkit.moe.route,
so that nothing in the layer changes to be watched.
"""

from __future__ import annotations

import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from matplotlib.colors import LogNorm
from matplotlib.figure import Figure
from torch import Tensor

from gptkit.errors import InputError
from gptkit.model import GPT
from gptkit.moe import moe_layers, route
from gptkit.observe.figures import new_figure, tick_labels
from gptkit.tokenizer import Tokenizer

if TYPE_CHECKING:  # matplotlib is loaded where a figure is drawn, not for a hint
    from matplotlib.axes import Axes

# Kinds of token the specialisation measure counts, each a test on the token's text.
TOKEN_KINDS: dict[str, Callable[[str], bool]] = {
    "punctuation": lambda text: bool(text.strip()) and all(c in string.punctuation for c in text.strip()),
    "capital": lambda text: text.lstrip()[:1].isupper(),
    "newline": lambda text: "\n" in text,
    "space": lambda text: bool(text) and text.isspace() and "\n" not in text,
}


@dataclass(frozen=True)
class Routing:
    """Each MoE layer's choice for each token: experts and weights (L, N, k), and the layer's block index."""

    blocks: list[int]
    experts: Tensor
    weights: Tensor
    n_experts: int


def routing_of(model: GPT, ids: Sequence[int]) -> Routing:
    """The routing of ids, run in consecutive windows of the model's context (N = len(ids) tokens)."""
    layers = moe_layers(model)
    if not layers:
        raise InputError("this model has no mixture-of-experts layers (model.n_experts is unset): nothing routes")
    block_of = {id(block.mlp): i for i, block in enumerate(model.blocks)}
    captured: list[list[Tensor]] = [[] for _ in layers]
    hooks = [
        layer.router.register_forward_hook(lambda _m, _i, out, i=i: captured[i].append(out.detach()))
        for i, layer in enumerate(layers)
    ]
    device = next(model.parameters()).device
    block = model.config.block_size
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for start in range(0, len(ids), block):
                model(torch.tensor([list(ids[start : start + block])], device=device))
    finally:
        for hook in hooks:
            hook.remove()
        model.train(was_training)
    choices = [
        route(torch.cat(logits).float().cpu(), layer.k, layer.renormalize) for layer, logits in zip(layers, captured)
    ]
    return Routing(
        blocks=[block_of[id(layer)] for layer in layers],
        experts=torch.stack([experts for _, experts in choices]),  # (L, N, k)
        weights=torch.stack([weights for weights, _ in choices]),
        n_experts=layers[0].n_experts,
    )


def gate_matrix(routing: Routing) -> Tensor:
    """(L, N, E): each token's router weight on each expert, 0 where the expert was not chosen."""
    L, N, _ = routing.experts.shape
    return torch.zeros(L, N, routing.n_experts).scatter_(2, routing.experts, routing.weights)


def expert_load(routing: Routing) -> Tensor:
    """(L, E): routed slots per expert in each layer."""
    return torch.stack([torch.bincount(e.reshape(-1), minlength=routing.n_experts) for e in routing.experts])


def token_kinds(texts: Sequence[str]) -> dict[str, np.ndarray]:
    """Each TOKEN_KINDS kind as a boolean array over the tokens' texts."""
    return {kind: np.array([test(text) for text in texts], dtype=bool) for kind, test in TOKEN_KINDS.items()}


def specialisation(experts: Tensor, kinds: dict[str, np.ndarray], n_experts: int) -> dict[str, Any]:
    """For experts (L, N, k) and token kinds (N,) each: the share of each expert's routed tokens of each kind
    ("share", per layer, kind, expert; None for an expert no token chose), the text's share of each kind
    ("text_share"), and per layer and kind the expert whose share is the largest multiple of the text's ("top":
    expert, share, lift = share / text share)."""
    chosen = np.zeros((experts.size(0), experts.size(1), n_experts), dtype=bool)  # (L, N, E) token went to expert
    for layer in range(experts.size(0)):
        chosen[layer, np.arange(experts.size(1))[:, None], experts[layer].numpy()] = True
    per_expert = chosen.sum(axis=1)  # (L, E) tokens each expert took
    shares: list[dict[str, list[float | None]]] = []
    top: list[dict[str, dict[str, float]]] = []
    text_share = {kind: float(mask.mean()) for kind, mask in kinds.items()}
    for layer in range(experts.size(0)):
        layer_shares, layer_top = {}, {}
        for kind, mask in kinds.items():
            hits = (chosen[layer] & mask[:, None]).sum(axis=0)  # (E,) tokens of this kind each expert took
            share = [float(h / n) if n else None for h, n in zip(hits, per_expert[layer])]
            layer_shares[kind] = share
            if text_share[kind] > 0:
                best = max((e for e in range(n_experts) if share[e] is not None), key=lambda e: share[e])
                layer_top[kind] = {"expert": best, "share": share[best], "lift": share[best] / text_share[kind]}
        shares.append(layer_shares)
        top.append(layer_top)
    return {"text_share": text_share, "share": shares, "top": top}


def specialisation_of_text(model: GPT, tokenizer: Tokenizer, text: str) -> dict[str, Any]:
    """specialisation() of the model's routing of text, with the MoE layers' block indices and their load CVs."""
    ids = tokenizer.encode(text)
    routing = routing_of(model, ids)
    load = expert_load(routing).double()
    result = specialisation(routing.experts, token_kinds([tokenizer.decode([i]) for i in ids]), routing.n_experts)
    result.update(
        blocks=routing.blocks, tokens=len(ids), load_cv=(load.std(dim=1, correction=0) / load.mean(dim=1)).tolist()
    )
    return result


def draw_routing(routing: Routing, labels: Sequence[str]) -> Figure:
    """One heatmap per MoE layer: experts (rows) by tokens (columns), each cell the token's router weight on the
    expert (blank where not chosen)."""
    gates = gate_matrix(routing).numpy()  # (L, N, E)
    L, N, E = gates.shape
    fig = new_figure(min(40.0, 2.0 + 0.18 * N), 0.6 + L * (0.3 * E + 0.9))
    for layer in range(L):
        ax = fig.add_subplot(L, 1, layer + 1)
        image = ax.imshow(
            np.ma.masked_equal(gates[layer].T, 0.0),
            aspect="auto",
            cmap="viridis",
            vmin=0,
            vmax=1,
            interpolation="nearest",
        )
        tick_labels(ax, labels, x=layer == L - 1, y=False)
        ax.set_yticks(range(E), [str(e) for e in range(E)], fontsize=7)
        ax.set_ylabel(f"block {routing.blocks[layer]}\nexpert", fontsize=8)
    fig.colorbar(image, ax=fig.axes, label="router weight", shrink=0.8)
    return fig


def load_history(history: Sequence[dict[str, Any]]) -> tuple[np.ndarray, np.ndarray]:
    """(steps (S,), relative load (S, L, E)) from metrics records with moe_tokens_per_expert: each expert's share
    of its layer's routed slots times E (1 everywhere when balanced)."""
    rows = [r for r in history if r.get("moe_tokens_per_expert")]
    counts = np.array([r["moe_tokens_per_expert"] for r in rows], dtype=float)  # (S, L, E)
    totals = counts.sum(axis=2, keepdims=True)
    relative = np.divide(counts * counts.shape[2], totals, out=np.zeros_like(counts), where=totals > 0)
    return np.array([r["step"] for r in rows], dtype=float), relative


def draw_load_history(axes: Axes, history: Sequence[dict[str, Any]]) -> None:
    """Expert load per layer over training on a loss.png panel: a row per layer and expert, a column per
    evaluation, coloured by the expert's load relative to a balanced one (1; log scale from 1/4 to 4)."""
    steps, relative = load_history(history)
    S, L, E = relative.shape
    gaps = np.diff(steps) if S > 1 else np.ones(1)
    before = np.concatenate([gaps[:1], gaps])[:S]  # each column spans halfway to its neighbours
    edges = np.concatenate([steps - before / 2, steps[-1:] + gaps[-1] / 2])
    rows = relative.reshape(S, L * E).T  # (L * E, S): layer 0's experts first
    mesh = axes.pcolormesh(
        edges,
        np.arange(L * E + 1),
        np.clip(rows, 0.25, 4.0),
        cmap="coolwarm",
        shading="flat",
        norm=LogNorm(vmin=0.25, vmax=4.0),
    )
    for layer in range(1, L):
        axes.axhline(layer * E, color="black", linewidth=0.8)
    axes.set_yticks([layer * E + E / 2 for layer in range(L)], [f"MoE layer {layer}" for layer in range(L)])
    axes.invert_yaxis()
    axes.set_ylabel(f"expert load\n({E} experts per layer)")
    key = axes.inset_axes([1.01, 0.0, 0.015, 1.0])
    bar = axes.figure.colorbar(mesh, cax=key, label="load / balanced")
    bar.set_ticks([0.25, 0.5, 1.0, 2.0, 4.0], labels=["1/4", "1/2", "1", "2", "4"])
    bar.minorticks_off()
