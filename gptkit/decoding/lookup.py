"""Prompt lookup (n-gram) drafting: speculation without a draft model, proposals copied from the request itself.

For n from max_ngram down to 1, find the most recent earlier occurrence of the sequence's last n tokens in its own
tokens (prompt and output so far) and propose the k tokens that followed it (copying on into the proposal itself
where the match runs up to the end, as in a repetition); the first n that matches wins. Editing, code and quoting copy long runs of the prompt, so the proposals are often right, and the target
checks them all in one forward pass (gptkit.decoding.verify.take). No match: no proposal, and the batch
engine's step decodes the row as it would without lookup.

Sampling keeps the target's distribution. A proposal x is certain, a point mass q = delta_x, so the draft-model rule
(accept with probability min(1, p(x) / q(x)), on rejection draw from max(0, p - q) renormalised) reads: accept with
probability p(x); on rejection draw from p with x set to zero, renormalised by 1 - p(x). Then
P(out = x) = p(x), and for y != x P(out = y) = (1 - p(x)) * p(y) / (1 - p(x)) = p(y): the output is a draw from p.
Each accepted token is such a draw given the ones before it, so the whole output follows the target's distribution.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from gptkit.decoding.request import Request
from gptkit.decoding.verify import Proposal
from gptkit.errors import ConfigError

# The defaults of `gptkit generate --lookup` and `gptkit serve --lookup`. Not yet chosen by measurement (only smoke
# runs so far: benchmarks/bench_speculation.py gives the figures to choose by): k = 8 because a checking pass of 9
# tokens reads the weights once, as one of 5 does, so on a memory-bound CPU a long copy costs little more per pass;
# matches of 3 tokens down to 1: the longer ones first, being likelier right, the shorter still proposing on text
# that repeats words rather than phrases.
LOOKUP_K = 8
LOOKUP_NGRAM = 3
_ITEM = 4  # bytes per token in the searched buffer (array type "i")


@dataclass(frozen=True)
class Lookup:
    """Propose up to k tokens found after the most recent earlier match of the last ngram..1 tokens."""

    k: int = LOOKUP_K
    ngram: int = LOOKUP_NGRAM

    def __post_init__(self) -> None:
        for name, value in (("lookup_k", self.k), ("lookup_ngram", self.ngram)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")

    def propose(self, request: Request, n: int) -> Proposal:
        """Up to min(n, k) tokens to follow request.tokens (none when nothing matches)."""
        return Proposal(find(request.tokens, self.ngram, min(n, self.k)))


def find(tokens: Sequence[int], max_ngram: int, k: int) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of tokens' last n tokens, for the largest
    n <= max_ngram that occurs earlier; [] when none does (or k < 1)."""
    if k < 1 or len(tokens) < 2:
        return []
    # A byte search runs in C: a 2,000-token sequence is searched in microseconds, not a Python loop's milliseconds.
    data = array("i", tokens).tobytes()
    for n in range(min(max_ngram, len(tokens) - 1), 0, -1):
        start = _rfind(data, data[-n * _ITEM :], len(data) - _ITEM)
        if start >= 0:
            return _copy(tokens, start + n, k)
    return []


def _copy(tokens: Sequence[int], follow: int, k: int) -> list[int]:
    """k tokens copied from index follow on, running into the copy itself past the end (as LZ77 copies an
    overlapping match): a period-p repetition proposes k tokens, not the p left before the end."""
    copied = list(tokens[follow : follow + k])
    while len(copied) < k:
        copied.append(copied[len(copied) - (len(tokens) - follow)])
    return copied


def _rfind(data: bytes, pattern: bytes, end: int) -> int:
    """The token index of pattern's last whole-token occurrence within data[:end], or -1."""
    while True:
        at = data.rfind(pattern, 0, end)
        if at < 0:
            return -1
        if at % _ITEM == 0:
            return at // _ITEM
        end = at + len(pattern) - 1  # a match across token boundaries: look further back
