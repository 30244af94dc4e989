"""Lookup proposals checked inside the batch's fused decode step (gptkit.decoding.lookup_rows): the rows a step
plans, and greedy output through the engine equal to plain greedy decoding, token for token, with no eager pass."""

from __future__ import annotations

import pytest
import torch
from helpers import sharpened

from gptkit.config import ModelConfig
from gptkit.decoding import batch, fused
from gptkit.decoding.api import complete
from gptkit.decoding.lookup_rows import plan
from gptkit.decoding.options import DecodeOptions
from gptkit.decoding.request import Request
from gptkit.decoding.sampling import SamplingParams
from gptkit.native import library

GREEDY = SamplingParams(max_new_tokens=40, temperature=0)
ROPE = dict(vocab_size=32, block_size=128, n_layer=2, n_head=4, n_embd=32, norm="rmsnorm", position="rope")
PROMPT = [5, 6, 7, 9, 10, 11, 12, 13] * 4 + [5, 6]  # repeats: lookup proposes from the first tokens on


def looking(prompt: list[int], params: SamplingParams = GREEDY, top_logprobs: int | None = None) -> Request:
    """A request that asks for lookup of up to 8 tokens, as if just prefilled (its last token at the prompt's end)."""
    request = Request(prompt, params, top_logprobs=top_logprobs, lookup_k=8, lookup_ngram=3)
    request.position = len(prompt) - 1
    return request


def test_each_proposal_follows_its_requests_row_in_its_cache_row():
    requests = [looking(PROMPT), looking([1, 2, 3, 4]), looking([3, 4, 3, 4])]
    positions = [r.position for r in requests]
    rows = plan(requests, positions, 4, 128, 16)
    assert rows.first == [0, 5, 6] and rows.plain() == [1]
    assert rows.tokens == [6, 7, 9, 10, 11, 4, 4, 3, 4, 3, 4]
    assert rows.slots == [0] * 5 + [1] + [2] * 5
    assert rows.positions == [33, 34, 35, 36, 37, 3, 3, 4, 5, 6, 7]
    assert [len(p.tokens) for p in rows.proposals.values()] == [4, 4]


def test_proposals_are_cut_to_the_rows_and_cache_positions_left_and_skip_what_cannot_be_checked():
    requests = [looking(PROMPT), looking([3, 4, 3, 4]), looking(PROMPT, top_logprobs=2)]
    rows = plan(requests, [r.position for r in requests], 8, 36, 8)
    assert len(rows.proposals[0].tokens) == 2  # cache positions 34 and 35 are left after 33
    assert len(rows.proposals[1].tokens) == 3  # 8 rows in all: 3 requests, 2 proposed already
    assert 2 not in rows.proposals and len(rows.tokens) == 8
    full = looking(PROMPT)
    full.position = 36  # a learned-position row whose window slides: its step re-prefills, no proposal
    assert plan([full], [0], 8, 36, 8).proposals == {}


def test_proposals_grow_a_step_only_within_the_batch_size_its_requests_already_take():
    """A step's rows stay within fused.MAX_ROWS, or the size of WIDE_ROWS its requests were measured at: growing past
    it would time another size in the middle of a step."""
    assert [fused.row_limit(k) for k in (1, 8, 9, 16, 17, 128)] == [8, 8, 16, 16, 32, 128]
    assert fused.row_limit(129) == 129  # (a batch the fused step never takes)


@pytest.fixture
def fused_only(monkeypatch):
    """The fused step forced on (as if measured faster) and counted: its calls with rows sharing cache rows; the
    eager checking pass refused."""
    if not library.load():
        pytest.skip("this CPU has neither AVX2 nor AVX-512: no fused step")
    monkeypatch.setitem(library.STATE, "choices", dict(library.choices(), fused_step=True))
    calls = {"shared": 0}
    step_for = fused.step_for

    def counted(model):
        step = step_for(model)

        def counting(model, tokens, cache, positions, slots=None, shared=None):
            calls["shared"] += slots is not None
            return step(model, tokens, cache, positions, slots, shared)

        return counting if step is not None else None

    def no_eager_pass(*args):
        raise AssertionError("the eager checking pass ran")

    monkeypatch.setattr(fused, "step_for", counted)
    monkeypatch.setattr(batch, "extend", no_eager_pass)
    return calls


@pytest.mark.parametrize(
    "config, kv_cache",
    [
        (dict(ROPE, n_kv_head=2, activation="swiglu"), None),
        (dict(ROPE, n_kv_head=2, activation="swiglu"), "int8"),
        (dict(ROPE, position="learned", block_size=48), None),  # the window slides past block_size
    ],
    ids=["gqa", "gqa-int8-cache", "learned-window"],
)
@pytest.mark.parametrize("prompts", [[PROMPT], [PROMPT, [3, 1, 4, 1, 5], [7, 8, 7, 8, 7]]], ids=["1", "3"])
def test_greedy_output_with_proposals_in_the_fused_step_is_plain_greedy(config, kv_cache, prompts, fused_only):
    model = sharpened(ModelConfig(**config))
    plain = complete(model, prompts, GREEDY, options=DecodeOptions(kv_cache=kv_cache))
    assert fused_only["shared"] == 0
    options = DecodeOptions(lookup=True, lookup_k=4, kv_cache=kv_cache)
    looked = complete(model, prompts, GREEDY, options=options)
    assert [r[0].ids for r in looked.completions] == [r[0].ids for r in plain.completions]
    stats = looked.timing.speculative
    assert stats is not None and stats.accepted > 0 and fused_only["shared"] > 0
    assert stats.target_passes <= fused_only["shared"] * len(prompts)  # each check rode in a step


def test_sampling_checks_each_proposal_on_the_models_logits_after_it(fused_only, monkeypatch):
    """verify.take (tests/decoding/test_lookup.py checks its rule) gets, at the request's last token and at each
    proposed one, the model's logits after it: the eager model over the whole sequence, within 1e-4 of the largest
    logit (the fused step's agreement with the eager one, gptkit/decoding/fused.py)."""
    model = sharpened(ModelConfig(**dict(ROPE, n_kv_head=2, activation="swiglu")), scale=3.0)
    checked = []
    take = batch.take

    def kept(t_logits, proposal, request, stats):
        checked.append((list(request.tokens), list(proposal.tokens), t_logits.clone()))
        return take(t_logits, proposal, request, stats)

    monkeypatch.setattr(batch, "take", kept)
    params = SamplingParams(max_new_tokens=30, temperature=1.0, seed=3)
    result = complete(model, [PROMPT, [7, 8, 7, 8, 7]], params, options=DecodeOptions(lookup=True, lookup_k=3))
    assert len(checked) > 5 and result.timing.speculative.accepted > 0 and fused_only["shared"] > 0
    with torch.no_grad():
        for tokens, proposal, t_logits in checked:
            want = model(torch.tensor([tokens + proposal]))[0, len(tokens) - 1 :]  # (n + 1, V)
            assert (t_logits - want).abs().max() <= 1e-4 * want.abs().max()
