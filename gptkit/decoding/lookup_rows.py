"""The rows of a batch step whose lookup proposals ride in the fused decode step (gptkit.decoding.batch).

A request whose tokens repeat an earlier n-gram (gptkit.decoding.lookup) runs, beside its own row (its last token at
position p), one row per proposed token at p + 1, p + 2, ..., all in its cache row: the fused step stores every row's
keys and values before any row attends, and each row attends only up to its own position, so each row's logits are
those successive single steps would give (csrc/step.cpp). verify.take then checks the proposal on the request's
n + 1 rows of logits, and the step needs no checking pass of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gptkit.decoding.lookup import Lookup
from gptkit.decoding.request import Request
from gptkit.decoding.verify import Proposal, room, speculable


@dataclass
class StepRows:
    """What one step runs: per row its token, position and cache row; each request's first row, and the proposals
    that ride along by request index (its rows follow its first)."""

    tokens: list[int]
    positions: list[int]
    slots: list[int]
    first: list[int]
    proposals: dict[int, Proposal] = field(default_factory=dict)

    def plain(self) -> list[int]:
        """The requests (by index) decoded one token as without lookup."""
        return [i for i in range(len(self.first)) if i not in self.proposals]


def checks(request: Request) -> bool:
    """Whether a request's proposals may be checked: it asks for lookup, keeps no logprobs, follows no grammar, and
    its sampling lets the target check proposals (verify.speculable)."""
    return (
        not request.done
        and request.lookup_k > 0
        and request.constraint is None
        and request.top_logprobs is None
        and speculable(request.params)
    )


def plan(requests: list[Request], positions: list[int], lookup_k: int, max_len: int, limit: int) -> StepRows:
    """The rows of one step over requests at positions (their cache rows 0..k-1): each eligible request's proposal
    after its own row, cut to fit max_len cache positions, the engine's lookup_k and `limit` rows in all."""
    rows = StepRows([], [], [], [])
    spare = limit - len(requests)  # rows left for proposals
    for i, (request, p) in enumerate(zip(requests, positions)):
        rows.first.append(len(rows.tokens))
        rows.tokens.append(request.last_token)
        rows.positions.append(p)
        rows.slots.append(i)
        proposal = _proposal(request, lookup_k, max_len, spare)
        if proposal is not None:
            n = len(proposal.tokens)
            rows.tokens += proposal.tokens
            rows.positions += range(p + 1, p + 1 + n)
            rows.slots += [i] * n
            rows.proposals[i] = proposal
            spare -= n
    return rows


def _proposal(request: Request, lookup_k: int, max_len: int, spare: int) -> Proposal | None:
    """Request's proposal to follow its last token: at most `spare` tokens, none at a cache position past
    max_len - 1 (a full learned-position row, whose window slides, gets none); None where it has none."""
    if spare < 1 or not checks(request):
        return None
    n = min(room(request, min(request.lookup_k, lookup_k)), max_len - 1 - request.position, spare)
    proposal = Lookup(request.lookup_k, request.lookup_ngram).propose(request, n) if n > 0 else None
    return proposal if proposal is not None and proposal.tokens else None
