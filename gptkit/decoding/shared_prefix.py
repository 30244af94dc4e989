"""Rows of a batch that read a shared prompt prefix from one cache row (gptkit.decoding.batch, the fused step).

Requests that begin with the same tokens (a system prompt, a document asked several questions) hold the same keys
and values there, each in its own cache row: prefill copies or recomputes them. Decoding, every row then reads its
own copy, and at 32 rows sharing a 1,000-token prompt those reads are most of a step's memory traffic. Here a
follower row reads its first positions from a leader's cache row instead (csrc/step.cpp's `shared`): one copy
read by every row, which the CPU's caches then hold. The follower's own row keeps its copy, so dropping a share
(the leader leaves, a row re-prefills) needs no copying.

A share covers whole prefill chunks of both prompts, and only positions whose bits the two rows hold equal
(checked once, when the share is made): reading either copy gives the same logits to the bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from gptkit.decoding.request import Request
from gptkit.decoding.step import PREFILL_CHUNK
from gptkit.kv_cache import KVCache


def common_chunks(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading positions a and b share, in whole PREFILL_CHUNKs."""
    limit, n = min(len(a), len(b)), 0
    while n + PREFILL_CHUNK <= limit and a[n : n + PREFILL_CHUNK] == b[n : n + PREFILL_CHUNK]:
        n += PREFILL_CHUNK
    return n


def same_span(cache: KVCache, row: int, other: int, length: int) -> bool:
    """Whether two cache rows hold the same bits at positions [0, length) of every layer."""
    return all(torch.equal(t[row, :, :length], t[other, :, :length]) for t in cache.tensors)


@dataclass
class Share:
    """A follower reads its first `length` positions from its leader's cache row."""

    follower: Request
    leader: Request
    length: int


class SharedPrefixes:
    """Which rows read their first positions from another's cache row, by id(follower)."""

    def __init__(self) -> None:
        self._shares: dict[int, Share] = {}
        self._rewritten: set[int] = set()  # ids of rows whose cache no longer holds their prompt at its positions

    def __len__(self) -> int:
        return len(self._shares)

    def admit(self, new: Sequence[Request], rows: list[Request], cache: KVCache) -> None:
        """Give each newly admitted request (its prompt in its row) the longest share a row without one offers."""
        index = {id(r): i for i, r in enumerate(rows)}
        waiting = {id(r) for r in new}  # a new request leads only those admitted after it (no chains)
        for request in new:
            waiting.discard(id(request))
            leaders = [
                r
                for r in rows
                if r is not request and r.adapter == request.adapter and id(r) not in waiting and self._may_lead(r)
            ]
            offers = [(common_chunks(r.prompt, request.prompt), i) for i, r in enumerate(leaders)]
            length, best = max(offers, key=lambda offer: offer[0], default=(0, -1))  # the first of equals
            if length and same_span(cache, index[id(leaders[best])], index[id(request)], length):
                self._shares[id(request)] = Share(request, leaders[best], length)

    def leave(self, request: Request) -> None:
        """Drop the shares request takes part in: it leaves its row (finished or cancelled)."""
        self._end(request)
        self._rewritten.discard(id(request))

    def rewrite(self, request: Request) -> None:
        """Drop the shares request takes part in, for good: its row is written anew (a learned-position row whose
        window slides), so its positions no longer hold its prompt."""
        self._end(request)
        self._rewritten.add(id(request))

    def _may_lead(self, request: Request) -> bool:
        return id(request) not in self._shares and id(request) not in self._rewritten and not request.done

    def _end(self, request: Request) -> None:
        """Drop request's own share; its followers follow the first of them instead, over the positions they all
        still share (equal bits: each equals the old leader's there)."""
        self._shares.pop(id(request), None)
        followers = [share for share in self._shares.values() if share.leader is request]
        if not followers:
            return
        heir = self._shares.pop(id(followers[0].follower))
        for share in followers[1:]:
            share.leader, share.length = heir.follower, min(share.length, heir.length)

    def pairs(self, rows: list[Request], slots: Sequence[int]) -> Tensor | None:
        """(len(slots), 2) int64: for each step row (its request's index in slots) the cache row it reads its
        shared prefix from and the prefix's length (its own row and 0 where it has none); None where no row has."""
        if not self._shares:
            return None
        index = {id(r): i for i, r in enumerate(rows)}
        pairs = []
        for slot in slots:
            share = self._shares.get(id(rows[slot]))
            pairs.append((slot, 0) if share is None else (index[id(share.leader)], share.length))
        return torch.tensor(pairs, dtype=torch.long)
