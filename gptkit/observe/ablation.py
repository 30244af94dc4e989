"""Whether an induction head carries the model's in-context learning, not just looks like it: mean-ablate it and see
what breaks.

A head is mean-ablated by replacing its output (its slice of the attention's concatenated heads, before the output
projection) with that output's mean over the batch at each position: what the head writes whatever the sequence,
with what it read from this sequence taken out. The model is not changed: a forward pre-hook on the block's output
projection does it, for the duration of a `with mean_ablated(...)` block. The effect of ablating a head is the change
in the repeated-sequence loss of the induction test (higher: the model copies less) and in the ICL score on text
(less negative: the context helps less); both on the same sequences and windows as without ablation, so the change
is paired.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np
from torch import Tensor

from gptkit.model import GPT
from gptkit.observe.measures import icl_score, induction_test, top_heads

ABLATION_WINDOWS = 16  # text windows an ablation's ICL change is measured on (paired: the same with and without)


@contextlib.contextmanager
def mean_ablated(model: GPT, layer: int, head: int) -> Iterator[None]:
    """Within the block, head `head` of block `layer` outputs its mean over the batch at each position."""
    if not (0 <= layer < model.config.n_layer and 0 <= head < model.config.n_head):
        raise ValueError(
            f"no head {head} in layer {layer}: the model has {model.config.n_layer} layers of "
            f"{model.config.n_head} heads, numbered from 0"
        )
    width = model.config.head_dim
    part = slice(head * width, (head + 1) * width)

    def replace(module: Any, args: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        heads = args[0].clone()  # (B, T, H * head_dim)
        heads[..., part] = heads[..., part].mean(dim=0, keepdim=True)
        return (heads, *args[1:])

    handle = model.blocks[layer].attn.proj.register_forward_pre_hook(replace)
    try:
        yield
    finally:
        handle.remove()


def _effects(model: GPT, tokens: np.ndarray | None) -> tuple[float, float | None]:
    """(the induction test's repeated-half loss, the ICL score on ABLATION_WINDOWS windows of tokens or None)."""
    repeat = induction_test(model).repeated_half_loss
    icl = icl_score(model, tokens, ABLATION_WINDOWS) if tokens is not None else None
    return repeat, icl


def ablation_study(model: GPT, scores: Tensor, tokens: np.ndarray | None = None) -> dict[str, Any]:
    """Mean-ablate the strongest induction head (by scores, (n_layer, n_head)) and, one at a time, each head of its
    layer: {"layer", "head", "repeat_change", "icl_change", "layer_heads": [{"head", "repeat_change",
    "icl_change"}, ...]}; the ICL changes are None without text tokens."""
    layer, strongest, _ = top_heads(scores, 1)[0]
    repeat, icl = _effects(model, tokens)
    heads = []
    for head in range(model.config.n_head):
        with mean_ablated(model, layer, head):
            ablated_repeat, ablated_icl = _effects(model, tokens)
        heads.append(
            {
                "head": head,
                "repeat_change": ablated_repeat - repeat,
                "icl_change": None if icl is None else ablated_icl - icl,
            }
        )
    mine = heads[strongest]
    return {
        "layer": layer,
        "head": strongest,
        "repeat_change": mine["repeat_change"],
        "icl_change": mine["icl_change"],
        "layer_heads": heads,
    }
