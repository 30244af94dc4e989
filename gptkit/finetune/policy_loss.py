"""GRPO's loss from sampled groups: advantages, the clipped importance ratio, and the four ways TRL normalises it.

The advantage of completion i of a group is r_i - mean(r) over the group's scored completions (divided by their
standard deviation with finetune.scale_rewards, as GRPO does); a completion no reward applies to has none and
trains nothing. Every token t of completion i carries A_i, and its loss is PPO's clipped surrogate (Schulman et
al. 2017, as GRPO and TRL use it) plus the KL penalty:

    ratio_it = pi(y_it) / pi_old(y_it)         pi_old: the policy that sampled the completions
    l_it = -min(ratio_it * A_i, clip(ratio_it, 1 - epsilon, 1 + epsilon_high) * A_i) + kl_weight * KL_it

With one update per sampling (num_iterations 1) pi_old is the policy itself, detached: the ratio is 1 and its
gradient that of log pi. KL_it = exp(ref - logp) - (ref - logp) - 1 (Schulman's k3 estimator, GRPO's) against the
starting model. The loss types differ in what sum of l_it they take a mean over (TRL's definitions):

    grpo      each completion's token mean, then the mean over completions (Shao et al. 2024): a long completion
              counts as much as a short one, so each of its tokens counts less
    bnpo      the token mean over a micro-batch; micro-batches weighed equally
    dr_grpo   the sum over tokens / (completions x completion_tokens), a constant (Liu et al. 2025, Dr. GRPO): no
              bias toward long wrong or short right answers
    dapo      the token mean over every completion token of the whole update, all micro-batches and processes
              (Yu et al. 2025, DAPO): each token counts the same however the update is split

With one micro-batch on one process dapo and bnpo are the same loss; dapo is the default (TRL's).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

LossType = Literal["dapo", "grpo", "bnpo", "dr_grpo"]
# Added to a group's standard deviation before dividing by it (TRL's value): a group of nearly equal rewards
# does not blow its tiny differences up to unit size.
STD_EPS = 1e-4


def group_advantages(rewards: Tensor, scale: bool, scored: Tensor | None = None) -> Tensor:
    """(P, G) rewards -> (P, G) advantages: each reward minus the mean of its group's scored rewards, over their
    standard deviation (unbiased, + STD_EPS) when scale; an unscored completion (scored False) and a group with
    fewer than two scored completions have none (zero)."""
    scored = torch.ones_like(rewards, dtype=torch.bool) if scored is None else scored
    count = scored.sum(dim=1, keepdim=True)
    values = torch.where(scored, rewards, torch.zeros_like(rewards))
    mean = values.sum(dim=1, keepdim=True) / count.clamp(min=1)
    centred = torch.where(scored & (count > 1), rewards - mean, torch.zeros_like(rewards))
    if not scale:
        return centred
    variance = (centred**2).sum(dim=1, keepdim=True) / (count - 1).clamp(min=1)
    return centred / (variance.sqrt() + STD_EPS)


@dataclass
class PolicyLoss:
    """The loss of one micro-batch of completions under a loss type (see the module docstring)."""

    loss_type: LossType = "dapo"
    epsilon: float = 0.2  # the ratio's lower clip: 1 - epsilon
    epsilon_high: float = 0.2  # its upper clip: 1 + epsilon_high (DAPO's clip-higher raises it)
    kl_weight: float = 0.0
    completion_tokens: int = 64  # dr_grpo's constant length

    def token_losses(self, logprobs: Tensor, old: Tensor, advantages: Tensor, reference: Tensor | None) -> dict:
        """Per token (N, T): the clipped surrogate with the KL term, and what is logged of it."""
        ratio = torch.exp(logprobs - old)
        clipped = ratio.clamp(1 - self.epsilon, 1 + self.epsilon_high)
        surrogate = torch.minimum(ratio * advantages[:, None], clipped * advantages[:, None])
        out = {"loss": -surrogate, "clipped": (surrogate != ratio * advantages[:, None]).float()}
        if reference is not None:
            delta = reference - logprobs
            out["kl"] = torch.exp(delta) - delta - 1
            out["loss"] = out["loss"] + self.kl_weight * out["kl"]
        return out

    def reduce(self, per_token: Tensor, mask: Tensor) -> Tensor:
        """The micro-batch's loss from its per-token losses (N, T) over the trained tokens (mask): a token mean for
        dapo and bnpo (dapo's weighing across the update is the caller's), a mean of completion means for grpo,
        the sum over completions x completion_tokens for dr_grpo."""
        masked = per_token * mask
        if self.loss_type == "grpo":
            return (masked.sum(dim=1) / mask.sum(dim=1).clamp(min=1)).mean()
        if self.loss_type == "dr_grpo":
            return masked.sum() / (mask.size(0) * self.completion_tokens)
        return masked.sum() / mask.sum().clamp(min=1)


def policy_gradient_loss(
    rule: PolicyLoss,
    logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    reference: Tensor | None = None,
    old: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """(the micro-batch's loss under rule, its statistics: mean KL and clipped fraction over the trained tokens) of
    N completions (mask (N, T), one advantage each (N,)); old is the sampling policy's log-probabilities (default:
    logprobs, detached: one update per sampling)."""
    old = logprobs.detach() if old is None else old
    parts = rule.token_losses(logprobs, old, advantages, reference)
    tokens = mask.sum().clamp(min=1)
    stats = {name: (parts[name] * mask).sum().detach() / tokens for name in ("kl", "clipped") if name in parts}
    return rule.reduce(parts["loss"], mask), stats


def pass_at_k(samples: int, correct: int, k: int) -> float:
    """The chance that at least one of k of the samples passes, estimated without bias from how many of them
    passed (Chen et al. 2021): 1 - C(n - c, k) / C(n, k)."""
    if samples - correct < k:
        return 1.0
    return 1.0 - math.comb(samples - correct, k) / math.comb(samples, k)
