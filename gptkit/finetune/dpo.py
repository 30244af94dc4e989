"""Direct preference optimisation (Rafailov et al. 2023): the loss from policy and reference log-probabilities.

For a prompt x with a chosen completion y_w and a rejected one y_l, the implicit reward of a completion is
beta * (log pi(y | x) - log ref(y | x)), summed over the completion's tokens, and the loss is
-log sigmoid(reward(y_w) - reward(y_l)): log 2 while the policy equals the reference, falling as the policy
prefers the chosen completion more than the reference does.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from gptkit.loss import IGNORE_INDEX


def sequence_logprobs(logits: Tensor, targets: Tensor) -> Tensor:
    """Each row's summed log-probability (B,) of its targets (positions holding IGNORE_INDEX count nothing)."""
    B, T, V = logits.shape
    nll = F.cross_entropy(logits.float().reshape(-1, V), targets.reshape(-1), ignore_index=IGNORE_INDEX,
                          reduction="none")  # fmt: skip
    return -nll.view(B, T).sum(dim=1)


def dpo_loss(policy_chosen: Tensor, policy_rejected: Tensor, reference_chosen: Tensor, reference_rejected: Tensor,
             beta: float) -> dict[str, Tensor]:  # fmt: skip
    """Per pair: the loss, the chosen and rejected implicit rewards, their margin and whether it is positive."""
    chosen = beta * (policy_chosen - reference_chosen)
    rejected = beta * (policy_rejected - reference_rejected)
    margin = chosen - rejected
    return {"loss": -F.logsigmoid(margin), "chosen_reward": chosen, "rejected_reward": rejected, "margin": margin,
            "accuracy": (margin > 0).float()}  # fmt: skip
