"""Odds-ratio preference optimisation (Hong et al. 2024, ORPO): supervised learning and preference in one loss, with
no reference model.

For a prompt with a chosen completion y_w and a rejected one y_l, let p(y) be the completion's mean token
probability, exp(mean log pi(y_t | ...)), and odds(y) = p / (1 - p). The loss is the chosen completions' next-token
loss minus beta times the log-sigmoid of the log odds ratio:

    loss = NLL(y_w) - beta * log sigmoid(log odds(y_w) - log odds(y_l))

as TRL's ORPOTrainer computes it (mean token log-probabilities, the NLL a token mean over the batch's chosen
completions, beta its default 0.1). The implicit rewards logged are beta x each mean log-probability.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from gptkit.data import Batch
from gptkit.finetune.objectives import ExampleObjective
from gptkit.finetune.parts import Setup, Stats
from gptkit.loss import IGNORE_INDEX, row_logprobs
from gptkit.settings import PartSettings, check_range


@dataclass
class OrpoSettings(PartSettings):
    """ORPO's settings."""

    # Pairs are whole on every rank.
    data_parallel_only = True

    orpo_beta: float = 0.1  # weight of the odds-ratio term beside the chosen replies' NLL (the paper's lambda)

    def validate(self) -> None:
        """beta > 0."""
        check_range("finetune.orpo_beta", self.orpo_beta, low=0.0, low_open=True)


def orpo_loss(logits: Tensor, targets: Tensor, beta: float) -> tuple[Tensor, Stats]:
    """The mean ORPO loss over rows that alternate chosen and rejected completions (targets IGNORE_INDEX outside the
    completions), and the statistics to log."""
    mean = row_logprobs(logits, targets, "mean")  # (2P,): chosen, rejected, chosen, ...
    chosen, rejected = mean[0::2], mean[1::2]
    # log odds = log p - log(1 - p), with log(1 - p) = log1p(-exp(log p)) (p < 1 for any finite logits)
    log_odds = (chosen - rejected) - (torch.log1p(-torch.exp(chosen)) - torch.log1p(-torch.exp(rejected)))
    ratio = F.logsigmoid(log_odds)
    chosen_targets = targets[0::2]
    nll = F.cross_entropy(
        logits[0::2].float().reshape(-1, logits.size(-1)), chosen_targets.reshape(-1), ignore_index=IGNORE_INDEX
    )
    margin = beta * (chosen - rejected)
    stats = {
        "chosen_nll": nll.detach(),
        "log_odds_ratio": ratio.detach().mean(),
        "log_odds": log_odds.detach().mean(),
        "margin": margin.detach().mean(),
        "accuracy": (margin > 0).float().mean(),
    }
    return nll - beta * ratio.mean(), stats


class OddsRatioPreference(ExampleObjective):
    """ORPO: preference pairs, no reference model."""

    settings_type = OrpoSettings
    data_kinds = ("preferences",)
    task_metrics = {"val_accuracy": "accuracy", "val_log_odds": "log_odds"}
    step_shown = ("accuracy",)

    def __init__(self, setup: Setup) -> None:
        super().__init__(setup)
        self.beta = setup.config.finetune.of(OrpoSettings).orpo_beta

    def loss(self, forward: Callable[..., Any], batch: Batch) -> tuple[Tensor, Stats]:
        """The batch's ORPO loss, with the chosen NLL, the log odds (ratio), the margin and preference accuracy."""
        return orpo_loss(forward(batch.x), batch.y, self.beta)
