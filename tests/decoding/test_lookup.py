"""Prompt lookup (n-gram) speculation: the proposer on hand-made sequences, greedy output equal to plain decoding,
and sampling that keeps the model's distribution."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import sharpened

from gptkit.cli import main
from gptkit.config import ModelConfig
from gptkit.decoding.api import complete, generate, generate_ids, stream
from gptkit.decoding.batch import BatchEngine
from gptkit.decoding.lookup import Lookup, find
from gptkit.decoding.options import DecodeOptions
from gptkit.decoding.request import Request
from gptkit.decoding.sampling import SamplingParams
from gptkit.decoding.verify import Proposal, SpeculativeStats, take
from gptkit.errors import ConfigError
from gptkit.formats.modeldir import save_model_dir
from gptkit.model import GPT
from gptkit.tokenizer import CharTokenizer

GREEDY = SamplingParams(max_new_tokens=40, temperature=0)
ROPE = dict(vocab_size=32, block_size=128, n_layer=2, n_head=4, n_embd=32, norm="rmsnorm", position="rope")
PROMPT = [5, 6, 7, 9, 10, 11, 12, 13] * 4 + [5, 6]  # repeats: lookup proposes from the first tokens on


def test_the_most_recent_match_of_the_longest_ngram_wins():
    assert find([1, 2, 9, 1, 2, 8, 1, 2], 3, 2) == [8, 1]  # [1, 2] occurs twice: the later one
    assert find([3, 1, 2, 7, 5, 1, 2, 6, 3, 1, 2], 3, 1) == [7]  # [3, 1, 2] beats the later [1, 2]
    assert find([4, 5, 6, 4, 5], 2, 8) == [6, 4, 5, 6, 4, 5, 6, 4]  # k tokens, copying on into the copy
    assert find([8, 8, 8], 3, 3) == [8, 8, 8]


def test_nothing_is_proposed_without_a_match_and_never_more_than_k():
    assert find([1, 2, 3, 4], 3, 4) == []
    assert find([7], 3, 4) == []
    assert find([1, 2, 1], 3, 0) == []
    assert len(find(list(range(10)) * 3, 3, 5)) == 5
    assert find([1000, 70000, 1000], 2, 2) == [70000, 1000]  # ids past a byte, past 16 bits
    assert find([256, 1, 0, 0, 1], 1, 1) == [0]  # the bytes of 256 hold 0 1 0 0: only whole tokens match


def test_the_proposer_caps_at_k_and_at_what_it_is_asked():
    request = Request([1, 2, 3, 1, 2, 3, 1, 2], GREEDY)
    assert Lookup(k=2).propose(request, 5).tokens == [3, 1]
    assert Lookup(k=8).propose(request, 1).tokens == [3]
    with pytest.raises(ConfigError, match="lookup_k"):
        Lookup(k=0)
    with pytest.raises(ConfigError, match="lookup_ngram"):
        Lookup(ngram=-1)


@pytest.mark.parametrize(
    "config",
    [
        dict(ROPE),
        dict(ROPE, n_kv_head=2, activation="swiglu"),
        dict(ROPE, sliding_window=8),  # a ring of W + k + 1 slots in every windowed layer
        dict(ROPE, position="learned", block_size=48),  # the window slides past block_size
    ],
    ids=["rope", "gqa", "sliding-window", "learned-window"],
)
def test_greedy_output_is_plain_greedy_and_proposals_are_accepted(config):
    model = sharpened(ModelConfig(**config))
    prompts = [PROMPT, [3, 1, 4, 1, 5]]
    plain = complete(model, prompts, GREEDY)
    looked = complete(model, prompts, GREEDY, options=DecodeOptions(lookup=True, lookup_k=4))
    assert [r[0].ids for r in looked.completions] == [r[0].ids for r in plain.completions]
    stats = looked.timing.speculative
    assert stats is not None and stats.accepted > 0 and stats.proposed >= stats.accepted
    assert looked.timing.to_dict()["draft_accepted"] == stats.accepted


def test_the_python_api_and_stream_give_the_same_text():
    tokenizer = CharTokenizer(list("abcdefgh ,.\n"))
    model = sharpened(ModelConfig(**dict(ROPE, vocab_size=tokenizer.vocab_size)))
    prompt = "abc def, abc def, abc "
    want = generate(model, tokenizer, prompt, max_new_tokens=30, temperature=0)
    assert generate(model, tokenizer, prompt, max_new_tokens=30, temperature=0, lookup=True) == want
    assert "".join(stream(model, tokenizer, prompt, max_new_tokens=30, temperature=0, lookup=True)) == want
    ids = tokenizer.encode(prompt)
    assert generate_ids(model, ids, max_new_tokens=30, temperature=0, options=DecodeOptions(lookup=True)) == (
        generate_ids(model, ids, max_new_tokens=30, temperature=0)
    )


def test_eos_inside_an_accepted_run_ends_there():
    model = sharpened(ModelConfig(**ROPE))
    plain = generate_ids(model, PROMPT, max_new_tokens=30, temperature=0)
    eos = plain[5]
    want = plain[: plain.index(eos)]
    assert generate_ids(model, PROMPT, max_new_tokens=30, temperature=0, eos_id=eos, lookup=True) == want


def test_lookup_and_a_draft_do_not_combine():
    model = sharpened(ModelConfig(**ROPE))
    with pytest.raises(ConfigError, match="choose one"):
        generate_ids(model, [1, 2], max_new_tokens=3, lookup=True, draft=model)


def test_requests_with_penalties_or_logprobs_decode_without_proposals():
    model = sharpened(ModelConfig(**ROPE))
    params = SamplingParams(max_new_tokens=20, temperature=0, repetition_penalty=1.3)
    engine = BatchEngine(model, 2, 128, lookup_k=8)
    plain = Request(PROMPT, GREEDY, top_logprobs=2, lookup_k=8, lookup_ngram=3)
    engine.add([Request(PROMPT, params, lookup_k=8, lookup_ngram=3), plain])
    while engine.rows:
        engine.step()
    assert engine.speculative.proposed == 0 and len(plain.logprobs) == GREEDY.max_new_tokens


# ----- sampling keeps the distribution -----


def chi2_999(dof: int) -> float:
    """The chi-square distribution's 0.999 quantile by Wilson and Hilferty's cube-root approximation (3 degrees of
    freedom: 16.55, where the exact value is 16.27; 63: 103.5 against 103.4): a correct rule fails one run in about
    a thousand, while a wrong one (always or never accepting) is off by hundreds."""
    z = 3.090  # the standard normal's 0.999 quantile
    return dof * (1 - 2 / (9 * dof) + z * (2 / (9 * dof)) ** 0.5) ** 3


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic of counts against probs, cells expecting under 5 merged into one; (value, dof)."""
    expected = probs.flatten() * counts.sum()
    small = expected < 5
    observed = torch.cat([counts.flatten()[~small], counts.flatten()[small].sum()[None]])
    expected = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = expected > 0
    statistic = float(((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    return statistic, int(keep.sum()) - 1


def test_a_point_mass_proposal_leaves_the_next_token_a_draw_from_p():
    """take() on fixed logits: the first token's frequencies against p, for a proposal with p(x) about 0.3."""
    logits = torch.tensor([[0.2, 1.0, -0.5, 0.6], [0.0, 0.0, 0.0, 0.0]])
    p = logits[0].softmax(-1)
    params = SamplingParams(max_new_tokens=10, temperature=1.0)
    n = 4000
    counts = torch.zeros(4)
    stats = SpeculativeStats()
    for i in range(n):
        request = Request([0], params)
        request.generator = torch.Generator().manual_seed(i)
        take(logits, Proposal([3]), request, stats)
        counts[request.generated[0]] += 1
    assert 0.2 < float(p[3]) < 0.4 and 0 < stats.accepted < n  # both branches of the rule ran
    statistic, dof = chi_square(counts, p)
    assert dof == 3 and statistic < chi2_999(dof)


def _joint3(model: GPT, prompt: list[int], vocab: int) -> torch.Tensor:
    """Exact P(t1, t2, t3) of three sampled tokens after prompt (temperature 1)."""
    with torch.no_grad():
        probs = lambda seq: model(torch.tensor([seq]))[0, -1].softmax(-1)  # noqa: E731
        joint = torch.zeros(vocab, vocab, vocab)
        first = probs(prompt)
        for a in range(vocab):
            second = probs(prompt + [a])
            for b in range(vocab):
                joint[a, b] = first[a] * second[b] * probs(prompt + [a, b])
    return joint


def test_sampled_tokens_through_the_engine_follow_the_model():
    """The third token comes from a lookup pass (the first from the prefill, the second from a step): the joint
    frequencies of all three against the model's exact joint distribution."""
    vocab, prompt = 4, [1, 2, 3, 0, 1, 2]
    model = sharpened(ModelConfig(**dict(ROPE, vocab_size=vocab)), scale=3.0)
    exact = _joint3(model, prompt, vocab)
    n = 3000
    params = SamplingParams(max_new_tokens=4, temperature=1.0, num_samples=n, seed=1)
    result = complete(model, [prompt], params, options=DecodeOptions(lookup=True))
    counts = torch.zeros(vocab, vocab, vocab)
    for completion in result.completions[0]:
        a, b, c = completion.ids[:3]
        counts[a, b, c] += 1
    stats = result.timing.speculative
    assert stats is not None and stats.proposed >= n // 2 and 0 < stats.accepted < stats.proposed
    statistic, dof = chi_square(counts, exact)
    assert dof > 10 and statistic < chi2_999(dof)


def test_gptkit_generate_lookup_prints_the_same_text_and_its_acceptance(tmp_path, capsys):
    tokenizer = CharTokenizer(list("abcdefgh ,.\n"))
    model = sharpened(ModelConfig(**dict(ROPE, vocab_size=tokenizer.vocab_size)))
    model_dir = save_model_dir(model, tmp_path / "model", tokenizer=tokenizer)
    args = ["--prompt", "abc def, abc def, abc ", "--max-new-tokens", "30", "--temperature", "0", "--json"]
    assert main(["generate", str(model_dir), *args]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(["generate", str(model_dir), "--lookup", "--lookup-k", "4", "--lookup-ngram", "2", *args]) == 0
    looked = json.loads(capsys.readouterr().out)
    assert looked["ids"] == plain["ids"] and looked["timing"]["draft_accepted"] > 0
    assert main(["generate", str(model_dir), "--lookup", "--lookup-k", "0", *args]) == 2
    assert "lookup_k must be an integer >= 1" in capsys.readouterr().err


def test_greedy_output_through_the_fused_step_is_plain_greedy(monkeypatch):
    """Where the native kernels load, the batched step is the fused one (forced on, as measured faster): the rows
    without a match and the first token of each step come from it, the rest from the checking pass."""
    from gptkit.native import library

    if not library.load():
        pytest.skip("this CPU has neither AVX2 nor AVX-512: no fused step")
    monkeypatch.setitem(library.STATE, "choices", dict(library.choices(), fused_step=True))
    model = sharpened(ModelConfig(**dict(ROPE, n_kv_head=2, activation="swiglu")))
    assert BatchEngine(model, 2, 128, lookup_k=8).fused is not None
    prompts = [PROMPT, [3, 1, 4, 1, 5]]
    plain = complete(model, prompts, GREEDY)
    looked = complete(model, prompts, GREEDY, options=DecodeOptions(lookup=True))
    assert [r[0].ids for r in looked.completions] == [r[0].ids for r in plain.completions]
    assert looked.timing.speculative is not None and looked.timing.speculative.accepted > 0
