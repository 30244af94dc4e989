"""Speculative decoding: a small draft model proposes k tokens, the target checks them all in one forward pass.

Greedy: the target's argmax at every checked position decides; the output is exactly the target's greedy output
(up to float ties), however good or bad the draft. Sampling: Leviathan et al. 2023's rule: accept draft token x with
probability min(1, p(x) / q(x)), on rejection draw from max(0, p - q) renormalised, so the output follows the
target's (filtered) distribution.

Both caches are written at explicit positions, so rejected tokens need no undo: the next pass overwrites them and
attention with an integer start position never reads beyond the tokens fed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from gptkit.errors import ConfigError
from gptkit.generation import (
    DRAFT_K, Completion, Decode, Engine, EosIds, Row, _base, _device_dtype, _inference, _seeded, _window, end_ids,
)  # fmt: skip
from gptkit.kv_cache import KVCache
from gptkit.model import GPT
from gptkit.sampling import SamplingParams, process_logits


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
        return {"draft_proposed": self.proposed, "draft_accepted": self.accepted,
                "target_passes": self.target_passes, "acceptance_rate": self.acceptance_rate}  # fmt: skip


def check_draft(target: GPT, draft: GPT, params: SamplingParams, k: int) -> None:
    """Raise ConfigError when draft cannot speculate for target under params."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ConfigError(f"the draft must propose k >= 1 tokens per pass, got {k!r}")
    t_vocab, d_vocab = _base(target).config.vocab_size, _base(draft).config.vocab_size
    if t_vocab != d_vocab:
        raise ConfigError(f"the draft's vocabulary ({d_vocab}) differs from the target's ({t_vocab}); a draft "
                          "must share the target's tokenizer")  # fmt: skip
    if params.num_beams > 1:
        raise ConfigError("speculative decoding does not combine with beam search; use num_beams=1 or no draft")
    if params.repetition_penalty not in (None, 1.0):
        raise ConfigError("speculative decoding does not support repetition_penalty; drop it or the draft")


def fits(target: GPT, draft: GPT, total_len: int) -> bool:
    """Whether both models can hold total_len positions (a learned-position model stops at block_size)."""
    return all((_window(m, total_len) or total_len) >= total_len for m in (target, draft))


def _ids(tokens: Sequence[int], device: torch.device) -> Tensor:
    return torch.tensor([list(tokens)], dtype=torch.long, device=device)


def _probs(logits: Tensor, params: SamplingParams) -> Tensor:
    """The sampling distribution (rows of logits (N, V)) after params' filters."""
    return process_logits(logits.float(), params).softmax(dim=-1)


def speculative_generate(
    target: GPT,
    draft: GPT,
    prompt: Sequence[int],
    params: SamplingParams,
    k: int = DRAFT_K,
    eos_id: EosIds = None,
    decode: Decode | None = None,
    seed: int | None = None,
) -> tuple[Completion, SpeculativeStats]:
    """One completion of prompt by target, with draft proposing up to k tokens per target pass."""
    check_draft(target, draft, params, k)
    if params.stop and decode is None:
        raise ConfigError("stop strings need a decode function (a tokenizer) to find them in the output")
    device, dtype = _device_dtype(target)
    d_device, d_dtype = _device_dtype(draft)
    total = len(prompt) + params.max_new_tokens + k
    t_cache = KVCache(_base(target).config, 1, total, device=device, dtype=dtype)
    d_cache = KVCache(_base(draft).config, 1, total, device=d_device, dtype=d_dtype)
    row = Row(list(prompt), len(prompt), params, _seeded(device, seed), end_ids(eos_id), decode,
              position=len(prompt))  # fmt: skip
    stats = SpeculativeStats()
    with _inference(target), _inference(draft):
        logits = target(_ids(prompt, device), cache=t_cache, start_pos=0)[0, -1:]
        Engine._accept(row, _pick(logits, params, row.generator)[0])
        drafted = 0  # the draft's cache holds the tokens at positions [0, drafted)
        while not row.done:
            L = len(row.tokens)  # the target's cache holds positions [0, L - 1)
            n_prop = min(k, params.max_new_tokens - len(row.generated) - 1)  # the target adds one more itself
            proposals: list[int] = []
            q_rows: list[Tensor] = []
            feed, pos = row.tokens[drafted:L], drafted
            for _ in range(n_prop):
                d_logits = draft(_ids(feed, d_device), cache=d_cache, start_pos=pos)[0, -1:].to(device)
                pos += len(feed)
                if params.greedy:
                    token = int(d_logits.argmax())
                else:
                    q = _probs(d_logits, params)
                    token = int(torch.multinomial(q, 1, generator=row.generator))
                    q_rows.append(q[0])
                proposals.append(token)
                feed = [token]
            t_logits = target(_ids([row.tokens[-1], *proposals], device), cache=t_cache, start_pos=L - 1)[0]
            if params.greedy:
                accepted, extra = _verify_greedy(t_logits, proposals)
            else:
                accepted, extra = _verify_sampled(t_logits, proposals, q_rows, params, row.generator)
            stats.proposed += n_prop
            stats.accepted += accepted
            stats.target_passes += 1
            drafted = min(pos, L + accepted)
            for token in [*proposals[:accepted], extra]:
                Engine._accept(row, token)
                if row.done:
                    break
    return Completion(row.generated, row.finish_reason), stats


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
    """The accept/reject rule: (proposals accepted, the token drawn after them)."""
    p = _probs(t_logits, params)  # (n_prop + 1, V)
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
