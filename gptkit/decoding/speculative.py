"""Speculative decoding with a draft model: a small model proposes k tokens, the target checks them all in one
forward pass (gptkit.decoding.verify: the check both proposers share, a draft model here and a lookup in the request's
own tokens in gptkit.decoding.lookup).

Both caches are written at explicit positions, so rejected tokens need no undo: the next pass overwrites them and
attention never reads a position past the query's (a sliding-window layer's ring holds k + 1 spare slots, so that
rejected tokens never overwrite a position still in the window). With compile, the draft's one-token step and the target's
(k + 1)-token check run compiled at fixed shapes (a short check is padded; its padding lands past every position
read before the next pass overwrites it).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

from gptkit.decoding.request import Request, seeded
from gptkit.decoding.sampling import SamplingParams
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
from gptkit.decoding.verify import Proposal, SpeculativeStats, probs, room, speculable, take
from gptkit.errors import ConfigError
from gptkit.model import GPT

DRAFT_K = 4  # tokens a draft model proposes per target pass


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
                q = probs(d_logits, params)
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


def _pick(logits: Tensor, params: SamplingParams, generator: torch.Generator) -> list[int]:
    """The next token for each row of logits (N, V): argmax, or a draw from the filtered distribution."""
    if params.greedy:
        return logits.float().argmax(dim=-1).tolist()
    return torch.multinomial(probs(logits, params), 1, generator=generator)[:, 0].tolist()
