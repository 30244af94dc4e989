"""Checking proposed tokens against the target: what draft-model and lookup speculation share.

A proposer (a draft model, gptkit.decoding.speculative; a lookup in the request's own tokens, gptkit.decoding.lookup)
offers up to k tokens as a Proposal; the target's logits at the request's last token and at each proposed one, from
one forward pass, decide in take(), which hands the request the tokens it keeps.

Greedy: the target's argmax at every checked position decides; the output is exactly the target's greedy output
(up to float ties), however good or bad the proposals. Sampling: Leviathan et al. 2023's rule: accept proposed token
x with probability min(1, p(x) / q(x)), on rejection draw from max(0, p - q) renormalised, so the output follows the
target's (filtered) distribution. A lookup's proposal is certain, q a point mass at x: the rule accepts with
probability p(x) and on rejection draws from p with x removed, renormalised (gptkit.decoding.lookup derives it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

from gptkit.decoding.request import Request
from gptkit.decoding.sampling import SamplingParams, process_logits


@dataclass
class SpeculativeStats:
    """How the draft fared: tokens proposed, tokens the target accepted, and target forward passes."""

    proposed: int = 0
    accepted: int = 0
    target_passes: int = 0

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted / proposed (None before anything was proposed)."""
        return self.accepted / self.proposed if self.proposed else None

    def add(self, other: SpeculativeStats) -> None:
        """Accumulate another request's counts."""
        self.proposed += other.proposed
        self.accepted += other.accepted
        self.target_passes += other.target_passes

    def to_dict(self) -> dict[str, float | int | None]:
        """The counts and the acceptance rate, for JSON."""
        return {
            "draft_proposed": self.proposed,
            "draft_accepted": self.accepted,
            "target_passes": self.target_passes,
            "acceptance_rate": self.acceptance_rate,
        }


@dataclass
class Proposal:
    """Tokens a proposer offers, and the distributions they were drawn from (q, sampling with a draft model only;
    empty: each token is certain, a point mass)."""

    tokens: list[int]
    q_rows: list[Tensor] = field(default_factory=list)


class Proposer(Protocol):
    """What offers tokens for the target to check: a draft model or a lookup in the request's own tokens."""

    def propose(self, request: Request, n: int) -> Proposal:
        """Up to n tokens to follow request.tokens."""
        ...


def speculable(params: SamplingParams) -> bool:
    """Whether params let the target check proposals: no beams, penalties, logit bias or grammar."""
    return (
        params.num_beams == 1
        and params.repetition_penalty in (None, 1.0)
        and not params.reshapes_logits
        and params.json_schema is None
    )


def probs(logits: Tensor, params: SamplingParams) -> Tensor:
    """The sampling distribution (rows of logits (N, V)) after params' filters."""
    return process_logits(logits.float(), params).softmax(dim=-1)


def room(request: Request, k: int) -> int:
    """Tokens to propose: up to k, leaving the one token the target adds itself within max_new_tokens."""
    return min(k, request.params.max_new_tokens - len(request.generated) - 1)


def take(t_logits: Tensor, proposal: Proposal, request: Request, stats: SpeculativeStats) -> int:
    """Check a proposal against the target's logits (n + 1, V) at the request's last token and the n proposed
    ones; the request takes the accepted tokens and the target's next one. Returns how many were accepted."""
    params, tokens = request.params, proposal.tokens
    if params.greedy:
        accepted, extra = _verify_greedy(t_logits, tokens)
    else:
        accepted, extra = _verify_sampled(t_logits, tokens, proposal.q_rows, params, request.generator)
    stats.proposed += len(tokens)
    stats.accepted += accepted
    stats.target_passes += 1
    for token in [*tokens[:accepted], extra]:
        request.accept(token)
        if request.done:
            break
    return accepted


def _verify_greedy(t_logits: Tensor, proposals: list[int]) -> tuple[int, int]:
    """(leading proposals equal to the target's argmax, the target's token after them)."""
    best = t_logits.float().argmax(dim=-1).tolist()  # one host sync for all k + 1 positions
    n = 0
    while n < len(proposals) and proposals[n] == best[n]:
        n += 1
    return n, best[n]


def _verify_sampled(
    t_logits: Tensor, proposals: list[int], q_rows: list[Tensor], params: SamplingParams, generator: torch.Generator
) -> tuple[int, int]:
    """The accept/reject rule: (proposals accepted, the token drawn after them). No q_rows: each proposal is a
    point mass (q(x) = 1), so x is accepted with probability p(x) and a rejection draws from p without x."""
    p = probs(t_logits, params)  # (n_prop + 1, V)
    if proposals and not q_rows:
        q_rows = [torch.zeros_like(p[0]).index_fill_(0, torch.tensor([x], device=p.device), 1.0) for x in proposals]
    if proposals:
        index = torch.tensor(proposals, device=p.device)[:, None]
        p_x = p[:-1].gather(1, index)[:, 0]
        q_x = torch.stack(q_rows).gather(1, index)[:, 0]
        u = torch.rand(len(proposals), generator=generator, device=p.device)
        ok = (u * q_x <= p_x).tolist()  # u < p/q without dividing by a zero q
    else:
        ok = []
    n = 0
    while n < len(proposals) and ok[n]:
        n += 1
    if n < len(proposals):
        residual = (p[n] - q_rows[n]).clamp(min=0)
        if float(residual.sum()) <= 0:  # p == q: any draw from p is right
            residual = p[n]
        dist = residual / residual.sum()
    else:
        dist = p[n]
    return n, int(torch.multinomial(dist[None], 1, generator=generator))
