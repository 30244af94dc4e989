"""Exact GELU written as llama.cpp's tanh GELU: the change in a model's logits, measured when it is written.

Every llama.cpp architecture computes GELU as the tanh approximation, so a model trained with exact GELU (nanoGPT's
recipe, the model `make run` trains) runs in llama.cpp with the approximation. The two differ by at most about 5e-4
at any input, and a model's logits move by about as much: measured max-abs differences of 1.1e-3 to 1.4e-3 (logits
up to 9 in size, every greedy token the same) on shakespeare-char-cpu models after 100 and 300 training steps. So
the file is written, with a warning stating the change measured on the model itself; a model whose logits move by
more than MAX_CHANGE is refused with the way out.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

from gptkit.model import GPT, FeedForward
from gptkit.moe import MoEFeedForward

# Chosen, not derived: about 35 times the change measured on the small models above; past it the approximation is
# no longer a rounding, and the model should be trained with gelu_tanh instead.
MAX_CHANGE = 0.05
PROBE_ROWS, PROBE_LENGTH, PROBE_SEED = 4, 128, 0


@contextlib.contextmanager
def computing_tanh_gelu(model: GPT) -> Iterator[None]:
    """Within the block, model's exact-GELU feed-forwards compute the tanh approximation (its weights untouched)."""
    changed: list[nn.Module] = [
        m for m in model.modules() if isinstance(m, (FeedForward, MoEFeedForward)) and m.activation == "gelu"
    ]
    for module in changed:
        module.activation = "gelu_tanh"
    try:
        yield
    finally:
        for module in changed:
            module.activation = "gelu"


@torch.no_grad()
def tanh_gelu_change(model: GPT) -> float:
    """The largest change in model's logits when its exact GELU is computed as the tanh approximation, over a probe
    of random token ids (a fixed seed: the same figure at every export of the same model)."""
    config = model.config
    generator = torch.Generator().manual_seed(PROBE_SEED)
    ids = torch.randint(0, config.vocab_size, (PROBE_ROWS, min(config.block_size, PROBE_LENGTH)), generator=generator)
    ids = ids.to(next(model.parameters()).device)
    training = model.training
    model.eval()
    try:
        exact = model(ids)[..., : config.vocab_size].float()
        with computing_tanh_gelu(model):
            approximated = model(ids)[..., : config.vocab_size].float()
    finally:
        model.train(training)
    return (exact - approximated).abs().max().item()
