"""Kahneman-Tversky optimisation (Ethayarajh et al. 2024, KTO): alignment from completions marked good or bad one by
one ({"prompt", "completion", "label": true|false}), no pairs needed.

A completion's implicit reward is r = log pi(y | x) - log ref(y | x), summed over its tokens. KL is the policy's
divergence from the reference, estimated on mismatched pairs (each prompt with the next example's completion, as
TRL's KTOTrainer does), detached and clamped at 0. The loss of a desirable completion is
desirable_weight * (1 - sigmoid(beta * (r - KL))), of an undesirable one undesirable_weight * (1 - sigmoid(beta *
(KL - r))), and the batch's loss their mean. The reference is the starting model, frozen (with LoRA, the base with
the adapters off), as for DPO. KL is estimated within each micro-batch (with train.batch_size 1 an example is paired
with itself, and KL is 0).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from gptkit.data import Batch
from gptkit.finetune.objectives import ExampleObjective
from gptkit.finetune.parts import Setup, Stats
from gptkit.loss import IGNORE_INDEX, row_logprobs
from gptkit.settings import PartSettings, check_range


@dataclass
class KtoSettings(PartSettings):
    """KTO's settings."""

    # The reference is the model the run starts from.
    needs_base = "aligns an existing model (its frozen copy is the reference)"
    data_parallel_only = True

    kto_beta: float = 0.1  # how far the policy may move from the reference (TRL's default)
    desirable_weight: float = 1.0  # weight of a desirable completion's loss (raise it when they are the fewer)
    undesirable_weight: float = 1.0  # weight of an undesirable completion's loss

    def validate(self) -> None:
        """beta > 0, weights > 0."""
        for key in ("kto_beta", "desirable_weight", "undesirable_weight"):
            check_range(f"finetune.{key}", getattr(self, key), low=0.0, low_open=True)


def mismatched(x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
    """(x, y) of each row's prompt followed by the next row's completion (the last row takes the first's)."""
    rows, width = [], 0
    for i in range(len(x)):
        j = (i + 1) % len(x)
        start = int((y[i] != IGNORE_INDEX).nonzero()[0])  # the prompt is x[i, : start + 1]
        trained = (y[j] != IGNORE_INDEX).nonzero().flatten()
        completion = y[j, int(trained[0]) : int(trained[-1]) + 1]
        rows.append((torch.cat([x[i, : start + 1], completion]), start))
        width = max(width, len(rows[-1][0]) - 1)
    out_x = torch.zeros((len(x), width), dtype=x.dtype, device=x.device)
    out_y = torch.full((len(x), width), IGNORE_INDEX, dtype=y.dtype, device=y.device)
    for r, (ids, start) in enumerate(rows):
        out_x[r, : len(ids) - 1] = ids[:-1]
        out_y[r, start : len(ids) - 1] = ids[start + 1 :]
    return out_x, out_y


def kto_loss(policy: Tensor, reference: Tensor, kl: Tensor, desirable: Tensor, settings: KtoSettings) -> dict:
    """Per completion (B,): the loss, the implicit reward, and whether it agrees with the label (a desirable
    completion's reward above KL, an undesirable one's below: the side the loss pushes it to)."""
    reward = policy - reference
    beta = settings.kto_beta
    good = settings.desirable_weight * (1 - torch.sigmoid(beta * (reward - kl)))
    bad = settings.undesirable_weight * (1 - torch.sigmoid(beta * (kl - reward)))
    return {
        "loss": torch.where(desirable, good, bad),
        "reward": beta * reward,
        "agrees": torch.where(desirable, reward > kl, reward < kl).float(),
    }


class Unpaired(ExampleObjective):
    """KTO: completions marked desirable or not, one by one."""

    settings_type = KtoSettings
    data_kinds = ("unpaired",)
    task_metrics = {"val_accuracy": "accuracy", "val_kl": "kl"}
    step_shown = ("accuracy",)

    def __init__(self, setup: Setup) -> None:
        super().__init__(setup)
        self.settings = setup.config.finetune.of(KtoSettings)
        self.desirable = setup.data.meta.labels.index("true")
        self.reference = setup.method.reference(setup.gpt, setup.config, setup.device)

    def loss(self, forward: Callable[..., Any], batch: Batch) -> tuple[Tensor, Stats]:
        """The batch's mean KTO loss, with the KL estimate, the implicit rewards and how many agree with their label."""
        policy = row_logprobs(forward(batch.x), batch.y, "sum")
        with torch.no_grad():
            reference = row_logprobs(self.reference(batch.x), batch.y, "sum")
            kl_x, kl_y = mismatched(batch.x, batch.y)
            kl = (row_logprobs(forward(kl_x), kl_y, "sum") - row_logprobs(self.reference(kl_x), kl_y, "sum")).mean()
            kl = kl.clamp(min=0)
        desirable = batch.labels == self.desirable
        out = kto_loss(policy, reference, kl, desirable, self.settings)
        good, bad = desirable.float(), (~desirable).float()
        stats = {
            "kl": kl,
            "accuracy": out["agrees"].mean(),
            "desirable_reward": (out["reward"].detach() * good).sum() / good.sum().clamp(min=1),
            "undesirable_reward": (out["reward"].detach() * bad).sum() / bad.sum().clamp(min=1),
        }
        return out["loss"].mean(), stats
