"""Direct preference optimisation (Rafailov et al. 2023): the loss from policy and reference log-probabilities.

For a prompt x with a chosen completion y_w and a rejected one y_l, the implicit reward of a completion is
beta * (log pi(y | x) - log ref(y | x)), summed over the completion's tokens, and the loss is
-log sigmoid(reward(y_w) - reward(y_l)): log 2 while the policy equals the reference, falling as the policy
prefers the chosen completion more than the reference does.
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


def dpo_loss(
    policy_chosen: Tensor, policy_rejected: Tensor, reference_chosen: Tensor, reference_rejected: Tensor, beta: float
) -> dict[str, Tensor]:
    """Per pair: the loss, the chosen and rejected implicit rewards, their margin and whether it is positive."""
    chosen = beta * (policy_chosen - reference_chosen)
    rejected = beta * (policy_rejected - reference_rejected)
    margin = chosen - rejected
    return {
        "loss": -F.logsigmoid(margin),
        "chosen_reward": chosen,
        "rejected_reward": rejected,
        "margin": margin,
        "accuracy": (margin > 0).float(),
    }


@dataclass
class DpoSettings(PartSettings):
    """DPO's settings."""

    # The reference is the model the run starts from.
    needs_base = "aligns an existing model (its frozen copy is the reference)"
    data_parallel_only = True

    dpo_beta: float = 0.1  # how far the policy may move from the reference (TRL's default)
    dpo_nll_weight: float = 0.0  # weight of the chosen replies' per-token NLL added (TRL's rpo_alpha; 0: off)

    def validate(self) -> None:
        """beta > 0, the NLL weight >= 0."""
        check_range("finetune.dpo_beta", self.dpo_beta, low=0.0, low_open=True)
        check_range("finetune.dpo_nll_weight", self.dpo_nll_weight, low=0.0)


class Preference(ExampleObjective):
    """DPO over rows that alternate chosen and rejected completions of the same prompt.

    The reference is the starting model, frozen (the method's: with LoRA, the same base with the adapters off).
    dpo_nll_weight > 0 adds the chosen completions' mean next-token loss (TRL's rpo_alpha), which keeps the tokens
    that chosen and rejected share from drifting while the margin grows."""

    settings_type = DpoSettings
    data_kinds = ("preferences",)
    task_metrics = {"val_accuracy": "accuracy", "val_margin": "margin"}
    step_shown = ("accuracy",)

    def __init__(self, setup: Setup) -> None:
        super().__init__(setup)
        settings = setup.config.finetune.of(DpoSettings)
        self.beta = settings.dpo_beta
        self.nll_weight = settings.dpo_nll_weight
        self.reference = setup.method.reference(setup.gpt, setup.config, setup.device)

    def loss(self, forward: Callable[..., Any], batch: Batch) -> tuple[Tensor, Stats]:
        """The mean DPO loss over the batch's pairs, with the implicit rewards, margin and preference accuracy."""
        policy = forward(batch.x)
        with torch.no_grad():
            reference = self.reference(batch.x)
        return preference_loss(policy, reference, batch.y, self.beta, self.nll_weight)


def preference_loss(
    policy_logits: Tensor, reference_logits: Tensor, targets: Tensor, beta: float, nll_weight: float = 0.0
) -> tuple[Tensor, Stats]:
    """The mean DPO loss over rows that alternate chosen and rejected completions (targets IGNORE_INDEX outside
    the completions), plus nll_weight x the chosen completions' mean token loss; and the statistics to log."""
    policy = row_logprobs(policy_logits, targets, "sum")  # (2P,): chosen, rejected, chosen, ...
    reference = row_logprobs(reference_logits, targets, "sum").detach()
    out = dpo_loss(policy[0::2], policy[1::2], reference[0::2], reference[1::2], beta)
    stats = {name: out[name].detach().mean() for name in ("chosen_reward", "rejected_reward", "margin", "accuracy")}
    if not nll_weight:
        return out["loss"].mean(), stats
    chosen_tokens = (targets[0::2] != IGNORE_INDEX).sum().clamp(min=1)
    nll = -policy[0::2].sum() / chosen_tokens
    stats["chosen_nll"] = nll.detach()
    return out["loss"].mean() + nll_weight * nll, stats
