"""Speculative decoding: a proposer offers up to k tokens, the target checks them all in one forward pass.

A proposer is a small draft model (here) or a lookup in the request's own tokens (gptkit.decoding.lookup, which the
batch engine runs); both hand a Proposal to check(), which verifies it against the target's logits and records the
tokens taken.

Greedy: the target's argmax at every checked position decides; the output is exactly the target's greedy output
(up to float ties), however good or bad the draft. Sampling: Leviathan et al. 2023's rule: accept draft token x with
probability min(1, p(x) / q(x)), on rejection draw from max(0, p - q) renormalised, so the output follows the
target's (filtered) distribution. A lookup's proposal is deterministic: q is a point mass at x, so the rule accepts
with probability p(x) and on rejection draws from p with x removed, renormalised (gptkit.decoding.lookup derives it).

Both caches are written at explicit positions, so rejected tokens need no undo: the next pass overwrites them and
attention never reads a position past the query's (a sliding-window layer's ring holds k + 1 spare slots, so that
rejected tokens never overwrite a position still in the window). With compile, the draft's one-token step and the target's
(k + 1)-token check run compiled at fixed shapes (a short check is padded; its padding lands past every position
read before the next pass overwrites it).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

from gptkit.decoding.request import Request, seeded
from gptkit.decoding.sampling import SamplingParams, process_logits
from gptkit.decoding.step import (
    COMPILE_CACHE_MULTIPLE,
    base,
    compiled,
    device_dtype,
    extend,
    inference,
    new_cache,
    prefill,
    window,
)
from gptkit.errors import ConfigError
from gptkit.model import GPT

DRAFT_K = 4  # tokens a draft model proposes per target pass


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


def check_draft(target: GPT, draft: GPT, params: SamplingParams, k: int) -> None:
    """Raise ConfigError when draft cannot speculate for target under params."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ConfigError(f"the draft must propose k >= 1 tokens per pass, got {k!r}")
    t_vocab, d_vocab = base(target).config.vocab_size, base(draft).config.vocab_size
    if t_vocab != d_vocab:
        raise ConfigError(
            f"the draft's vocabulary ({d_vocab}) differs from the target's ({t_vocab}); a draft "
            "must share the target's tokenizer"
        )
    if params.num_beams > 1:
        raise ConfigError("speculative decoding does not combine with beam search; use num_beams=1 or no draft")
    if not speculable(params):
        raise ConfigError(
            "speculative decoding does not support repetition_penalty, frequency_penalty, "
            "presence_penalty, logit_bias or json_schema; drop them or the draft"
        )


def fits(target: GPT, draft: GPT, total_len: int) -> bool:
    """Whether both models can hold total_len positions (a learned-position model stops at block_size)."""
    return all((window(m) or total_len) >= total_len for m in (target, draft))


def _probs(logits: Tensor, params: SamplingParams) -> Tensor:
    """The sampling distribution (rows of logits (N, V)) after params' filters."""
    return process_logits(logits.float(), params).softmax(dim=-1)


class _Model:
    """One side's cache and calls: compiled at the two fixed shapes of a pass (1 and k + 1 tokens), else eager."""

    def __init__(self, model: GPT, length: int, compile: bool, k: int) -> None:
        self.model, self.compile, self.k = model, compile, k
        self.device, _ = device_dtype(model)
        if compile:
            length = COMPILE_CACHE_MULTIPLE * -(-length // COMPILE_CACHE_MULTIPLE)
        self.cache = new_cache(model, 1, length, spare=k + 1)

    def feed(self, tokens: list[int], position: int) -> Tensor:
        """Logits (len(tokens), V) of tokens written from position on."""
        ids = torch.tensor([tokens], device=self.device)
        if self.compile and len(tokens) in (1, self.k + 1):
            where = torch.tensor([position], device=self.device)
            if len(tokens) == 1:
                return compiled(self.model)(self.model, ids, self.cache, where)
            return compiled(self.model, extend)(self.model, ids, self.cache, where)[0]
        return extend(self.model, ids, self.cache, position)[0]


class DraftProposer:
    """A draft model's proposals: it decodes n tokens from the request's tokens, catching up on those it missed."""

    def __init__(self, side: _Model) -> None:
        self.side = side
        self.filled = 0  # the draft's cache holds the request's tokens at positions [0, filled)
        self.reach = 0  # how far its cache was written by the last proposal

    def propose(self, request: Request, n: int) -> Proposal:
        """Up to n tokens drawn (or argmax'ed) from the draft, with their distributions when sampled."""
        params, tokens = request.params, request.tokens
        proposal = Proposal([])
        pos = self.filled
        for _ in range(n):
            feed = tokens[pos:] if not proposal.tokens else [proposal.tokens[-1]]  # catch up on what it missed
            d_logits = self.side.feed(feed, pos)[-1:].to(self.side.device)
            pos += len(feed)
            if params.greedy:
                token = int(d_logits.argmax())
            else:
                q = _probs(d_logits, params)
                token = int(torch.multinomial(q, 1, generator=request.generator))
                proposal.q_rows.append(q[0])
            proposal.tokens.append(token)
        self.reach = pos
        return proposal

    def taken(self, length: int, accepted: int) -> None:
        """The target took `accepted` proposed tokens after the request's first `length`: the draft's cache holds
        what it wrote up to there."""
        self.filled = min(self.reach, length + accepted)


def speculative_generate(
    target: GPT, draft: GPT, request: Request, k: int = DRAFT_K, compile: bool = False
) -> SpeculativeStats:
    """Decode request to its end with target, draft proposing up to k tokens per target pass; the draft's record."""
    stats = SpeculativeStats()
    for _ in speculate(target, draft, request, stats, k, compile):
        pass
    return stats


def speculate(
    target: GPT, draft: GPT, request: Request, stats: SpeculativeStats, k: int = DRAFT_K, compile: bool = False
) -> Iterator[None]:
    """Decode request speculatively, pausing after the prefill and after each target pass (stats counts them)."""
    params = request.params
    check_draft(target, draft, params, k)
    total = len(request.prompt) + params.max_new_tokens + k + 1
    t_side, proposer = _Model(target, total, compile, k), DraftProposer(_Model(draft, total, compile, k))
    device = t_side.device
    request.generator = request.generator or seeded(device, request.seed)
    with inference(target, draft):
        ids = torch.tensor([request.prompt], device=device)
        logits = prefill(target, ids, t_side.cache, torch.tensor([len(request.prompt)], device=device))
        request.accept(_pick(logits, params, request.generator)[0])
    yield
    while not request.done:
        with inference(target, draft):
            _one_pass(t_side, proposer, request, stats, k)
        yield


def room(request: Request, k: int) -> int:
    """Tokens to propose: up to k, leaving the one token the target adds itself within max_new_tokens."""
    return min(k, request.params.max_new_tokens - len(request.generated) - 1)


def _one_pass(t_side: _Model, proposer: DraftProposer, request: Request, stats: SpeculativeStats, k: int) -> None:
    """The draft proposes, the target checks, the request takes the accepted tokens."""
    L = len(request.tokens)  # the target's cache holds positions [0, L - 1)
    proposal = proposer.propose(request, room(request, k))
    n_prop = len(proposal.tokens)
    check = [request.tokens[-1], *proposal.tokens]
    if t_side.compile:
        check += [0] * (k - n_prop)  # one shape; the padding's positions are overwritten before they are read
    accepted = take(t_side.feed(check, L - 1)[: n_prop + 1], proposal, request, stats)
    proposer.taken(L, accepted)


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


def _pick(logits: Tensor, params: SamplingParams, generator: torch.Generator) -> list[int]:
    """The next token for each row of logits (N, V): argmax, or a draw from the filtered distribution."""
    if params.greedy:
        return logits.float().argmax(dim=-1).tolist()
    return torch.multinomial(_probs(logits, params), 1, generator=generator)[:, 0].tolist()


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
    p = _probs(t_logits, params)  # (n_prop + 1, V)
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
