"""Rows of the batch engine reading a shared prompt prefix from one cache row (gptkit.decoding.shared_prefix):
greedy output equal to the engine's without shares, token for token, as rows join, leave and slide; and which rows
share what."""

from __future__ import annotations

import pytest
from helpers import sharpened

from gptkit.config import ModelConfig
from gptkit.decoding import fused
from gptkit.decoding.batch import BatchEngine
from gptkit.decoding.request import Request
from gptkit.decoding.sampling import SamplingParams
from gptkit.decoding.shared_prefix import SharedPrefixes, common_chunks
from gptkit.native import library

ROPE = dict(vocab_size=32, block_size=256, n_layer=2, n_head=4, n_embd=32, norm="rmsnorm", position="rope")
PREFIX = [(7 * i + 3) % 31 for i in range(140)]  # two whole prefill chunks of 64, and 12 tokens more
PROMPTS = [PREFIX + [1, 2, 3], PREFIX + [4, 5], PREFIX[:100] + [9] * 5, [3, 1, 4]]
LENGTHS = [6, 30, 30, 30]  # new tokens per prompt: the first (the longest prompt, which others follow) leaves first


@pytest.fixture
def shares_seen(monkeypatch):
    """The fused step forced on (as if measured faster), each call's shared pairs recorded."""
    if not library.load():
        pytest.skip("this CPU has neither AVX2 nor AVX-512: no fused step")
    monkeypatch.setitem(library.STATE, "choices", dict(library.choices(), fused_step=True))
    seen: list[list[tuple[int, int]]] = []
    step_for = fused.step_for

    def recorded(model):
        step = step_for(model)

        def recording(model, tokens, cache, positions, slots=None, shared=None):
            seen.append([] if shared is None else [tuple(pair) for pair in shared.tolist()])
            return step(model, tokens, cache, positions, slots, shared)

        return recording

    monkeypatch.setattr(fused, "step_for", recorded)
    return seen


def run(model, prompts, lengths, share: bool, later: int = 0) -> list[list[int]]:
    """Each prompt's greedy tokens through one engine (the last `later` prompts admitted after 3 steps)."""
    engine = BatchEngine(model, batch_size=len(prompts), max_len=model.config.block_size)
    engine.shares_prefixes = share
    requests = [Request(list(p), SamplingParams(max_new_tokens=n, temperature=0)) for p, n in zip(prompts, lengths)]
    first = len(requests) - later
    engine.add(requests[:first])
    for step in range(200):
        if step == 3 and later:
            engine.add(requests[first:])
        if not engine.rows and step > 3:
            break
        engine.step()
    return [r.tokens[len(r.prompt) :] for r in requests]


@pytest.mark.parametrize(
    "config",
    [dict(ROPE, n_kv_head=2, activation="swiglu"), dict(ROPE, position="learned", block_size=160)],
    ids=["gqa", "learned-window"],  # learned: past 160 positions each row's window slides (its row written anew)
)
@pytest.mark.parametrize("later", [0, 2], ids=["together", "two-later"])
def test_greedy_output_reading_shared_prefixes_is_the_engines_own(config, later, shares_seen):
    model = sharpened(ModelConfig(**config))
    alone = run(model, PROMPTS, LENGTHS, share=False, later=later)
    assert all(pair[1] == 0 for pairs in shares_seen for pair in pairs)
    shares_seen.clear()
    shared = run(model, PROMPTS, LENGTHS, share=True, later=later)
    assert shared == alone
    lengths = {pair[1] for pairs in shares_seen for pair in pairs}
    assert {128, 64} <= lengths  # the prompts sharing PREFIX share two chunks; PREFIX[:100]'s shares one


def test_followers_follow_the_first_of_them_when_their_leader_leaves(shares_seen):
    model = sharpened(ModelConfig(**dict(ROPE, n_kv_head=2, activation="swiglu")))
    engine = BatchEngine(model, batch_size=4, max_len=256)
    requests = [Request(list(p), SamplingParams(max_new_tokens=n, temperature=0)) for p, n in zip(PROMPTS, LENGTHS)]
    engine.add(requests)
    engine.step()
    assert shares_seen[-1] == [(0, 0), (0, 128), (0, 64), (3, 0)]  # rows by prompt length: the longest leads
    while requests[0] in engine.rows:
        engine.step()
    engine.step()
    # The leader left; its row took the last row's request ([3, 1, 4], no share); rows 1 and 2 follow row 1.
    assert [r.prompt for r in engine.rows] == [PROMPTS[3], PROMPTS[1], PROMPTS[2]]
    assert shares_seen[-1] == [(0, 0), (1, 0), (1, 64)]


def test_a_share_is_made_only_over_equal_bits_and_whole_chunks():
    assert common_chunks(PREFIX, PREFIX + [1]) == 128 and common_chunks(PREFIX[:100], PREFIX) == 64
    assert common_chunks([1] * 63, [1] * 63) == 0
    model = sharpened(ModelConfig(**dict(ROPE, n_kv_head=2)))
    engine = BatchEngine(model, batch_size=2, max_len=256)
    requests = [Request(list(PREFIX), SamplingParams(max_new_tokens=4, temperature=0)) for _ in range(2)]
    engine.add(requests)
    engine.shared = SharedPrefixes()
    engine.cache.tensors[0][1, 0, 5, 0] += 1.0  # one value of the second row's prefix differs
    engine.shared.admit(requests[1:], engine.rows, engine.cache)
    assert len(engine.shared) == 0
    engine.cache.tensors[0][1, 0, 5, 0] -= 1.0
    engine.cache.tensors[0][1, 0, 5, 0] = engine.cache.tensors[0][0, 0, 5, 0]
    engine.shared.admit(requests[1:], engine.rows, engine.cache)
    assert len(engine.shared) == 1
