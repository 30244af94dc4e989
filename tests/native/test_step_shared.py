"""The fused decode step's shared prefixes (csrc/step.cpp's `shared`): a row that reads its first positions from
another cache row gives the logits it gives reading its own row where that holds the same bits, to the bit; what
would be wrong is refused."""

from __future__ import annotations

import pytest
import torch
from helpers import VARIANTS, filled_cache

from gptkit.config import ModelConfig
from gptkit.decoding import fused
from gptkit.decoding.step import inference
from gptkit.kv_cache import KVCache
from gptkit.model import GPT
from gptkit.native import library

pytestmark = pytest.mark.skipif(not library.load(), reason="this CPU has neither AVX2 nor AVX-512: no fused step")

LLAMA = VARIANTS["llama-gqa"]
POSITIONS = [9, 12, 7]  # rows 0, 1, 2, each in its own cache row


@pytest.fixture(autouse=True)
def fused_chosen(monkeypatch):
    """The fused step as if measured faster here (it is chosen per machine; these tests check what it computes)."""
    monkeypatch.setitem(library.STATE, "choices", dict(library.choices(), fused_step=True))


def model_and_step(config: dict) -> tuple[GPT, fused.FusedStep]:
    torch.manual_seed(0)
    model = GPT(ModelConfig(**config)).eval()
    step = fused.step_for(model)
    assert step is not None
    return model, step


def three_row_cache(model: GPT, stored: torch.dtype, prefix: int) -> KVCache:
    """A filled cache of three rows whose rows 1 and 2 hold row 0's bits at positions [0, prefix)."""
    cache = filled_cache(model, stored, rows=3)
    for t in cache.tensors:
        t[1:, :, :prefix] = t[0, :, :prefix]
    return cache


@pytest.mark.parametrize(
    "config, stored, prefix, threads",
    [
        (VARIANTS["gpt2"], torch.float32, 5, 1),
        (LLAMA, torch.float32, 7, 1),
        (LLAMA, torch.float32, 7, 2),
        (LLAMA, torch.float32, 4, 1),
        (LLAMA, torch.int8, 6, 1),
        (LLAMA, torch.bfloat16, 7, 1),
    ],
    ids=["gpt2", "llama-gqa", "llama-gqa-2-threads", "prefix-of-4", "int8-cache", "bf16-cache"],
)
def test_rows_reading_a_shared_prefix_give_the_logits_of_their_own_rows(config, stored, prefix, threads):
    """Rows 1 and 2 read positions below `prefix` from row 0: with their own copies there wiped, each gives the
    logits it gives reading its own intact copy; row 2's prefix reaches its own position."""
    model, step = model_and_step(config)
    intact, wiped = three_row_cache(model, stored, prefix), three_row_cache(model, stored, prefix)
    for t in wiped.tensors:
        t[1:, :, :prefix] = 0  # what a row not holding the prefix holds; read from here, the logits would change
    tokens = torch.randint(0, model.config.vocab_size, (3, 1), generator=torch.Generator().manual_seed(2))
    positions = torch.tensor(POSITIONS)
    shared = torch.tensor([[0, 0], [0, prefix], [0, min(prefix, POSITIONS[2])]])
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with inference(model):
            alone = step(model, tokens, intact, positions)
            reading = step(model, tokens, wiped, positions, None, shared)
            unshared = step(model, tokens, three_row_cache(model, stored, prefix), positions, None, None)
            wiped_alone = step(model, tokens, wiped, positions)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(reading, alone)
    assert torch.equal(unshared, alone)
    assert not torch.equal(wiped_alone[1:], alone[1:])  # the wiped rows read alone differ: the shares were read


@pytest.mark.parametrize(
    "shared, message",
    [
        ([[0, 0], [0, 13], [0, 0]], "shared prefix of 13 positions past row 1's position 12"),
        ([[0, 0], [3, 5], [0, 0]], "prefix cache row 3 outside the cache's 3"),
        ([[0, 0], [2, 8], [0, 0]], "row 2 writes position 7 of cache row 2 inside the prefix row 1 reads"),
        ([[0, 0], [0, 5]], "a cache row and a length per row"),
    ],
)
def test_shared_prefixes_that_would_be_wrong_are_refused(shared, message):
    model, step = model_and_step(LLAMA)
    with inference(model), pytest.raises(RuntimeError, match=message):
        cache = three_row_cache(model, torch.float32, 4)
        step(model, torch.zeros(3, 1, dtype=torch.long), cache, torch.tensor(POSITIONS), None, torch.tensor(shared))


def test_a_shared_prefix_in_a_ring_is_refused():
    model, step = model_and_step(dict(LLAMA, sliding_window=8))
    with inference(model), pytest.raises(RuntimeError, match="shared prefixes in a windowed layer's ring"):
        cache = three_row_cache(model, torch.float32, 4)
        step(
            model, torch.zeros(3, 1, dtype=torch.long), cache, torch.tensor([5, 6, 7]), None, torch.tensor([[0, 0]] * 3)
        )
