"""The fused decode step's slots (csrc/step.cpp): several rows in one cache row at consecutive positions give the
logits and cache of successive single-row steps, to the bit; what would be wrong is refused."""

from __future__ import annotations

import pytest
import torch
from helpers import TINY, VARIANTS, filled_cache

from gptkit.config import ModelConfig
from gptkit.decoding import fused
from gptkit.decoding.step import inference
from gptkit.model import GPT
from gptkit.native import library

pytestmark = pytest.mark.skipif(not library.load(), reason="this CPU has neither AVX2 nor AVX-512: no fused step")

LLAMA = VARIANTS["llama-gqa"]
# Rows (cache row, position): three of cache row 0 at p, p + 1, p + 2 and one of cache row 1 between them.
ROWS = [(0, 4), (0, 5), (1, 9), (0, 6)]


@pytest.fixture(autouse=True)
def fused_chosen(monkeypatch):
    """The fused step as if measured faster here (it is chosen per machine; these tests check what it computes)."""
    monkeypatch.setitem(library.STATE, "choices", dict(library.choices(), fused_step=True))


def joined_and_single(config: dict, stored: torch.dtype, rows: list[tuple[int, int]], threads: int = 1):
    """(logits of one step over rows, logits of one single-row step per row in turn, both caches)."""
    torch.manual_seed(0)
    model = GPT(ModelConfig(**config)).eval()
    step = fused.step_for(model)
    assert step is not None
    joined_cache, single_cache = filled_cache(model, stored), filled_cache(model, stored)
    tokens = torch.randint(0, model.config.vocab_size, (len(rows), 1), generator=torch.Generator().manual_seed(2))
    slots = torch.tensor([slot for slot, _ in rows])
    positions = torch.tensor([p for _, p in rows])
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with inference(model):
            joined = step(model, tokens, joined_cache, positions, slots)
            single = [
                step(model, tokens[b : b + 1], single_cache.row(slot, model.config.block_size), positions[b : b + 1])
                for b, slot in enumerate(slots.tolist())
            ]
    finally:
        torch.set_num_threads(before)
    return joined, torch.cat(single), joined_cache, single_cache


SLIDING = dict(LLAMA, sliding_window=8)  # every layer's cache a ring of 8 slots


@pytest.mark.parametrize(
    "config, stored, rows, threads",
    [
        (TINY, torch.float32, ROWS, 1),
        (LLAMA, torch.float32, ROWS, 1),
        (LLAMA, torch.float32, ROWS, 2),
        (LLAMA, torch.int8, ROWS, 1),
        (LLAMA, torch.bfloat16, ROWS, 1),
        (SLIDING, torch.float32, [(0, 2), (0, 3), (1, 12), (0, 4)], 1),  # cache row 0 does not wrap its ring
    ],
    ids=["gpt2", "llama-gqa", "llama-gqa-2-threads", "int8-cache", "bf16-cache", "sliding-window"],
)
def test_rows_sharing_a_cache_row_give_successive_single_steps_to_the_bit(config, stored, rows, threads):
    joined, single, joined_cache, single_cache = joined_and_single(config, stored, rows, threads)
    assert torch.equal(joined, single)
    for a, b in zip(joined_cache.tensors, single_cache.tensors):
        assert torch.equal(a, b)


def test_rows_sharing_a_cache_row_past_a_ring_are_refused():
    """Cache row 0 at 7 and 8 in rings of 8 slots: position 8's keys would overwrite position 0's, which the row at
    7 still attends to."""
    with pytest.raises(RuntimeError, match="would wrap the ring of layer 0"):
        joined_and_single(SLIDING, torch.float32, [(0, 7), (0, 8)])


@pytest.mark.parametrize(
    "rows, slots, message",
    [
        ([3, 3], [0, 0], "two rows write position 3 of cache row 0"),
        ([3, 4], [0, 2], "cache row 2 outside the cache's 2"),
        ([3, 4], [0], "one int64 cache row per row"),
    ],
)
def test_slots_that_would_be_wrong_are_refused(rows, slots, message):
    torch.manual_seed(0)
    model = GPT(ModelConfig(**LLAMA)).eval()
    step = fused.step_for(model)
    assert step is not None
    tokens = torch.zeros(len(rows), 1, dtype=torch.long)
    with inference(model), pytest.raises(RuntimeError, match=message):
        step(model, tokens, filled_cache(model, torch.float32), torch.tensor(rows), torch.tensor(slots))
