"""What a fine-tuning step minimises: the next-token loss, DPO over preference pairs, or a label head's loss.

The training loop knows an objective only through `loss(forward, batch)`: the batch's mean loss and a few
statistics (means over the batch's units: trained tokens, pairs or texts) to log. `evaluate` averages the same
over a split, so training and validation report the same quantities.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from gptkit.data import Batch, Examples, example_batches
from gptkit.finetune.dpo import dpo_loss, sequence_logprobs
from gptkit.loss import IGNORE_INDEX

Stats = dict[str, Tensor]


class Objective(Protocol):
    """A training objective: the loss of a batch, and what to log beside it."""

    def loss(self, forward: Callable[..., Any], batch: Batch) -> tuple[Tensor, Stats]:
        """(the batch's mean loss, statistics: each a mean over the batch's units)."""
        ...


class LanguageModeling:
    """The mean next-token loss over the trained targets."""

    def loss(self, forward: Callable[..., Any], batch: Batch) -> tuple[Tensor, Stats]:
        """The batch's mean next-token loss; nothing else to log."""
        return forward(batch.x, targets=batch.y, document_ids=batch.document_ids), {}


class Preference:
    """DPO over rows that alternate chosen and rejected completions of the same prompt.

    reference(x) gives the frozen reference model's logits (the starting model; with LoRA, the same base with
    the adapters off). nll_weight > 0 adds the chosen completions' mean next-token loss (TRL's rpo_alpha), which
    keeps the tokens that chosen and rejected share from drifting while the margin grows."""

    def __init__(self, beta: float, reference: Callable[[Tensor], Tensor], nll_weight: float = 0.0) -> None:
        self.beta = beta
        self.reference = reference
        self.nll_weight = nll_weight

    def loss(self, forward: Callable[..., Any], batch: Batch) -> tuple[Tensor, Stats]:
        """The mean DPO loss over the batch's pairs, with the implicit rewards, margin and preference accuracy."""
        policy = sequence_logprobs(forward(batch.x), batch.y)  # (2P,): chosen, rejected, chosen, ...
        with torch.no_grad():
            reference = sequence_logprobs(self.reference(batch.x), batch.y)
        out = dpo_loss(policy[0::2], policy[1::2], reference[0::2], reference[1::2], self.beta)
        stats = {name: out[name].detach().mean() for name in ("chosen_reward", "rejected_reward", "margin", "accuracy")}
        if not self.nll_weight:
            return out["loss"].mean(), stats
        chosen_tokens = (batch.y[0::2] != IGNORE_INDEX).sum().clamp(min=1)
        nll = -policy[0::2].sum() / chosen_tokens
        stats["chosen_nll"] = nll.detach()
        return out["loss"].mean() + self.nll_weight * nll, stats


class Classification:
    """Cross-entropy of a label head (gptkit.finetune.heads) plus lm_weight times the next-token loss."""

    def __init__(self, lm_weight: float) -> None:
        self.lm_weight = lm_weight

    def loss(self, forward: Callable[..., Any], batch: Batch) -> tuple[Tensor, Stats]:
        """The mean loss over the batch's texts, with the label loss and accuracy (and the LM loss, if weighted)."""
        # A batch of one-token texts has no next token to predict (and a mean over none is NaN).
        lm = self.lm_weight > 0 and bool((batch.y != IGNORE_INDEX).any())
        logits, lm_loss = forward(batch.x, batch.last, targets=batch.y if lm else None)
        label_loss = F.cross_entropy(logits.float(), batch.labels)
        stats = {"label_loss": label_loss.detach(), "accuracy": (logits.argmax(-1) == batch.labels).float().mean()}
        if lm_loss is None:
            return label_loss, stats
        stats["lm_loss"] = lm_loss.detach()
        return label_loss + self.lm_weight * lm_loss, stats


@torch.no_grad()
def evaluate(objective: Objective, forward: Callable[..., Any], examples: Examples, block_size: int,
             batch_size: int, limit: int | None, order: np.ndarray | None,
             device: torch.device) -> dict[str, float]:  # fmt: skip
    """The objective's loss and statistics averaged over the first `limit` items of a split (in `order`)."""
    sums: dict[str, Tensor] = {}
    units = 0
    for batch in example_batches(examples, block_size, batch_size, limit, order):
        if not batch.units:
            continue
        loss, stats = objective.loss(forward, batch.to(lambda t: t.to(device)))
        for name, value in {"loss": loss, **stats}.items():
            sums[name] = sums.get(name, 0) + value.float() * batch.units
        units += batch.units
    return {name: float(total) / max(units, 1) for name, total in sums.items()}

